"""`mtp generate` end to end on a tiny model with the real tokenizer, and every bad input giving a
one-line error with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mtp.cli import main


def run_cli(args, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        import io

        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


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
        (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
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
