"""Every benchmark script still imports: each `benchmarks/*.py` is loaded as a module from its path (its
`main()` is not run), and every `mtp` name it imports — at the top or inside a function — still exists, so
moving or renaming code under `mtp/` cannot silently break a measurement script. A script keeps its work
under `main()` and `if __name__ == "__main__":`, so importing it runs nothing."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def test_there_are_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_imports_without_running(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # scripts import their siblings (heads_compare, heads_scaling)
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])  # a script that parsed arguments on import would exit
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{path.name}: its work belongs in main()"


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_mtp_name_a_script_imports_exists(path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mtp":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):  # a submodule not yet imported by its package
                    importlib.import_module(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mtp":
                    importlib.import_module(alias.name)


# ---- serve_load.py: llama-server as a peer ------------------------------------------------------------


@pytest.fixture
def serve_load(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("benchmark_serve_load", BENCHMARKS / "serve_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_load_llama_server_command_for_c_slots(serve_load):
    cmd = serve_load.llama_server_cmd("/x/llama-server", "/m/model.gguf", 4, 2, 512, 8123, ["--no-repack"])
    assert cmd == [
        "/x/llama-server",
        "-m",
        "/m/model.gguf",
        "-np",
        "4",
        "-c",
        "2048",  # 4 slots x 512: llama-server divides -c among its slots
        "-t",
        "2",
        "-tb",
        "2",
        "--no-webui",
        "--no-repack",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
    ]
    one = serve_load.llama_server_cmd("b", "m.gguf", 1, 1, 300, 1)
    assert one[one.index("-np") + 1] == "1" and one[one.index("-c") + 1] == "300" and "--no-repack" not in one
    with pytest.raises(ValueError, match="slots, threads and context >= 1"):
        serve_load.llama_server_cmd("b", "m.gguf", 0, 2, 512, 1)


def test_serve_load_runs_without_the_peer_saying_why_in_one_line(serve_load, monkeypatch, capsys, tmp_path):
    args, strategies, _ = serve_load.parse_args(["--data", "d", "--no-llamacpp"])
    assert strategies == ["ntp", "conf_adapt:0.9", "verify:4"]
    assert serve_load.llamacpp_peer(args) is None
    assert capsys.readouterr().err == "serve_load: running without the llama-server peer: --no-llamacpp\n"
    args, _, _ = serve_load.parse_args(["--data", "d"])
    monkeypatch.setattr(serve_load.llamacpp_env, "missing", lambda name="llama-server": "llama.cpp is not built")
    assert serve_load.llamacpp_peer(args) is None
    assert capsys.readouterr().err == "serve_load: running without the llama-server peer: llama.cpp is not built\n"
    monkeypatch.setattr(serve_load.llamacpp_env, "missing", lambda name="llama-server": None)
    monkeypatch.setattr(serve_load.llamacpp_env, "binary", lambda name: Path("/b") / name)
    args.model = str(tmp_path)  # a HF directory: llama-server serves a .gguf
    assert serve_load.llamacpp_peer(args) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llama-server needs a .gguf model" in err
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    args.model = str(gguf)
    assert serve_load.llamacpp_peer(args) == ("/b/llama-server", str(gguf)) and capsys.readouterr().err == ""


def _cell(label, c, tokens, wall, lat, prompt_tokens, passes=0, decode=()):
    return {
        "strategy": label,
        "concurrency": c,
        "requests": len(lat),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "latencies": lat,
        "tokens_per_forward": tokens / passes if passes else None,
        "capped_passes": 0,
        "row_passes": passes,
        "outputs": {i: "t" for i in range(len(lat))},
        "prompt_tokens": prompt_tokens,
        "server_decode": list(decode),
    }


def test_serve_load_measure_rotates_the_llama_cell_with_the_strategies(serve_load, monkeypatch):
    args, strategies, _ = serve_load.parse_args(
        ["--data", "d", "--strategies", "ntp,verify:4", "--concurrency", "1,4", "--rounds", "2"]
    )
    order = []

    def fake_run_cell(client, prompts, label, extra, c, n, max_tokens, timeout):
        assert extra == {"mtp": {"strategy": label, "adaptive": True}} and n == max(4, c)
        order.append((c, label))
        return _cell(label, c, 8, 1.0, [1.0], {0: 30})

    def fake_llama_cell(args, peer, prompts, c, n, paused):
        assert peer == ("bin", "m.gguf") and paused == "mtp-proc" and n == max(4, c)
        order.append((c, serve_load.LLAMA))
        return _cell(serve_load.LLAMA, c, 8, 2.0, [2.0], {0: 30})

    monkeypatch.setattr(serve_load, "run_cell", fake_run_cell)
    monkeypatch.setattr(serve_load, "llama_cell", fake_llama_cell)
    monkeypatch.setattr(serve_load, "ask", lambda *a: None)
    cells = serve_load.measure(None, args, ["p"], strategies, "mtp-proc", ("bin", "m.gguf"))
    L = serve_load.LLAMA
    assert order == [
        *[(1, "ntp"), (1, "verify:4"), (1, L)],
        *[(1, "verify:4"), (1, L), (1, "ntp")],
        *[(4, L), (4, "ntp"), (4, "verify:4")],
        *[(4, "ntp"), (4, "verify:4"), (4, L)],
    ]
    assert {k: len(v) for k, v in cells.items()} == {(c, s): 2 for c in (1, 4) for s in ("ntp", "verify:4", L)}
    order.clear()
    serve_load.measure(None, args, ["p"], strategies, "mtp-proc", None)  # no peer: no llama cell
    assert (1, L) not in order and len(order) == 8


def test_serve_load_table_has_the_llama_rows_and_the_ratio_to_them(serve_load):
    args, strategies, _ = serve_load.parse_args(["--data", "d", "--strategies", "ntp,verify:4", "--concurrency", "4"])
    L = serve_load.LLAMA
    table = {
        (4, "ntp"): serve_load.merge_cells([_cell("ntp", 4, 100, 4.0, [1.0, 2.0], {0: 30, 1: 40}, 100)]),
        (4, "verify:4"): serve_load.merge_cells([_cell("verify:4", 4, 100, 2.0, [0.5, 1.0], {0: 30, 1: 40}, 50)]),
        (4, L): serve_load.merge_cells(
            [_cell(L, 4, 100, 5.0, [2.0, 3.0], {0: 30, 1: 41}, decode=[(49, 0.5), (49, 1.5)])]
        ),
    }
    assert table[(4, L)]["server_decode_tokens_per_s"] == pytest.approx(49.0)  # 98 tokens / 2.0 s
    rows, text = serve_load.report(args, strategies, table, {(4, "ntp"): (2, 2)}, {})
    lines = text.splitlines()
    assert "| tokens/s e2e | vs ntp | vs llama-server |" in lines[0]
    assert lines[2] == "| 4 | ntp | 2 | 25.0 | 1.00x | 1.25x | 1.0 | 2.0 | 1.00 | 0/100 | 2/2 |"
    assert lines[3] == "| 4 | verify:4 | 2 | 50.0 | 2.00x | 2.50x | 0.5 | 1.0 | 2.00 | 0/50 | - |"
    assert lines[4] == "| 4 | llama-server (-np 4) | 2 | 20.0 | 0.80x | 1.00x | 2.0 | 3.0 | - | - | - |"
    assert any(x.startswith("c=4: llama-server's own decode-only tokens/s") and "49.0" in x for x in lines)
    assert any("equal to mtp serve's on 1/2 prompts" in x for x in lines)
    by = {r["strategy"]: r for r in rows}
    assert by["verify:4"]["vs_llama_server"] == pytest.approx(2.5) and by[L]["vs_ntp"] == pytest.approx(0.8)
