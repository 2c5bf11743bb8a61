"""Small-row matmul timings: torch's F.linear (float32), oneDNN packed float32 (what `Linear` uses
today: `mtp.core.runtime.model.packed_matmul`) and mtp's batch-invariant kernels (`mtp.core.runtime.kernels`) per
weight format (`-i8`: int8 activations, `qlinear.linear_int8`) and ISA path, at SmolLM2-135M's
shapes and M = 1..32 rows.

    python benchmarks/kernel_matmul.py --threads 1 --out /tmp/kernel_matmul_t1.json
    python benchmarks/kernel_matmul.py --threads 2 --out /tmp/kernel_matmul_t2.json
    python benchmarks/kernel_matmul.py --check        # max |row alone - row in a batch| per op

Candidates are timed interleaved (one call batch of each per round, the rounds repeated) and the
median per call is reported, in milliseconds. Weights are random valid blocks (timings do not depend
on the values). Other processes on the machine move the numbers: say so when quoting them.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp.core.runtime import kernels
from mtp.core.runtime.kernels.qlinear import FORMATS, KernelWeight, linear, linear_int8
from mtp.core.runtime.model import packed_matmul

SHAPES = {
    "qo 576->576": (576, 576),
    "kv 576->192": (576, 192),
    "up 576->1536": (576, 1536),
    "down 1536->576": (1536, 576),
    "head 576->49152": (576, 49152),
}
ROWS = (1, 2, 4, 8, 16, 32)


def cpu_summary() -> dict:
    model, flags = platform.processor(), []
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("Flags:"):
                have = set(line.split(":", 1)[1].split())
                flags = [
                    f
                    for f in (
                        "avx2",
                        "fma",
                        "f16c",
                        "avx512f",
                        "avx512bw",
                        "avx512vl",
                        "avx512dq",
                        "avx512_vnni",
                        "avx_vnni",
                        "avx512_bf16",
                        "amx_tile",
                    )
                    if f in have
                ]
    except (OSError, subprocess.SubprocessError):
        pass
    return {"model": model, "flags": flags}


def random_weight(fmt: str, n: int, k: int, gen: torch.Generator) -> KernelWeight:
    """Random valid blocks (scales ~1e-2, any quants), or float32 N(0, 0.02)."""
    if fmt == "f32":
        return KernelWeight.from_float(torch.randn(n, k, generator=gen) * 0.02)
    size, scale_bytes = FORMATS[fmt]
    blocks = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // 32, scale_bytes // 2, generator=gen) * 0.02 - 0.01).half()
    blocks[:, :, :scale_bytes] = scales.view(torch.uint8).view(n, k // 32, scale_bytes)
    return KernelWeight.from_blocks(blocks.view(n, -1), fmt)


def candidates(k: int, n: int, isas: list[str], formats: list[str], gen) -> dict:
    """name -> (callable(x), weight description)"""
    w32 = torch.randn(n, k, generator=gen) * 0.02
    packed = w32.to_mkldnn()
    out = {"F.linear f32": lambda x: F.linear(x, w32), "oneDNN f32": lambda x: packed_matmul(x, packed)}
    for name in formats:
        fmt, int8 = name.removesuffix("-i8"), name.endswith("-i8")
        kw = random_weight(fmt, n, k, gen) if fmt != "f32" else KernelWeight.from_float(w32)
        if int8:
            kw.packed_int8()  # made once, at load, in real use
        for isa in isas:
            if int8 and kernels.ISAS[isa] > kernels.best_isa_int8():
                continue
            fn = linear_int8 if int8 else linear
            out[f"mtp {name} {isa}"] = functools.partial(call, fn, kw, isa)
    return out


def call(fn, kw, isa, x):
    return fn(x, kw, isa=isa)


def time_round(fn, x, min_s: float) -> float:
    """Seconds per call: calls until min_s has passed (at least 1)."""
    calls, t0 = 0, time.perf_counter()
    while True:
        fn(x)
        calls += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / calls


def bench(args) -> dict:
    gen = torch.Generator().manual_seed(0)
    results = []
    for label, (k, n) in SHAPES.items():
        if args.shapes and not any(s in label for s in args.shapes):
            continue
        cands = candidates(k, n, args.isa, args.formats, gen)
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            times = {name: [] for name in cands}
            for fn in cands.values():  # warm-up
                fn(x)
            for _ in range(args.repeats):
                for name, fn in cands.items():
                    times[name].append(time_round(fn, x, args.min_ms / 1e3))
            row = {
                "shape": label,
                "K": k,
                "N": n,
                "M": m,
                "ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
            }
            results.append(row)
            print(
                f"{label:>16} M={m:<3}" + "".join(f" {name}={v:.4f}" for name, v in row["ms"].items()),
                file=sys.stderr,
                flush=True,
            )
    return {"results": results}


def table(results: list[dict]) -> str:
    names = list(results[0]["ms"])
    head = "| shape | M | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for r in results:
        lines.append(f"| {r['shape']} | {r['M']} | " + " | ".join(f"{r['ms'][n]:.3f}" for n in names) + " |")
    return "\n".join(lines)


def check(args) -> dict:
    """max |row alone - the same row in a batch of 32 at another position| per op and shape."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for label, (k, n) in SHAPES.items():
        if args.shapes and not any(s in label for s in args.shapes):
            continue
        cands = candidates(k, n, args.isa, args.formats, gen)
        x = torch.randn(32, k, generator=gen)
        for name, fn in cands.items():
            full = fn(x)
            worst = 0.0
            for m in range(32):
                alone = fn(x[m : m + 1])[0]
                worst = max(worst, (alone - full[m]).abs().max().item())
                moved = torch.cat([x[m : m + 1], torch.randn(7, k, generator=gen)])  # row first, other neighbours
                worst = max(worst, (fn(moved)[0] - full[m]).abs().max().item())
            out.append({"shape": label, "op": name, "max_abs_diff": worst})
            print(f"{label:>16} {name:>22}: max|row alone - row in batch| = {worst:.3g}")
    return {"check": out}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--shapes", nargs="+", default=None, help="substrings of shape labels (qo kv up down head)")
    p.add_argument(
        "--formats",
        nargs="+",
        default=["f32", "q8_0", "q4_1", "q8_0-i8", "q4_1-i8"],
        help="f32 q8_0 q4_0 q4_1, and q8_0-i8 q4_0-i8 q4_1-i8 for int8 activations",
    )
    p.add_argument("--isa", nargs="+", default=None, help="ISA paths to time (default: avx2 and avx512 if run)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-ms", type=float, default=20.0, help="time per candidate per round")
    p.add_argument("--check", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not kernels.load():
        sys.exit(f"kernel_matmul: the kernels are not available ({kernels.why_unavailable()})")
    if args.isa is None:
        args.isa = [i for i in kernels.supported_isas() if i != "scalar"] or ["scalar"]
    meta = {
        "cpu": cpu_summary(),
        "threads": args.threads,
        "torch": torch.__version__,
        "isas": args.isa,
        "formats": args.formats,
    }
    if args.check:
        res = {**meta, **check(args)}
    else:
        res = {**meta, **bench(args)}
        print(
            f"CPU: {meta['cpu']['model']} ({' '.join(meta['cpu']['flags'])}); threads {args.threads}; "
            "ms per call, median"
        )
        print(table(res["results"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
