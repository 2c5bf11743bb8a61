"""Where a decoding pass spends the time outside its forward pass: the loop's own record of every pass
(`DecodeStats.phase_s`: layout, accept, draft, commit; `metrics.PHASES`), per row over the same prompts,
the rows interleaved prompt by prompt. Prints one line per row, ms per pass (means over all passes; the
forward is the wall time per pass minus the phases):

    python benchmarks/loop_phases.py --rows ntp,tree:auto@heads+suffix+lookup --limit 8

Run it under two checkouts in alternating processes to compare loops (`PYTHONPATH=TREE`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp.core.decoding.metrics import PHASES  # noqa: E402
from mtp.core.decoding.sampling import SamplingParams  # noqa: E402
from mtp.core.engine import Engine, EngineConfig  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="native-int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="ntp,verify:3@lookup,tree:auto@heads+suffix+lookup")
    ap.add_argument("--prompts", default=str(Path(__file__).parent / "results/final/diverse60.jsonl"))
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig(model=args.model, weights=args.weights, threads=args.threads, adapter="none"))
    lines = Path(args.prompts).read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][: args.limit]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = args.rows.split(",")
    totals = {r: {"passes": 0, "tokens": 0, "wall": 0.0, "phases": [0.0] * len(PHASES)} for r in rows}
    for p in prompts:  # rows interleaved prompt by prompt, so drift falls on all alike
        for row in rows:
            strategy, _, proposer = row.partition("@")
            seq = engine.new_sequence(engine.encode(p), strategy, params, proposer or None)
            t = time.perf_counter()
            for _ in engine.stream(seq):
                pass
            tot = totals[row]
            tot["wall"] += time.perf_counter() - t
            tot["passes"] += seq.stats.forward_passes
            tot["tokens"] += len(seq.output)
            for parts in seq.stats.phase_s:
                tot["phases"] = [a + b for a, b in zip(tot["phases"], parts)]
    print(f"# {args.weights}, {args.threads} threads, {len(prompts)} prompts, {args.max_new_tokens} tokens; ms/pass")
    for row, tot in totals.items():
        n = tot["passes"]
        per = {k: 1e3 * v / n for k, v in zip(PHASES, tot["phases"])}
        outside = sum(per.values())
        print(
            f"{row:36s} tok/pass {tot['tokens'] / n:.2f} tok/s {tot['tokens'] / tot['wall']:6.1f} "
            f"pass {1e3 * tot['wall'] / n:.2f} forward {1e3 * tot['wall'] / n - outside:.2f} "
            + " ".join(f"{k} {v:.2f}" for k, v in per.items())
            + f" outside {outside:.2f}"
        )


if __name__ == "__main__":
    main()
