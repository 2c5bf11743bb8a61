"""Seconds per EAGLE-3 training step (`mtp train-eagle3`), fp32 vs bf16 autocast (`--amp on`),
measured side by side in one process: the two alternate step by step, the order flipped each round,
after one untimed warm-up step each. The batch is random features of the real trunk's width
(SmolLM2-135M: three layers x 576) and random tokens; a step's cost does not depend on their values.

    python benchmarks/eagle3_step_amp.py --threads 1 --rounds 6 --batch 8 --length 300 --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from mtp.core.decoding.proposers.eagle3 import Eagle3Config
from mtp.core.engine import Engine, EngineConfig
from mtp.training.eagle3_train import init_drafter, ttt_loss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=300, help="tokens per example")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="append one JSON record here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = Engine.load(EngineConfig(model=args.model, adapter="none", threads=args.threads)).model
    model.requires_grad_(False)
    ecfg = Eagle3Config.for_model(model.config, args.draft_vocab, None)
    drafter = init_drafter(model, ecfg, torch.arange(args.draft_vocab), 0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    B, T, A = args.batch, args.length, len(ecfg.aux_layers) * model.config.dim
    batch = {
        "tokens": torch.randint(0, args.draft_vocab, (B, T), generator=g),
        "aux": torch.randn(B, T, A, generator=g),
        "length": torch.full((B,), T),
        "prompt_len": torch.full((B,), min(20, T - 3)),
    }

    def step(amp: bool) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, _ = ttt_loss(drafter, model.embed_tokens, batch, args.ttt_steps)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times = {"fp32": [], "bf16": []}
    step(False), step(True)
    for r in range(args.rounds):
        for amp in (False, True) if r % 2 == 0 else (True, False):
            times["bf16" if amp else "fp32"].append(step(amp))
    med = {k: statistics.median(v) for k, v in times.items()}
    rec = {
        "batch": B,
        "length": T,
        "threads": args.threads,
        "draft_vocab": args.draft_vocab,
        "ttt_steps": args.ttt_steps,
        "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "tokens_per_s": {k: round(B * T / v, 1) for k, v in med.items()},
        "speedup": round(med["fp32"] / med["bf16"], 2),
        "cpu": platform.processor() or platform.machine(),
        "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "time": time.time(),
    }
    print(json.dumps(rec))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
