"""How the mask adapter scales with training data: held-out tokens per pass against answers seen.

One `mtp train` run from scratch (gated LoRA, `distill.train`) over the training share of an
`mtp data` file, one pass through the data (no answer seen twice below `--steps` x `--batch-size`
<= the training answers); at each step in `--eval-at` the adapter is scored on the held-out
answers (the same stable hash as `heads_scaling.py`, so both curves are read on the same text) with
`mask_eval.tokens_per_pass`: 1 + the leading run of correct mask proposals = what `verify:K`
accepts on the model's own greedy text, per source and overall. The shipped adapter is scored
the same way first, as a reference. Writes one JSON line per point to OUT/results.jsonl (the heads'
curve: `heads_scaling.py`).

    python benchmarks/mask_scaling.py --examples $MTP_CACHE_DIR/data/mix/train.jsonl \\
        --steps 270 --eval-at 30,90,270 --out runs/mask_scaling
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from heads_scaling import emit, held_out

from mtp.cli.train import parse_layers
from mtp.core.engine import Engine, EngineConfig
from mtp.core.runtime.adapter import check_layers
from mtp.core.runtime.loading import DEFAULT_MODEL, model_layers
from mtp.training.data import load_examples
from mtp.training.distill import TrainConfig, prepare_examples, train
from mtp.training.mask_eval import tokens_per_pass


def score(model, val, val_source, k, stride, seq_len) -> dict:
    model.eval()
    t0 = time.perf_counter()
    per = tokens_per_pass(model, val, k=k, stride=stride, seq_len=seq_len)
    rec = {}
    for name in ["all"] + sorted(set(val_source)):
        xs = [v for v, s in zip(per, val_source) if v is not None and name in ("all", s)]
        if xs:
            rec[name] = round(sum(xs) / len(xs), 4)
    rec["eval_s"] = round(time.perf_counter() - t0, 1)
    return rec


def parse_args() -> tuple[argparse.Namespace, tuple[int, int] | None]:
    """The flags, and the LoRA layers `--lora-layers` names (checked against the model's; None: all)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", required=True)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument(
        "--val-answers", type=int, default=120, help="held-out answers scored (half GSM8K, half the other sources)"
    )
    ap.add_argument("--steps", type=int, default=270)
    ap.add_argument("--eval-at", default="30,90,270")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--spans", type=int, default=48)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--teacher", default="ground-truth")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--k", type=int, default=4, help="verify:K scored (K-1 masks)")
    ap.add_argument("--stride", type=int, default=6, help="a span after every N-th response position")
    ap.add_argument(
        "--lora-layers",
        metavar="FROM:TO",
        default=None,
        help="LoRA on layers FROM..TO-1 only (FROM: = to the last layer), the mask embedding frozen "
        "(as `mtp train --lora-layers`)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n_layers = model_layers(DEFAULT_MODEL)
    try:
        layers = check_layers(parse_layers(args.lora_layers, n_layers), n_layers) if args.lora_layers else None
    except ValueError as e:
        ap.error(str(e))
    return args, layers


def held_out_split(args, records: list[dict], examples: list) -> tuple[list, list, list[str]]:
    """(the training answers, the held-out answers scored: up to half of `--val-answers` from sources
    other than GSM8K, the rest GSM8K, and their sources), by the held-out hash of `heads_scaling.py`."""
    is_val = [held_out(r.get("id", str(i)), args.val_fraction) for i, r in enumerate(records)]
    train_ex = prepare_examples([e for e, v in zip(examples, is_val) if not v], args.seq_len)
    val_idx = [i for i, v in enumerate(is_val) if v]
    other = [i for i in val_idx if records[i].get("source") != "gsm8k"][: args.val_answers // 2]
    val_idx = other + [i for i in val_idx if records[i].get("source") == "gsm8k"][: args.val_answers - len(other)]
    return train_ex, [examples[i] for i in val_idx], [records[i].get("source", "?") for i in val_idx]


def main() -> int:
    args, layers = parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = [json.loads(x) for x in Path(args.examples).read_text().splitlines() if x.strip()]
    examples = load_examples(args.examples)
    train_ex, val, val_source = held_out_split(args, records, examples)
    print(
        f"{len(train_ex)} training answers, {len(val)} held-out scored "
        f"({', '.join(f'{s} {val_source.count(s)}' for s in sorted(set(val_source)))})",
        flush=True,
    )
    results = out / "results.jsonl"
    shipped = Engine.load(EngineConfig(adapter="auto", pack=False)).model
    emit(results, {"point": "shipped adapter", **score(shipped, val, val_source, args.k, args.stride, args.seq_len)})
    del shipped

    engine = Engine.load(EngineConfig(adapter="none", pack=False))
    model = engine.model
    eval_at = {int(s) for s in args.eval_at.split(",")}
    cfg = TrainConfig(
        out=str(out / "adapter"),
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        k_max=args.k_max,
        spans=args.spans,
        seq_len=args.seq_len,
        teacher=args.teacher,
        save_every=args.steps,
        log_every=10,
        lora_layers=layers,
        meta={"examples": args.examples, "heldout": f"hash val-fraction {args.val_fraction}"},
    )
    t_start, eval_total = time.perf_counter(), [0.0]

    def on_step(step: int) -> None:
        if step not in eval_at:
            return
        t0 = time.perf_counter()
        rec = score(model, val, val_source, args.k, args.stride, args.seq_len)
        model.train()
        eval_total[0] += time.perf_counter() - t0
        emit(
            results,
            {
                "point": "from scratch",
                **({"lora_layers": f"{layers[0]}:{layers[1]}"} if layers else {}),
                "steps": step,
                "answers_seen": step * args.batch_size,
                "train_s": round(time.perf_counter() - t_start - eval_total[0], 1),
                **rec,
            },
        )

    train(cfg, model, train_ex, n_used_tokens=len(engine.tokenizer), progress=False, on_step=on_step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
