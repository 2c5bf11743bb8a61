"""Drafting time per row per pass, the rows of a pass drafting one by one vs together (heads batched).

For each strategy (tree:8, verify:4), proposer (heads, heads+suffix+lookup) and batch size B (1, 4, 16):
B GSM8K prompts are prefilled, then decoded `--passes` passes with `decode_step`, every row's proposer
timed (`DecodeStats.proposing_s`, the clock the server prices proposing from). "per-row" turns the heads' batching
off (the heads take no request, so each row drafts in its own call: the code before batching); "batched"
is the default. The two modes alternate run by run (interleaved), `--reps` times, on the same prompts.
It also counts how often a batched heads draft differs from the same row's draft alone (CPU matmuls are
not batch-invariant), over `--check-passes` passes at B = 16.

    python benchmarks/draft_batching.py [--threads 1] [--passes 8] [--reps 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from mtp.core.decoding.decode import block_slack, decode_step
from mtp.core.decoding.proposers import DraftRequest
from mtp.core.decoding.proposers.base import WrappedProposer
from mtp.core.decoding.proposers.heads import HeadsProposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.engine import Engine, EngineConfig
from mtp.core.runtime.cache import KVCache


def gsm8k_prompts(engine: Engine, n: int) -> list[list[int]]:
    path = Path(os.environ.get("MTP_DATA_DIR", "data")) / "gsm8k" / "test.jsonl"
    with open(path) as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(n), f)]
    return [engine.encode(q) for q in questions]


def run(engine: Engine, prompts: list[list[int]], strategy: str, proposer: str, passes: int, wrap=None):
    """Prefill the prompts as one batch, then `passes` decoding passes; (drafting s, row-passes, pass s)."""
    params = SamplingParams(max_new_tokens=4 * passes + 16)
    seqs = []
    for i, p in enumerate(prompts):
        s = engine.new_sequence(p, strategy, params, proposer)
        s.proposer, s.slot = engine.proposer(proposer, wrap) if wrap else s.proposer, i
        seqs.append(s)
    cache = KVCache.for_model(
        engine.model, len(seqs), max(map(len, prompts)) + params.max_new_tokens + block_slack(seqs[0].strategy.k)
    )
    row_passes, forward_s = 0, 0.0
    with torch.inference_mode():
        decode_step(engine.model, cache, seqs, engine.mask_id)  # the prefill pass: not timed
        for _ in range(passes):
            live = [s for s in seqs if not s.finished]
            if not live:
                break
            t0 = time.perf_counter()
            decode_step(engine.model, cache, live, engine.mask_id)
            forward_s += time.perf_counter() - t0
            row_passes += len(live)
    return sum(sum(s.stats.proposing_s[1:]) for s in seqs), row_passes, forward_s


class Compare(WrappedProposer):
    """The heads' answer (batched) beside the same row drafted alone: counts of differing drafts."""

    def __init__(self, inner: HeadsProposer, counts: dict):
        super().__init__(inner)
        self.counts = counts

    def propose(self, request: DraftRequest):
        got = self.inner.propose(request)
        alone = self.inner._draft([request])[0]
        self.counts["drafts"] += 1
        self.counts["tokens_differ"] += (got.tokens, got.parents) != (alone.tokens, alone.parents)
        self.counts["confidences_differ"] += got.confidences != alone.confidences
        return got


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check-passes", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    engine = Engine.load(EngineConfig(adapter="none", proposer="heads+suffix+lookup", threads=args.threads))
    heads = engine.proposer("heads")
    assert isinstance(heads, HeadsProposer)
    batched_prepare = heads.prepare
    prompts = gsm8k_prompts(engine, 16)
    results = []
    for strategy in ("tree:8", "verify:4"):
        for proposer in ("heads", "heads+suffix+lookup"):
            for B in (1, 4, 16):
                ms = {"per-row": [], "batched": []}
                for rep in range(args.reps):
                    for mode in ("per-row", "batched") if rep % 2 == 0 else ("batched", "per-row"):
                        heads.prepare = batched_prepare if mode == "batched" else (lambda request: [])
                        s, n, fwd = run(engine, prompts[:B], strategy, proposer, args.passes)
                        ms[mode].append(1e3 * s / max(n, 1))
                heads.prepare = batched_prepare
                row = {
                    "strategy": strategy,
                    "proposer": proposer,
                    "B": B,
                    **{f"{m}_ms": round(statistics.median(v), 3) for m, v in ms.items()},
                }
                row["ratio"] = round(row["batched_ms"] / row["per-row_ms"], 3) if row["per-row_ms"] else None
                results.append(row)
                print(
                    f"{strategy:9s} {proposer:20s} B={B:2d}  drafting ms/row/pass: per-row "
                    f"{row['per-row_ms']:6.2f}  batched {row['batched_ms']:6.2f}  (x{row['ratio']})",
                    flush=True,
                )
    checks = []
    for strategy in ("tree:8", "verify:4"):
        counts = {"drafts": 0, "tokens_differ": 0, "confidences_differ": 0}
        wrap = lambda name, p, counts=counts: Compare(p, counts) if name == "heads" else p  # run() calls it now
        run(engine, prompts, strategy, "heads+suffix+lookup", args.check_passes, wrap)
        checks.append({"strategy": strategy, "B": len(prompts), **counts})
        print(f"{strategy}: batched vs alone heads drafts at B={len(prompts)}: {counts}", flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "threads": args.threads,
                    "passes": args.passes,
                    "reps": args.reps,
                    "note": "contended machine",
                    "rows": results,
                    "exactness": checks,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
