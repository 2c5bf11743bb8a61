"""Does a row's output depend on how many rows share its forward pass? The identity check behind
"lossless means identical": `verify` and `tree` compute a position's logits in a k-row pass where `ntp`
computes it in a 1-row pass, and a greedy output stays identical only if the two agree.

    python benchmarks/identity.py --data prompts:benchmarks/results/final/diverse60.jsonl --rows 2,4,16,32 \
        --limit 12 --tokens 96 [--weights native|float32|torch] [--out FILE]

For each prompt (chat-formatted) the prompt is prefilled into a KV cache and its greedy continuation is
decoded one token per pass: the logits of every continuation position from 1-row passes are the
reference. For each k the prompt is prefilled again and the same continuation is fed k tokens a pass
(the cache kept as in decoding: each block writes its keys and values for the next), and every
position's logits are compared with the reference. Printed per k: positions, max |dlogit|, and argmax
flips (positions whose top token differs); with them the smallest top-2 logit gap of the reference
(how close a flip is). `--weights` is the engine's (mtp.core.runtime.weights): `native` and `float32` run on
mtp's batch-invariant kernels, where every k must print 0 and no flip; `torch` is the oneDNN path.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp.core.engine import Engine, EngineConfig
from mtp.core.runtime.cache import KVCache
from mtp.eval.bench import load_data


def continuation(model, prompt: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation of `prompt` in 1-row passes: its tokens [T] and the logits [T, vocab] of the
    passes that fed them (the logits at position j predict token j + 1)."""
    cache = KVCache.for_model(model, 1, len(prompt) + tokens + 1)
    logits = model(torch.tensor([prompt]), cache=cache)[0, -1]
    ids, rows = [], []
    for j in range(tokens):
        ids.append(int(logits.argmax()))
        logits = model(torch.tensor([[ids[-1]]]), positions=torch.tensor([[len(prompt) + j]]), cache=cache)[0, -1]
        rows.append(logits.float())
    return ids, torch.stack(rows)


def blocks(model, prompt: list[int], ids: list[int], k: int) -> torch.Tensor:
    """The logits [T, vocab] of the same positions fed k tokens a pass after a fresh prefill."""
    cache = KVCache.for_model(model, 1, len(prompt) + len(ids) + 1)
    model(torch.tensor([prompt]), cache=cache)
    out = []
    for b in range(0, len(ids), k):
        block = ids[b : b + k]
        pos = torch.arange(len(prompt) + b, len(prompt) + b + len(block)).unsqueeze(0)
        out.append(model(torch.tensor([block]), positions=pos, cache=cache)[0].float())
    return torch.cat(out)


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="prompts:FILE or gsm8k:FILE")
    p.add_argument("--rows", default="2,4,16,32", help="block sizes k to compare with 1-row passes")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--tokens", type=int, default=96, help="continuation tokens per prompt")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", choices=["native", "native-int8", "float32", "torch"], default="native")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    rows = [int(x) for x in args.rows.split(",")]
    engine = Engine.load(
        EngineConfig(model=args.model, adapter="none", proposer="lookup", threads=args.threads, weights=args.weights)
    )
    model = engine.model
    _, items = load_data(args.data, args.limit)
    prompts = [engine.encode(it["prompt"]) for it in items]
    stats = {k: {"positions": 0, "max_abs_dlogit": 0.0, "argmax_flips": 0} for k in rows}
    gap = float("inf")
    with torch.inference_mode():
        for n, prompt in enumerate(prompts, 1):
            ids, ref = continuation(model, prompt, args.tokens)
            gap = min(gap, top2_gap(ref))
            for k in rows:
                got = blocks(model, prompt, ids, k)
                s = stats[k]
                s["positions"] += len(ids)
                s["max_abs_dlogit"] = max(s["max_abs_dlogit"], float((got - ref).abs().max()))
                s["argmax_flips"] += int((got.argmax(-1) != ref.argmax(-1)).sum())
            print(f"prompt {n}/{len(prompts)}", file=sys.stderr)
    print(f"weights: {engine.weights_line}; smallest top-2 gap of the 1-row logits: {gap:.3g}")
    print(f"{'k':>4} {'positions':>10} {'max |dlogit|':>13} {'argmax flips':>13}")
    for k, s in stats.items():
        print(f"{k:>4} {s['positions']:>10} {s['max_abs_dlogit']:>13.3g} {s['argmax_flips']:>13}")
    if args.out:
        env = {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "weights": engine.weights_line,
        }
        Path(args.out).write_text(json.dumps({"args": vars(args), "min_top2_gap": gap, "by_k": stats, **env}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
