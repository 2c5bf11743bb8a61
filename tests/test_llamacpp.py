"""llama.cpp beside mtp, without the llama.cpp build: AMX decisions, the export's folder fixes and its
one-line refusals, the llama-server peers' names, and the server runner against a stand-in `llama-server`
(a small Python HTTP server answering `/health` and `/completion` as llama-server does).
The tests with the real build are in test_llamacpp_server.py (`make llamacpp`)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest
import torch
from helpers import tiny_model

from mtp.cli import main
from mtp.core.decoding.proposers.eagle3 import Eagle3Config, drafter_files
from mtp.core.policy.costmodel import CostModel
from mtp.core.runtime.artifacts import ArtifactError, write_dir_atomic
from mtp.eval import peers
from mtp.interop import llamacpp_env
from mtp.interop.llamacpp_export import check_outtype, drafter_folder, is_llamacpp_export, target_folder
from mtp.interop.llamacpp_server import LlamaServer
from mtp.training.eagle3_train import init_drafter


def one_line_error(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mtp: error:") and needle in err, err
    return err


# ---- AMX: the kernel's grant decides, not the CPU flag ------------------------------------------------------
def test_amx_flag_the_kernel_refuses_turns_native_tuning_and_amx_off():
    flags = {"avx", "avx2", "fma", "f16c", "avx512f", "amx_tile"}
    opts = llamacpp_env.isa_flags({"cpu_flag": True, "kernel_grants": False, "usable": False}, flags)
    assert "-DGGML_NATIVE=OFF" in opts and "-DGGML_AMX_INT8=OFF" in opts and "-DGGML_AMX_TILE=OFF" in opts
    assert "-DGGML_AVX2=ON" in opts and "-DGGML_AVX512=ON" in opts and "-DGGML_AVX512_VNNI=OFF" in opts
    for usable in (
        {"cpu_flag": True, "kernel_grants": True, "usable": True},
        {"cpu_flag": False, "kernel_grants": False, "usable": False},
    ):
        assert llamacpp_env.isa_flags(usable, flags) == ["-DGGML_NATIVE=ON"]


def test_amx_state_is_consistent_here():
    amx = llamacpp_env.amx_state()
    assert set(amx) == {"cpu_flag", "kernel_grants", "usable"}
    assert amx["usable"] == (amx["cpu_flag"] and amx["kernel_grants"])
    assert amx["cpu_flag"] == ("amx_tile" in llamacpp_env.cpu_flags())


def fake_build(root, cmake=("-DGGML_NATIVE=ON",), amx=None, server: str | None = None):
    """A stand-in `.llamacpp/` prefix: stamp, build.json, and optionally build/bin/llama-server."""
    (root / "build" / "bin").mkdir(parents=True)
    (root / f".built-{llamacpp_env.VERSION}").touch()
    (root / "build.json").write_text(
        json.dumps({"version": llamacpp_env.VERSION, "cmake": list(cmake), "amx": amx or llamacpp_env.amx_state()})
    )
    if server is not None:
        path = root / "build" / "bin" / "llama-server"
        path.write_text(f"#!{sys.executable}\n" + server)
        path.chmod(0o755)
    return root


def test_no_repack_only_for_an_amx_build_the_kernel_refuses(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(tmp_path / "a"))
    refused = {"cpu_flag": True, "kernel_grants": False, "usable": False}
    fake_build(tmp_path / "a", amx=refused)
    monkeypatch.setattr(llamacpp_env, "amx_state", lambda: refused)
    assert llamacpp_env.run_flags() == ["--no-repack"]  # native tuning on a CPU flagging AMX
    env = llamacpp_env.environment()
    assert env["version"] == llamacpp_env.VERSION and env["amx"] == refused and env["run_flags"] == ["--no-repack"]
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(tmp_path / "b"))
    fake_build(tmp_path / "b", cmake=["-DGGML_NATIVE=OFF", "-DGGML_AMX_INT8=OFF"], amx=refused)
    assert llamacpp_env.run_flags() == []  # built without AMX: nothing to avoid
    monkeypatch.setattr(llamacpp_env, "amx_state", lambda: {"cpu_flag": True, "kernel_grants": True, "usable": True})
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(tmp_path / "a"))
    assert llamacpp_env.run_flags() == []


def test_a_build_made_for_another_cpu_kind_is_not_run_here(tmp_path, monkeypatch):
    """A prefix kept from an AVX-512 machine on an AVX2-only one: its binaries would die of SIGILL, so
    they count as missing (the reason names the instruction sets) and `build` makes them again."""
    root = fake_build(tmp_path / "a", server="print('hi')")
    info = json.loads((root / "build.json").read_text())
    (root / "build.json").write_text(json.dumps({**info, "isa": ["avx", "avx2", "avx512f", "avx512bw"]}))
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(root))
    monkeypatch.setattr(llamacpp_env, "cpu_flags", lambda: {"fpu", "sse4_2", "avx", "avx2", "fma"})  # Zen 3
    assert llamacpp_env.foreign_isa() == ["avx512bw", "avx512f"]
    assert llamacpp_env.binary("llama-server") is None
    assert "avx512bw, avx512f" in llamacpp_env.missing() and "rebuilds" in llamacpp_env.missing()
    monkeypatch.setattr(llamacpp_env, "cpu_flags", lambda: {"avx", "avx2", "avx512f", "avx512bw", "avx512vl"})
    assert llamacpp_env.foreign_isa() == [] and llamacpp_env.binary("llama-server") is not None
    assert llamacpp_env.missing() is None


def test_bench_environment_says_whether_amx_is_usable(tmp_path, monkeypatch):
    from mtp.eval.bench import environment

    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(tmp_path / "none"))
    env = environment()["llamacpp"]
    assert env["version"] is None and env["amx"] == llamacpp_env.amx_state()


# ---- the export's fixes, on copies -------------------------------------------------------------------------
def test_target_folder_gets_a_tokenizer_config_the_converter_reads(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    original = {
        "backend": "tokenizers",
        "is_local": True,
        "local_files_only": False,
        "bos_token": "<s>",
        "tokenizer_class": "TokenizersBackend",
    }
    (src / "tokenizer_config.json").write_text(json.dumps(original))
    out = target_folder(src, tmp_path / "copy")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc == {"bos_token": "<s>", "tokenizer_class": "GPT2Tokenizer"}
    assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "tokenizer_config.json").read_text()) == original  # the user's folder untouched


def save_tiny_drafter(model, path, aux=(0, 1, 2), draft_vocab=64):
    d = init_drafter(model, Eagle3Config.for_model(model.config, draft_vocab, aux), torch.arange(draft_vocab), 0)
    write_dir_atomic(path, drafter_files(d, model))


def test_drafter_folder_puts_the_aux_layers_at_the_top_level(tmp_path):
    model = tiny_model(vocab_size=300, n_layers=4)
    save_tiny_drafter(model, tmp_path / "d", aux=(0, 2, 3))
    drafter_folder(tmp_path / "d", tmp_path / "x")
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # llama.cpp reads only this one
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # vLLM's
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]


def test_only_an_earlier_export_may_be_replaced(tmp_path):
    d = tmp_path / "e"
    d.mkdir()
    (d / "export.json").write_text(json.dumps({"format": "mtp-llamacpp-export"}))
    (d / "target-f32.gguf").write_bytes(b"")
    assert is_llamacpp_export(d)
    (d / "notes.txt").write_text("mine")
    assert not is_llamacpp_export(d)


@pytest.mark.parametrize("bad", ["q4_1", "F32", "auto", ""])
def test_outtype_the_converter_cannot_write_is_refused(bad):
    with pytest.raises(ArtifactError, match="converter writes f32, f16, bf16, q8_0"):
        check_outtype(bad)


def test_cli_refusals_are_one_line(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(tmp_path / "no-build"))
    from mtp.core.runtime import loading

    model = loading.load(str(tiny_hf_dir)).model
    save_tiny_drafter(model, tmp_path / "mine")
    other = tiny_model(3, vocab_size=49152)
    save_tiny_drafter(other, tmp_path / "other")
    base = ["export", "--format", "llamacpp", "--model", str(tiny_hf_dir), "--out", str(tmp_path / "out")]
    assert main(base + ["--drafter", str(tmp_path / "mine"), "--outtype", "q4_1"]) == 2
    one_line_error(capsys, "--outtype 'q4_1'")
    assert main(base + ["--drafter", str(tmp_path / "mine"), "--draft-tokens", "0"]) == 2
    one_line_error(capsys, "--draft-tokens must be 1..16")
    for bad in ("1.5", "nan", "-0.1"):
        assert main(base + ["--drafter", str(tmp_path / "mine"), "--draft-p-min", bad]) == 2
        one_line_error(capsys, "--draft-p-min must be in [0, 1]")
    assert main(base + ["--drafter", str(tmp_path / "other")]) == 2
    one_line_error(capsys, "trained for another model")
    assert main(base + ["--drafter", str(tmp_path / "mine")]) == 2
    one_line_error(capsys, "make llamacpp")
    assert not (tmp_path / "out").exists()
    assert (
        main(
            ["bench", "--data", "prompts:x.jsonl", "--baselines", "llamacpp-server-ngram", "--out", str(tmp_path / "b")]
        )
        == 2
    )
    one_line_error(capsys, "make llamacpp")


# ---- the llama-server peers ---------------------------------------------------------------------------------
def test_llamacpp_server_peer_names(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(tmp_path / "none"))
    with pytest.raises(ValueError, match="make llamacpp"):
        peers.parse_baselines("llamacpp-server")
    fake_build(tmp_path / "b", server="")
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(tmp_path / "b"))
    assert peers.parse_baselines("llamacpp-server,llamacpp-server-ngram:m.gguf,llamacpp-server-eagle3:D") == [
        "llamacpp-server",
        "llamacpp-server-ngram:m.gguf",
        "llamacpp-server-eagle3:D",
    ]
    for bad in ("llamacpp-server-eagle3", "llamacpp-server:", "llamacpp-server-x"):
        with pytest.raises(ValueError):
            peers.parse_baselines(bad)


def test_tokens_per_pass_from_server_timings():
    # 10 tokens, 4 of them accepted drafts: 6 passes (the prompt's included), as mtp counts them
    assert (
        peers.llamacpp_tokens_per_pass(
            [{"predicted_n": 6, "draft_n_accepted": 3}, {"predicted_n": 4, "draft_n_accepted": 1}]
        )
        == 10 / 6
    )
    assert peers.llamacpp_tokens_per_pass([{"predicted_n": 5}]) == 1.0
    assert peers.llamacpp_tokens_per_pass([]) is None


FAKE_SERVER = textwrap.dedent('''
    """Stand-in llama-server: /health, and /completion answering prompt[-1]+1, +2, ... (its own log: argv)."""
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    LOG = sys.argv[0] + ".requests"
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def reply(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200); self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
        def do_GET(self):
            self.reply({"status": "ok"})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(LOG, "a") as f:
                f.write(json.dumps({"argv": argv, "body": body}) + "\\n")
            n = body["n_predict"]
            ids = [body["prompt"][-1] + 1 + i for i in range(n)]
            t = {"predicted_n": n, "predicted_per_second": 50.0}
            if "--spec-type" in argv:
                t.update(draft_n=n, draft_n_accepted=n // 2)
            self.reply({"tokens": ids, "timings": t, "stop_type": "limit"})
    print("fake llama-server listening", flush=True)
    HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def test_server_runner_sends_ids_greedy_and_reads_timings(tmp_path, monkeypatch):
    root = fake_build(tmp_path / "b", server=FAKE_SERVER)
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(root))
    with LlamaServer(tmp_path / "t.gguf", spec="eagle3", drafter=tmp_path / "d.gguf", threads=1) as srv:
        out = srv.complete([5, 6, 7], 4)
        proc = srv.proc
    assert proc.poll() is not None  # stopped on leaving the block
    assert out["ids"] == [8, 9, 10, 11] and out["timings"]["draft_n_accepted"] == 2
    rec = json.loads((root / "build" / "bin" / "llama-server.requests").read_text().splitlines()[0])
    body, argv = rec["body"], rec["argv"]
    assert body["prompt"] == [5, 6, 7] and body["temperature"] == 0.0 and body["top_k"] == 1
    assert body["cache_prompt"] is False and body["return_tokens"] is True
    assert argv[argv.index("-md") + 1] == str(tmp_path / "d.gguf") and "draft-eagle3" in argv
    assert argv[argv.index("-t") + 1] == "1" and argv[argv.index("-np") + 1] == "1"


def test_server_that_dies_at_start_is_one_error(tmp_path, monkeypatch):
    root = fake_build(tmp_path / "b", server="import sys\nprint('error: bad model file')\nsys.exit(1)\n")
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(root))
    with pytest.raises(RuntimeError, match="bad model file"):
        LlamaServer(tmp_path / "t.gguf")


def test_peer_cuts_at_eos_and_counts_acceptance(tmp_path, monkeypatch, tiny_engine):
    root = fake_build(tmp_path / "b", server=FAKE_SERVER)
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(root))
    (tmp_path / "m.gguf").write_bytes(b"")
    peer = peers.make_peer(f"llamacpp-server-ngram:{tmp_path / 'm.gguf'}")
    assert peer.missing() is None
    peer.setup(tiny_engine)
    try:
        eos = min(tiny_engine.loaded.eos_ids)
        assert peer.generate([eos - 3], 6) == [eos - 2, eos - 1]  # stops before the EOS
        assert peer.tokens_per_forward == 6 / 3
        p = peer.params()
        assert p["spec_type"] == "ngram" and p["server_timings"]["draft_n_accepted"] == 3
    finally:
        peer.server.close()


def test_makefile_pins_the_version_the_build_module_fetches():
    makefile = (llamacpp_env.ROOT / "Makefile").read_text()
    assert f"LLAMACPP_VERSION = {llamacpp_env.VERSION}\n" in makefile
    assert llamacpp_env.SDIST in llamacpp_env.URL and len(llamacpp_env.SHA256) == 64


def test_a_tampered_sdist_is_refused_before_building(tmp_path, monkeypatch):
    bad = tmp_path / llamacpp_env.SDIST
    bad.write_bytes(b"not the sdist")
    monkeypatch.setenv("MTP_LLAMACPP_SDIST", str(bad))
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(tmp_path / "prefix"))
    with pytest.raises(SystemExit, match="expected " + llamacpp_env.SHA256):
        llamacpp_env.build()
    assert not llamacpp_env.stamp().exists()


def test_eagle3_peer_serves_an_export_folder_with_its_draft_count(tmp_path, monkeypatch, tiny_engine):
    root = fake_build(tmp_path / "b", server=FAKE_SERVER)
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(root))
    exp = tmp_path / "exp"
    exp.mkdir()
    for name in ("target-f16.gguf", "drafter-f16.gguf"):
        (exp / name).write_bytes(b"")
    (exp / "export.json").write_text(
        json.dumps(
            {
                "format": "mtp-llamacpp-export",
                "target": "target-f16.gguf",
                "drafter": "drafter-f16.gguf",
                "draft_tokens": 1,
                "draft_p_min": 0.25,
            }
        )
    )
    peer = peers.make_peer(f"llamacpp-server-eagle3:{exp}")
    peer.setup(tiny_engine)
    try:
        peer.generate([100, 101], 2)
    finally:
        peer.server.close()
    argv = json.loads((root / "build" / "bin" / "llama-server.requests").read_text().splitlines()[0])["argv"]
    assert argv[argv.index("-m") + 1] == str(exp / "target-f16.gguf")
    assert argv[argv.index("-md") + 1] == str(exp / "drafter-f16.gguf")
    assert argv[argv.index("--spec-draft-n-max") + 1] == "1" and peer.params()["spec_draft_n_max"] == 1
    assert argv[argv.index("--spec-draft-p-min") + 1] == "0.25" and peer.params()["spec_draft_p_min"] == 0.25
    (exp / "notes.txt").write_text("not an export")
    with pytest.raises(ValueError, match="does not"):
        peers.make_peer(f"llamacpp-server-eagle3:{exp}").setup(tiny_engine)


def test_no_server_outlives_the_process_that_started_it(tmp_path):
    # a bench that never calls close(): its servers stop when it exits, normally or killed
    import subprocess

    root = fake_build(tmp_path / "b", server=FAKE_SERVER)
    script = textwrap.dedent(f"""
        import os, sys
        os.environ["MTP_LLAMACPP_DIR"] = {str(root)!r}
        from mtp.interop.llamacpp_server import LlamaServer
        s = LlamaServer("t.gguf")
        print(s.proc.pid, flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), 9)
    """)
    for how in ("exit", "kill"):
        out = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=60)
        pid = int(out.stdout.split()[0])
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                break  # exited, waiting to be reaped by init
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            pytest.fail(f"server {pid} outlived its parent ({how})")


# ---- the draft count and p-min llama.cpp's t(q) favours -------------------------------------------------------
def synthetic_timings(t, a: float, drafts: int, draft_s: float, steps: int = 10_000) -> list[dict]:
    """llama-server timings of a geometric drafter: per-draft acceptance a, `drafts` per step."""
    pass_time = CostModel(t).pass_time
    accepted = round(steps * sum(a**d for d in range(1, drafts + 1)))
    ms = 1e3 * steps * (pass_time(1 + drafts) + drafts * draft_s)
    half = {
        "predicted_n": (steps + accepted) // 2,
        "predicted_ms": ms / 2,
        "draft_n": steps * drafts // 2,
        "draft_n_accepted": accepted // 2,
    }
    return [half, dict(half)]  # two requests


def test_draft_advice_recovers_the_drafter_and_picks_the_best_count():
    from mtp.interop.llamacpp_profile import advice_line, advise

    t = {1: 0.060, 2: 0.070, 4: 0.080, 8: 0.120}
    pass_time = CostModel(t).pass_time  # the one t(q) reading: interpolated, extrapolated by the linear fit
    assert pass_time(3) == pytest.approx(0.075) and pass_time(0.5) == 0.060
    assert pass_time(10) == pytest.approx(0.120 + 2 * 0.2425 / 28.75)  # least-squares slope of the four points
    adv = advise(t, synthetic_timings(t, 0.7, 3, 0.004))
    assert adv["acceptance"] == pytest.approx(0.7, abs=1e-3) and adv["draft_s"] == pytest.approx(0.004, rel=1e-3)
    # the advised count is the argmax of (1 + a + ... + a^n) / (t(n+1) + n t_draft), computed here by hand
    by_hand = {n: sum(0.7**d for d in range(n + 1)) / (pass_time(n + 1) + n * 0.004) for n in range(8)}
    best = max(by_hand, key=by_hand.get)
    assert adv["n_max"] == best and best not in (0, 7)
    assert adv["speedup"] == pytest.approx(by_hand[best] * 0.060, rel=1e-3)
    extra = 0.004 + pass_time(best + 2) - pass_time(best + 1)
    assert adv["p_min"] == pytest.approx(by_hand[best] * extra, rel=1e-3) and 0 < adv["p_min"] < 1
    assert f"--spec-draft-n-max {best}" in advice_line("row", adv)
    # a drafter that costs more than its accepted tokens save: serve plain
    slow = advise(t, synthetic_timings(t, 0.5, 3, 0.050))
    assert slow["n_max"] == 0 and "serve it plain" in advice_line("row", slow)
    with pytest.raises(ValueError, match="no speculative steps"):
        advise(t, [{"predicted_n": 10, "predicted_ms": 100.0, "draft_n": 0, "draft_n_accepted": 0}])


def test_llama_bench_needs_the_build(monkeypatch):
    from mtp.interop import llamacpp_profile

    monkeypatch.setattr(llamacpp_env, "missing", lambda: "llama.cpp is not built here (make llamacpp)")
    with pytest.raises(ValueError, match="make llamacpp"):
        llamacpp_profile.measure("target.gguf")


def test_server_command_carries_the_advised_draft_settings():
    from mtp.interop.llamacpp_export import server_command

    cmd = server_command("t.gguf", "d.gguf", draft_tokens=2, draft_p_min=0.3)
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "2" and cmd[cmd.index("--spec-draft-p-min") + 1] == "0.3"
    assert "--spec-draft-p-min" not in server_command("t.gguf", "d.gguf")
    assert "--spec-draft-n-max" not in server_command("t.gguf", None, draft_p_min=0.3)
