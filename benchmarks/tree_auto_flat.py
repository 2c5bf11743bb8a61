"""`tree:auto`'s tokens per pass where a pass costs the same for any q (a GPU at batch 1, a pipeline stage
waiting on its link): the engine's measured cost model replaced by a flat one, so a tree keeps every node its
confidences support. Tokens per pass do not depend on the machine's speed; every output is checked against
`ntp`'s.

    python benchmarks/tree_auto_flat.py --data prompts:benchmarks/results/final/diverse60.jsonl --out FILE.json
    python benchmarks/tree_auto_flat.py --data gsm8k:$MTP_DATA_DIR/gsm8k/test.jsonl --limit 100 --out FILE.json

Prints and writes, per row: output tokens, forward passes, tokens per pass (output tokens over passes) and how
many outputs equal `ntp`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp.core.decoding.sampling import SamplingParams
from mtp.core.engine import Engine, EngineConfig
from mtp.core.policy.costmodel import CostModel
from mtp.eval.bench import load_data

FLAT = CostModel({1: 0.010, 64: 0.0101})  # 64 tokens cost 1 % more than 1


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="gsm8k:PATH or prompts:PATH (as mtp bench)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--weights", default="native-int8")
    p.add_argument("--rows", default="tree:auto@heads+suffix+lookup,tree:auto@eagle3+suffix+lookup")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    _, items = load_data(args.data, args.limit)
    eng = Engine.load(EngineConfig(adapter="none", proposer="lookup", weights=args.weights))
    eng.cost_model = FLAT
    ref: dict[int, list[int]] = {}
    rows = {}
    for name in ["ntp"] + args.rows.split(","):
        strategy, _, proposer = name.partition("@")
        tokens = passes = same = 0
        for j, it in enumerate(items):
            ids = eng.encode(it["prompt"], chat=True)
            seq = eng.new_sequence(ids, strategy, SamplingParams(max_new_tokens=args.max_new_tokens), proposer or None)
            for _ in eng.stream(seq):
                pass
            out = eng.result(seq).token_ids
            ref.setdefault(j, out)
            same += out == ref[j]
            tokens += len(out)
            passes += seq.stats.forward_passes
        rows[name] = {"tokens": tokens, "passes": passes, "tokens_per_pass": tokens / passes, "identical": same}
        print(f"{name}: {tokens / passes:.3f} tokens/pass, {same}/{len(items)} identical to ntp", flush=True)
    cfg = {k: v for k, v in vars(args).items() if k != "out"}
    Path(args.out).write_text(json.dumps({"args": cfg, "cost_model": FLAT.to_json(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
