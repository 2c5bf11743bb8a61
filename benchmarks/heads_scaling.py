"""How the MTP heads scale with training data: held-out tokens per pass against answers trained on.

The trunk's hidden states over every answer are extracted once (`cached_features`); a fixed share
of the answers (chosen by a stable hash of their ids, `--val-fraction`) is held out, and for each
size in `--sizes` heads are trained on the first N of the remaining answers (the file's order: a
growing `mtp data` run) with the same settings, then scored on the same held-out answers:
`val_tokens_per_pass` is 1 + the leading run of correct depths = what `verify:D+1` accepts on the
model's own greedy text, per source (GSM8K / self-instruct / self-written) and overall; the
`--reference` heads (default: the shipped ones) are scored the same way first. Writes one JSON
line per size to OUT/results.jsonl (`mask_scaling.py` writes the mask adapter's curve the same way).

    python benchmarks/heads_scaling.py --examples $MTP_CACHE_DIR/data/mix/train.jsonl \\
        --sizes 100,300,1000 --steps 600 --out runs/heads_scaling
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import torch

from mtp.core.decoding.proposers.heads import bf16_readout, load_heads
from mtp.core.engine import SHIPPED, Engine, EngineConfig
from mtp.core.runtime.loading import cache_root
from mtp.training import shards
from mtp.training.data import load_examples
from mtp.training.heads_train import TrainHeadsConfig, cached_features, evaluate, train_heads
from mtp.training.trainer import AMP_CHOICES, use_bf16


def held_out(key: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(f"val:{key}".encode()).digest()[:8], "big") / 2**64 < fraction


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", required=True)
    ap.add_argument("--sizes", default="100,300,1000")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--depths", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=0)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--amp",
        choices=AMP_CHOICES,
        default="auto",
        help="extract the trunk's states under bf16 autocast (auto: on a CPU with native bf16)",
    )
    ap.add_argument(
        "--reference",
        default="shipped",
        help="heads directory scored on the same held-out answers first ('shipped', 'none')",
    )
    ap.add_argument(
        "--repeat",
        default="",
        help="SOURCE:N, e.g. gsm8k:2: every training row of answers from SOURCE seen N times as often "
        "(rows are independent: each carries its own targets); held-out rows are never repeated",
    )
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def emit(path: Path, rec: dict) -> None:
    """One result: printed, and appended to `path` as a JSON line (`mask_scaling.py` writes its points the same way)."""
    print(json.dumps(rec), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_records(src: Path) -> list[dict]:
    """The answers of an `mtp data` folder (its shards, then its working file) or of a JSONL file."""
    if src.is_dir():
        return list(shards.read(src, "train", repair=False)[0].values())
    return [json.loads(x) for x in src.read_text().splitlines() if x.strip()]


def by_source(heads, model, part: dict, rows: torch.Tensor, readout, val_source: list[str]) -> dict:
    """Held-out tokens per pass over `rows` of `part`, overall and per source (rows follow val_source)."""
    rec = {"all": evaluate(heads, model, part, rows, readout)["val_tokens_per_pass"]}
    for s in sorted(set(val_source)):
        mine = rows[torch.tensor([x == s for x in val_source])]
        if len(mine):
            rec[s] = evaluate(heads, model, part, mine, readout)["val_tokens_per_pass"]
    return rec


def repeated(rows: torch.Tensor, spec: str, row_source: list[str]) -> torch.Tensor:
    """`--repeat SOURCE:N`: `rows`, then those whose answer is from SOURCE (`row_source`, per row) N - 1 times more."""
    source, times = spec.rsplit(":", 1)
    mine = torch.tensor([s == source for s in row_source])
    again = mine.nonzero().squeeze(1).repeat(int(times) - 1)
    n_rows = len(rows)
    rows = rows[torch.cat([torch.arange(n_rows), again])]
    print(
        f"--repeat {spec}: {int(mine.sum()):,} of {n_rows:,} training rows from {source}, "
        f"{len(rows):,} rows after repeating",
        flush=True,
    )
    return rows


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = read_records(Path(args.examples))
    ids = [r.get("id", str(i)) for i, r in enumerate(records)]
    sources = [r.get("source", "?") for r in records]
    examples = load_examples(args.examples)
    val = [i for i, k in enumerate(ids) if held_out(k, args.val_fraction)]
    train = [i for i in range(len(examples)) if i not in set(val)]
    sizes = [n for n in (int(s) for s in args.sizes.split(",") if s) if n <= len(train)]
    if not sizes:
        raise SystemExit(f"no size in --sizes {args.sizes!r} fits the {len(train)} training answers")
    engine = Engine.load(EngineConfig(adapter="none", pack=False))
    model = engine.model
    order = train[: max(sizes)] + val  # one feature file: the largest training set, then the held-out answers
    t0 = time.perf_counter()
    feats, path = cached_features(
        model, [examples[i] for i in order], cache_root(), amp=use_bf16(args.amp, model.device)
    )
    print(
        f"features of {len(order)} answers ({len(feats['hidden']):,} rows) in {time.perf_counter() - t0:.0f} s: {path}",
        flush=True,
    )
    n_train_max = max(sizes)
    example = feats["example"]
    val_rows = (example >= n_train_max).nonzero().squeeze(1)
    val_source = [sources[order[int(e)]] for e in example[val_rows]]
    readout = bf16_readout(model)
    results = out / "results.jsonl"
    if args.reference != "none":
        ref_dir = SHIPPED["smollm2-135m"] / "heads" if args.reference == "shipped" else Path(args.reference)
        heads = load_heads(model, ref_dir)
        emit(results, {"reference": args.reference, **by_source(heads, model, feats, val_rows, readout, val_source)})
    for n in sizes:
        # row indices, never copies: the whole-set features are ~2.3 KB per row
        rows = (example < n).nonzero().squeeze(1)
        if args.repeat:
            rows = repeated(rows, args.repeat, [sources[order[int(e)]] for e in example[rows]])
        cfg = TrainHeadsConfig(
            depths=args.depths,
            blocks=args.blocks,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            save_every=args.steps,
            val_fraction=0.0,
            draft_vocab=args.draft_vocab,
        )
        t0 = time.perf_counter()
        run = out / f"heads-{n}"
        if run.exists():
            shutil.rmtree(run)
        train_heads(model, feats, cfg, run, log=lambda m: None, rows=rows)
        rec = {
            "answers": n,
            "train_rows": int((example < n).sum()),
            "steps": args.steps,
            "train_s": round(time.perf_counter() - t0, 1),
        }
        emit(results, {**rec, **by_source(load_heads(model, run), model, feats, val_rows, readout, val_source)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
