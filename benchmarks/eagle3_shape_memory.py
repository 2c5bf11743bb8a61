"""Resident memory of EAGLE-3 training steps against the number of distinct batch shapes.

Under bf16 autocast on a CPU the oneDNN kernels keep per-shape state, so a trainer whose batches take
many lengths grows step after step; `eagle3_train.make_batch` pads lengths up to a multiple of
`SHAPE_BUCKET` to bound the number of shapes. This script trains a full-size drafter (SmolLM2-135M's
sizes, random weights and data: memory does not depend on them) for `--steps` steps with batch lengths
drawn from 64..400 and prints RssAnon at a few steps, for: one fixed length, varying lengths unpadded,
varying lengths padded to the bucket. One process per case, so each starts from a clean allocator.

    python benchmarks/eagle3_shape_memory.py --steps 200 --out benchmarks/results/eagle3/shape_buckets
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
from pathlib import Path

import torch

CASES = {"fixed length": ("fixed", 1), "varying, unpadded": ("vary", 1), "varying, bucket 32": ("vary", 32)}


def rss_mb() -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("RssAnon")).split()[1]) // 1024


def one_case(lengths: str, bucket: int, steps: int, amp: bool) -> dict:
    from mtp.core.decoding.proposers.eagle3 import Eagle3Config, Eagle3Drafter
    from mtp.training.eagle3_train import ttt_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Eagle3Config(
        dim=576,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        draft_vocab=4096,
        aux_layers=[2, 15, 27],
    )
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(torch.arange(4096))
    embed = torch.nn.Embedding(49152, 576).requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    rng = random.Random(0)
    marks, shapes = {}, set()
    for step in range(1, steps + 1):
        T = rng.randint(64, 400) if lengths == "vary" else 256
        T = -(-T // bucket) * bucket
        shapes.add(T)
        batch = {
            "tokens": torch.randint(0, 4096, (8, T)),
            "aux": torch.randn(8, T, 1728),
            "length": torch.full((8,), T),
            "prompt_len": torch.full((8,), 10),
        }
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, _ = ttt_loss(drafter, embed, batch, 3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in (20, steps // 2, steps):
            marks[step] = rss_mb()
    return {"rss_anon_mb_at_step": marks, "distinct_lengths": len(shapes)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--amp", choices=("on", "off"), default="on")
    ap.add_argument("--out", default=None, help="folder for results.jsonl")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case in this process
    args = ap.parse_args()
    if args.case:
        lengths, bucket = CASES[args.case]
        print(json.dumps(one_case(lengths, bucket, args.steps, args.amp == "on")))
        return 0
    cpu = next(
        (
            x.split(":", 1)[1].strip()
            for x in Path("/proc/cpuinfo").read_text().splitlines()
            if x.startswith("model name")
        ),
        platform.processor(),
    )
    rows = []
    for case in CASES:
        got = subprocess.run(
            [sys.executable, __file__, "--steps", str(args.steps), "--amp", args.amp, "--case", case],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rec = {
            "case": case,
            "amp": args.amp,
            "steps": args.steps,
            **json.loads(got.strip().splitlines()[-1]),
            "cpu": cpu,
            "torch": torch.__version__,
        }
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "results.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
