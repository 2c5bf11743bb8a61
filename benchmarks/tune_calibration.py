"""Calibration errors of `mtp tune`'s fit on one prompt set, without the rest of the tune: the reference
`ntp` answers (batched), then each replayable proposer's `verify:4` chains and `tree:16` nodes replayed on
them, a map per depth fitted on the even-numbered prompts and the expected calibration error measured on
the odd ones (the tune's own `fit_held_out`). Prints one line per proposer and writes JSON.

    python benchmarks/tune_calibration.py --data gsm8k:$MTP_DATA_DIR/gsm8k/test.jsonl --limit 100 --out cal.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from mtp.core.engine import Engine, EngineConfig
from mtp.core.strategy import Strategy
from mtp.eval.bench import environment, load_data
from mtp.tune.offline import chain_pairs, decode_all, tree_pairs
from mtp.tune.run import fit_held_out
from mtp.tune.simulate import replay


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--proposers", default="heads,suffix,lookup")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig())
    kind, items = load_data(args.data, args.limit)
    prompts = [engine.encode(it["prompt"], chat=True) for it in items]
    t0 = time.perf_counter()
    ref = decode_all(engine, prompts, Strategy(), None, args.max_new_tokens, 32).outputs
    hidden: dict = {}
    out = {"data": args.data, "prompts": len(items), "env": environment(engine), "rows": {}}
    for name in args.proposers.split(","):
        for label, strategy, pairs_of in (("chain", "verify:4", chain_pairs), ("tree", "tree:16", tree_pairs)):
            if label == "chain" and not engine.proposer(name).has_confidence:
                continue
            stats = replay(engine, prompts, ref, Strategy.parse(strategy), name, record=True, hidden_cache=hidden)
            _, rep = fit_held_out([pairs_of(o) for o in stats.outputs])
            key = f"{name}/{label}"
            out["rows"][key] = {k: rep[k] for k in ("fit_pairs", "test_pairs", "ece_before", "ece_after", "used", "maps")}
            print(f"{key}: ECE {rep['ece_before']:.3f} -> {rep['ece_after']:.3f} on {rep['test_pairs']} held-out "
                  f"({'used' if rep['used'] else 'not used'}) [{time.perf_counter() - t0:.0f}s]", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
