"""Two or more mask adapters on the same prompts, decoded in batches: tokens per pass, and how far the
outputs stay from `ntp`'s.

The rule for shipping a retrained adapter is "beat the shipped one on both test sets" (GSM8K test
0-99, the 60 diverse held-out prompts; greedy, 256 tokens). The mask proposer reads the logits of
the mask rows of the pass itself, so it cannot be replayed on reference answers the way
`heads_compare.py` replays heads: every adapter decodes every prompt. Decoding them in batches
(`mtp.tune.offline.decode_all`, `--batch` sequences at once) makes that minutes instead of a
one-at-a-time `mtp bench` run per adapter; tokens per pass and equality do not depend on the batch
(the passes' drafts and acceptances are the same up to float near-ties), wall time does, so this
script reports no speed. The `ntp` reference is decoded once (batched, no adapter) or read from
`--reference` (the file `heads_compare.py` writes). Per adapter and strategy: tokens per pass
(`mtp.core.decoding.metrics.tokens_per_forward` over all passes of all prompts), acceptance by position,
outputs identical to `ntp`, and the quality loss `mtp tune` uses (`mtp.core.policy.quality`: answer for
GSM8K, ROUGE-L otherwise).

    python benchmarks/mask_compare.py --data gsm8k:$MTP_DATA_DIR/gsm8k/test.jsonl --limit 100 \\
        --adapters auto,runs/mask-cont12 --strategies verify:4,conf_adapt:0.9:8 \\
        --reference runs/refs/gsm8k100-256.jsonl --out runs/mask_compare/gsm8k100
"""

from __future__ import annotations

import time
from pathlib import Path

from heads_compare import portable, protocol_parser, reference, write_rows

from mtp.core.decoding import metrics
from mtp.core.decoding.strategy import Strategy
from mtp.core.engine import Engine, EngineConfig
from mtp.core.policy import quality
from mtp.eval.bench import load_data
from mtp.tune.offline import decode_all


def main(argv=None) -> None:
    ap = protocol_parser(__doc__, "comma list (verify:K, conf_adapt:TAU:KMAX, ...)", "sequences decoded together")
    ap.add_argument("--adapters", default="auto", help="comma list of adapter directories; 'auto' = the shipped one")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind, items = load_data(args.data, args.limit)
    metric = "answer" if kind == "gsm8k" else "rougeL"
    adapters = [a.strip() for a in args.adapters.split(",") if a.strip()]
    strategies = [Strategy.parse(s) for s in args.strategies.split(",")]
    t0 = time.perf_counter()
    base = Engine.load(EngineConfig(adapter="none", threads=args.threads))
    prompts = [base.encode(it["prompt"], chat=True) for it in items]
    ref = reference(base, prompts, args)
    del base
    print(
        f"reference: {len(ref)} ntp answers, {sum(len(o.ids) for o in ref):,} tokens [{time.perf_counter() - t0:.0f}s]",
        flush=True,
    )
    refs = [(o.ids, o.text) for o in ref]
    rows = []
    for a in adapters:
        engine = Engine.load(EngineConfig(adapter=a, proposer="mask", threads=args.threads))
        if [engine.encode(it["prompt"], chat=True) for it in items] != prompts:
            raise SystemExit(f"{a}: the adapter's engine encodes the prompts differently from the base model's")
        for s in strategies:
            t1 = time.perf_counter()
            stats = decode_all(engine, prompts, s, "mask", args.max_new_tokens, args.batch)
            chunks = [c for o in stats.outputs for c in o.chunks]
            outs = [(o.ids, o.text) for o in stats.outputs]
            row = {
                "adapter": a,
                "adapter_dir": portable(engine.adapter_dir or a),
                "strategy": str(s),
                "data": portable(args.data),
                "n_prompts": len(prompts),
                "tokens_per_forward": metrics.tokens_per_forward(chunks),
                "acceptance_by_position": metrics.acceptance_by_position(chunks, s.k),
                "identical": sum(o[0] == r[0] for o, r in zip(outs, refs)),
                "metric": metric,
                "same": 1.0 - quality.mean_loss(metric, outs, refs),
                "seconds": round(time.perf_counter() - t1, 1),
            }
            rows.append(row)
            print(
                f"{a:32s} {str(s):16s} {row['tokens_per_forward']:.3f} tokens/pass, identical "
                f"{row['identical']}/{len(prompts)}, {metric} {row['same']:.3f} "
                f"[{time.perf_counter() - t0:.0f}s]",
                flush=True,
            )
    write_rows(out, rows, threads=args.threads, batch=args.batch, seconds=round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()
