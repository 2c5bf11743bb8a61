"""Two or more sets of MTP heads (or EAGLE-3 drafters) on the same prompts, by replay: which one
accepts more per pass.

The rule for shipping retrained heads is "beat the shipped ones on both test sets" (GSM8K test 0-99,
the 60 diverse held-out prompts; greedy, 256 tokens). Decoding every set of heads on every prompt
costs a full `mtp bench` run per set; under greedy decoding a lossless strategy emits exactly the
`ntp` answer, so the reference answers are decoded once (batched) and every set of heads is replayed
on them (`mtp.tune.simulate.replay`: one teacher-forced pass per prompt, then the heads alone, pass by
pass, the same drafts and acceptances a decode makes up to float near-ties). Tokens per pass comes
from `mtp.core.decoding.metrics.tokens_per_forward` over all passes of all prompts, as `mtp bench` reports it.
`--eagle3 auto,DIR` replays EAGLE-3 drafters the same way (the teacher-forced pass also returns the
trunk streams they read), beside or instead of heads. `--merge suffix+lookup` replays each set as part
of that merge (`eagle3+suffix+lookup`), as `--proposer` names it.

    python benchmarks/heads_compare.py --data gsm8k:$MTP_DATA_DIR/gsm8k/test.jsonl --limit 100 \\
        --heads auto,runs/heads6-1600/heads-5000 --strategies verify:4,tree:16 --out runs/heads_compare/gsm8k100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from mtp.core.decoding import metrics
from mtp.core.decoding.strategy import Strategy
from mtp.core.engine import Engine, EngineConfig
from mtp.eval.bench import load_data
from mtp.tune.offline import Output, decode_all
from mtp.tune.simulate import replay


def portable(path) -> str:
    """A path as the results record it: `$MTP_DATA_DIR/...` for the data folder, else relative to the
    working folder where it lies under it (no machine's absolute paths in committed results)."""
    text = str(path)
    data_dir = os.environ.get("MTP_DATA_DIR")
    if data_dir and data_dir.rstrip("/") and data_dir.rstrip("/") in text:
        return text.replace(data_dir.rstrip("/"), "$MTP_DATA_DIR")
    try:
        return str(Path(text).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return text


def reference(engine, prompts: list[list[int]], args) -> list[Output]:
    """The greedy ntp answers the replays run on: from --reference when it holds these prompts at this
    length, else decoded (batched) and written there."""
    path = Path(args.reference) if args.reference else None
    if path is not None and path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if [r["prompt_ids"] for r in rows] != prompts or any(r["max_new_tokens"] != args.max_new_tokens for r in rows):
            raise SystemExit(
                f"{path}: not the ntp answers of these prompts at --max-new-tokens "
                f"{args.max_new_tokens}; remove it or pass another --reference"
            )
        return [Output(r["ids"], r["text"], [], [], r["finish"]) for r in rows]
    ref = decode_all(engine, prompts, Strategy(), None, args.max_new_tokens, args.batch).outputs
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            "".join(
                json.dumps(
                    {
                        "prompt_ids": p,
                        "max_new_tokens": args.max_new_tokens,
                        "ids": o.ids,
                        "text": o.text,
                        "finish": o.finish,
                    }
                )
                + "\n"
                for p, o in zip(prompts, ref)
            )
        )
        tmp.replace(path)
    return ref


def protocol_parser(doc: str, strategies_help: str, batch_help: str) -> argparse.ArgumentParser:
    """The options every proposer comparison on the test sets takes (this script, `mask_compare.py`)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--data", required=True, help="gsm8k:PATH or prompts:PATH (as mtp bench)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--strategies", default="verify:4", help=strategies_help)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help=batch_help)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--reference",
        default=None,
        help="JSONL of the ntp answers: read when it exists (its prompts and length must match), "
        "else decoded and written there",
    )
    ap.add_argument("--out", required=True)
    return ap


def write_rows(out: Path, rows: list[dict], **env) -> None:
    """OUT/results.jsonl: one line per row, each with the machine and run facts under "env"."""
    env = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__, **env}
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "env": env}) + "\n")
    print(f"wrote {out / 'results.jsonl'}")


def main(argv=None) -> None:
    ap = protocol_parser(
        __doc__, "comma list of lossless strategies (verify:K, tree:N)", "rows of the batched reference decode"
    )
    ap.add_argument("--heads", default="", help="comma list of heads directories; 'auto' = the shipped heads")
    ap.add_argument("--eagle3", default="", help="comma list of EAGLE-3 drafter directories; 'auto' = the shipped one")
    ap.add_argument("--merge", default="", help="parts to merge each set with, e.g. suffix+lookup")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind, items = load_data(args.data, args.limit)
    heads = [("heads", h.strip()) for h in args.heads.split(",") if h.strip()]
    heads += [("eagle3", h.strip()) for h in args.eagle3.split(",") if h.strip()]
    if not heads:
        ap.error("give --heads and/or --eagle3")
    strategies = [Strategy.parse(s) for s in args.strategies.split(",")]
    t0 = time.perf_counter()
    hidden: dict = {}  # teacher-forced hidden states per prompt: the trunk's, shared by every set of heads
    ref, rows = None, []
    for part, h in heads:
        proposer = f"{part}+{args.merge}" if args.merge else part
        engine = Engine.load(EngineConfig(adapter="none", proposer=proposer, threads=args.threads, **{part: h}))
        prompts = [engine.encode(it["prompt"], chat=True) for it in items]
        if ref is None:
            ref = reference(engine, prompts, args)
            print(
                f"reference: {len(ref)} ntp answers, {sum(len(o.ids) for o in ref):,} tokens "
                f"[{time.perf_counter() - t0:.0f}s]",
                flush=True,
            )
        for s in strategies:
            stats = replay(engine, prompts, ref, s, proposer, hidden_cache=hidden, memo={})
            chunks = [c for o in stats.outputs for c in o.chunks]
            where = engine.asset_dirs.get(part)
            row = {
                "proposer": proposer,
                part: h,
                f"{part}_dir": portable(where),
                "strategy": str(s),
                "data": portable(args.data),
                "n_prompts": len(prompts),
                "tokens_per_forward": metrics.tokens_per_forward(chunks),
                "acceptance_by_position": metrics.acceptance_by_position(chunks, s.k),
            }
            rows.append(row)
            print(
                f"{h:40s} {str(s):10s} {row['tokens_per_forward']:.3f} tokens/pass [{time.perf_counter() - t0:.0f}s]",
                flush=True,
            )
    write_rows(out, rows, threads=args.threads, seconds=round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()
