"""Every CPU kind the project meets (AVX2 only; AVX-512; AVX-512 BF16): bf16 paths that need native
hardware must never run where it is missing.

A machine with native bf16 cannot lose it, but oneDNN can be told to stop at AVX2
(`ONEDNN_MAX_CPU_ISA=AVX2`) and ATen's kernels likewise (`ATEN_CPU_CAPABILITY=avx2`): torch then
reports no bf16 support and raises the very error an AVX2-only EPYC raises ("mkldnn_linear: bf16 path
needs the cpu support ..."). The subprocess tests below run under that environment, so they exercise
the non-native path on every machine (on an AVX2-only machine the variables change nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from helpers import make_tiny_model_dir, tiny_model, write_examples, write_jsonl

from mtp.core.runtime.model import Linear, pack_weights, use_packed

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def avx2_env(tmp_path) -> dict:
    return {**os.environ, **AVX2_ONLY, "MTP_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}


def run(args, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=avx2_env(tmp_path), timeout=300)


def test_the_simulation_takes_native_bf16_away(tmp_path):
    """The premise of this file: under AVX2_ONLY torch has no native bf16, `--amp auto` is off, and a
    bf16 row into a packed float32 weight raises as on an AVX2-only CPU."""
    code = (
        "import torch; from mtp.training.trainer import use_bf16\n"
        "print(bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), use_bf16('auto', 'cpu'))\n"
        "w = torch.randn(8, 16).to_mkldnn(); x = torch.randn(2, 16).bfloat16().to_mkldnn()\n"
        "try:\n    torch._C._nn.mkldnn_linear(x, w, None); print('ran')\n"
        "except RuntimeError as e:\n    print('raised', 'bf16 path needs' in str(e))\n"
    )
    r = run(["-c", code], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "raised", "True"]


def test_packed_weights_serve_float32_rows_only():
    """A bf16 row (autocast) takes the plain linear; a float32 row the packed one, same numbers."""
    model = tiny_model().eval()
    assert pack_weights(model) > 0
    x = torch.randn(3, model.config.dim)
    with torch.no_grad():
        assert use_packed(x) and not use_packed(x.bfloat16())
        lin = next(m for m in model.modules() if isinstance(m, Linear))
        plain = torch.nn.functional.linear(x, lin.weight)
        assert torch.allclose(lin(x), plain, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x.bfloat16())
        assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), plain, atol=0.1, rtol=0.05)


def test_every_trainer_runs_amp_on_without_native_bf16(tmp_path):
    """`--amp on` where bf16 is not native: all three trainers train (autocast around the unpacked
    path); the mask adapter's self-generation and the feature caches included."""
    model = make_tiny_model_dir(tmp_path / "tiny")
    ex = write_examples(tmp_path / "ex.jsonl", 6)
    prompts = write_jsonl(
        tmp_path / "train.jsonl", [{"question": f"w{i} w{i + 1} w{i + 2} w{i + 3}"} for i in range(4)]
    )
    tiny = ["--steps", "2", "--batch-size", "2", "--threads", "1", "--amp", "on", "--model", str(model)]
    commands = {
        "train": [
            "--data",
            str(prompts),
            "--self-generate",
            "--max-new-tokens",
            "6",
            "--k-max",
            "3",
            "--spans",
            "1",
            "--seq-len",
            "32",
        ],
        "train-heads": ["--examples", str(ex), "--cache-dir", str(tmp_path / "c1")],
        "train-eagle3": ["--examples", str(ex), "--cache-dir", str(tmp_path / "c2"), "--val-fraction", "0"],
    }
    for command, extra in commands.items():
        out = tmp_path / command
        r = run(["-m", "mtp.cli", command, *tiny, *extra, "--out", str(out)], tmp_path)
        assert r.returncode == 0, (command, r.stderr[-2000:])
        assert "Traceback" not in r.stderr
        assert json.loads((out / "config.json").read_text())  # the trained artifact is there
