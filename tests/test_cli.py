"""`mtp generate` end to end on a tiny model with the real tokenizer, and every bad input giving a
one-line error with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import run_cli

from mtp.cli import main


def test_generate_json(tiny_hf_dir, capsys):
    code, out, _ = run_cli(
        [
            "generate",
            "Hello there",
            "--model",
            str(tiny_hf_dir),
            "--adapter",
            "none",
            "--max-new-tokens",
            "7",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    assert set(data) >= {
        "text",
        "token_ids",
        "finish_reason",
        "forward_passes",
        "tokens_per_forward",
        "acceptance_by_position",
        "wall_s",
        "tokens_per_s",
    }
    assert data["finish_reason"] in ("stop", "length")
    assert len(data["token_ids"]) <= 7 and data["tokens_per_forward"] == 1.0


def test_generate_verify_lookup_equals_ntp(tiny_hf_dir, capsys):
    base = [
        "generate",
        "one two one two one two",
        "--model",
        str(tiny_hf_dir),
        "--adapter",
        "none",
        "--max-new-tokens",
        "20",
        "--json",
        "--no-chat",
    ]
    _, ref, _ = run_cli(base + ["--strategy", "ntp"], capsys)
    _, out, _ = run_cli(base + ["--strategy", "verify:4", "--proposer", "lookup"], capsys)
    assert json.loads(out)["token_ids"] == json.loads(ref)["token_ids"]


def test_generate_reads_stdin(tiny_hf_dir, capsys, monkeypatch):
    code, out, err = run_cli(
        ["generate", "--model", str(tiny_hf_dir), "--adapter", "none", "--max-new-tokens", "3"],
        capsys,
        stdin="a prompt from stdin",
        monkeypatch=monkeypatch,
    )
    assert code == 0 and "tokens/forward" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/definitely/not/here"], "model not found"),
        (["--strategy", "fast"], "malformed strategy"),
        (["--strategy", "conf_adapt:1.5"], "tau must be in (0, 1]"),
        (["--strategy", "conf_adapt:0"], "tau must be in (0, 1]"),
        (["--strategy", "verify:0"], "K must be >= 1"),
        (["--strategy", "static:3"], "needs an MTP adapter"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--proposer", "oracle"], "unknown proposer"),
    ],
)
def test_bad_input_one_line_error(tiny_hf_dir, capsys, args, message):
    full = ["generate", "hi", "--model", str(tiny_hf_dir), "--adapter", "none"]
    if args[0] == "--model":
        full = ["generate", "hi", "--adapter", "none"]
    code, _, err = run_cli(full + args, capsys)
    assert code == 2
    assert message in err and err.count("\n") == 1 and err.startswith("mtp: error:")


def test_empty_prompt(tiny_hf_dir, capsys):
    code, _, err = run_cli(["generate", "   ", "--model", str(tiny_hf_dir), "--adapter", "none"], capsys)
    assert code == 2 and "empty prompt" in err


def test_prompt_longer_than_context(tiny_hf_dir, capsys):
    code, _, err = run_cli(["generate", "word " * 600, "--model", str(tiny_hf_dir), "--adapter", "none"], capsys)
    assert code == 2 and "context window" in err


def test_unsupported_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    code, _, err = run_cli(["generate", "hi", "--model", str(tmp_path), "--adapter", "none"], capsys)
    assert code == 2 and "unsupported architecture" in err and "LlamaForCausalLM" in err


def test_console_script_exits_nonzero_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "mtp.cli", "generate", "hi", "--strategy", "verify:-2"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "K must be >= 1" in proc.stderr


def test_generate_quantize_runs_and_needs_pack(tiny_hf_dir, capsys):
    args = ["generate", "Hello", "--model", str(tiny_hf_dir), "--adapter", "none", "--max-new-tokens", "5"]
    code, out, _ = run_cli([*args, "--quantize", "q8_0", "--json"], capsys)
    assert code == 0 and len(json.loads(out)["token_ids"]) == 5
    code, _, err = run_cli([*args, "--quantize", "q4_1", "--no-pack"], capsys)
    assert code == 2 and err.strip().endswith("drop --no-pack") and len(err.strip().splitlines()) == 1


# ---- issue 64: refused before any work, named as the user wrote it --------------------------------
@pytest.fixture
def no_load(monkeypatch):
    """Engine.load fails the test: what these refuse must be refused before any model loads."""
    from mtp.core.engine import Engine

    def load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Engine, "load", load)


def one_line(code, err, *words):
    assert code == 2 and err.startswith("mtp: error:") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


def test_cache_dir_inside_the_shipped_assets_is_refused(monkeypatch, capsys, no_load):
    from mtp.core.runtime.artifacts import ASSETS, ArtifactError, cache_root

    inside = ASSETS / "cache"
    monkeypatch.setenv("MTP_CACHE_DIR", str(inside))
    code, _, err = run_cli(["generate", "hi"], capsys)
    one_line(code, err, "MTP_CACHE_DIR", "shipped assets")
    assert not inside.exists()
    with pytest.raises(ArtifactError, match="MTP_CACHE_DIR"):  # the library refuses it too
        cache_root()
    monkeypatch.setenv("MTP_CACHE_DIR", str(ASSETS.parent / "not-assets-cache"))  # beside them: fine
    assert cache_root() == ASSETS.parent / "not-assets-cache"


def test_a_bogus_kernel_isa_is_refused_before_loading(monkeypatch, capsys, no_load):
    monkeypatch.setenv("MTP_KERNEL_ISA", "bogus")
    code, _, err = run_cli(["generate", "hi"], capsys)
    one_line(code, err, "MTP_KERNEL_ISA='bogus'", "scalar, avx2, avx512, auto")


@pytest.mark.parametrize("command", [["generate"], ["pipeline", "--stages", "2"]])
def test_max_new_tokens_beyond_the_context_is_refused_before_loading(tiny_hf_dir, capsys, no_load, command):
    base = [*command, "hi", "--model", str(tiny_hf_dir), "--adapter", "none"]
    code, _, err = run_cli([*base, "--max-new-tokens", "100000"], capsys)
    one_line(code, err, "--max-new-tokens 100000", "context window", "(512 tokens", "at most 511")
    code, _, err = run_cli([*base, "--max-new-tokens", "512"], capsys)
    one_line(code, err, "at most 511")


def test_bench_max_new_tokens_beyond_the_context_is_refused_before_loading(tiny_hf_dir, tmp_path, capsys, no_load):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    argv = ["bench", "--model", str(tiny_hf_dir), "--adapter", "none", "--data", f"prompts:{prompts}"]
    code, _, err = run_cli([*argv, "--max-new-tokens", "600", "--out", str(tmp_path / "b")], capsys)
    one_line(code, err, "--max-new-tokens 600", "(512 tokens")
    assert not (tmp_path / "b").exists()


def test_max_new_tokens_of_the_shipped_model_is_checked_from_its_header(capsys, no_load):
    from helpers import require_smollm2

    require_smollm2()
    code, _, err = run_cli(["generate", "hi", "--max-new-tokens", "100000"], capsys)
    one_line(code, err, "--max-new-tokens 100000", "smollm2-135m", "(8192 tokens")


@pytest.mark.parametrize("proposer, asset", [("heads", "heads"), ("eagle3+suffix", "datastore")])
def test_an_asset_turned_off_is_named_as_such(capsys, no_load, proposer, asset):
    code, _, err = run_cli(["generate", "hi", "--proposer", proposer, f"--{asset}", "none"], capsys)
    one_line(code, err, f"--proposer {proposer} needs --{asset} DIR", f"--{asset} is 'none'")
    assert "no shipped" not in err


def test_strategy_help_lists_every_strategy(capsys):
    from mtp.core.decoding.strategy import USAGE

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for form in USAGE.removeprefix("expected one of: ").split(", "):
        assert form in help_text, form
    assert "tree:auto" in help_text


def test_data_seal_prints_one_line(tmp_path, capsys):
    folder = tmp_path / "set"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"format": "mtp-data", "version": 2, "shards": []}))
    rec = {"id": "r-1", "prompt_ids": [1, 2], "response_ids": [3, 4, 5]}
    (folder / "train.jsonl").write_text(json.dumps(rec) + "\n")
    code, out, err = run_cli(["data", "--out", str(folder), "--seal"], capsys)
    assert code == 0 and out.count("\n") == 1, out
    summary = json.loads(out)
    assert summary["answers"] == 1 and len(summary["sealed"]) == 1 and summary["shards"] == 1
    assert (folder / "card.md").exists()
    code, out, err = run_cli(["data", "--out", str(folder), "--seal"], capsys)  # nothing left to seal
    assert code == 0 and out.count("\n") == 1 and json.loads(out)["sealed"] == [], out
    assert err.count("\n") == 1 and "nothing to seal" in err, err


def test_export_of_heads_cites_a_section_that_exists(tmp_path, capsys):
    import re
    from pathlib import Path

    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "heads.safetensors").write_bytes(b"")
    (heads / "config.json").write_text("{}")
    for fmt in ("vllm-eagle3", "llamacpp"):
        code, _, err = run_cli(
            ["export", "--format", fmt, "--drafter", str(heads), "--out", str(tmp_path / fmt)], capsys
        )
        one_line(code, err, "DeepSeek-style heads", "mtp train-eagle3")
        doc, section = re.search(r"\((docs/[\w.-]+), '([^']+)'\)", err).groups()
        text = (Path(__file__).resolve().parent.parent / doc).read_text()
        assert f"## {section}\n" in text, (doc, section)
        assert not (tmp_path / fmt).exists()


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C in any command: `mtp: interrupted (Ctrl-C)` on stderr, exit 130, no traceback."""
    from mtp.cli import generate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run", interrupted)
    code, _, err = run_cli(["generate", "hi"], capsys)
    assert code == 130 and err == "mtp: interrupted (Ctrl-C)\n", err
