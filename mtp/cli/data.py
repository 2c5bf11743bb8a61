"""`mtp data`: self-generate training answers for many prompts (`mtp.training.data_engine`)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from mtp.core.engine import Engine, EngineConfig
from mtp.core.runtime.checks import MAX_BATCH, check_device, check_threads
from mtp.training.data_engine import DataConfig, check_folder, file_prompts, seal, write_card
from mtp.training.data_engine import run as run_engine


def add_parser(sub) -> None:
    p = sub.add_parser(
        "data",
        help="self-generate answers for GSM8K, self-instruct and self-written prompts",
        description="The model's own greedy answers, batched with continuous refill, resumable; "
        "writes OUT/train.jsonl (for `mtp train --examples` / `mtp train-heads "
        "--examples`), OUT/heldout/*.jsonl (never trained on) and a data card.",
    )
    p.add_argument("--out", required=True, help="output directory (resumed when it holds a run with the same settings)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--gsm8k", help="GSM8K training prompts (e.g. $MTP_DATA_DIR/gsm8k/train.jsonl)")
    p.add_argument("--self-instruct", help="self-instruct tasks: a folder ($MTP_DATA_DIR/self_instruct) or a file")
    p.add_argument("--prompts", help="a JSONL file of prompts (field 'prompt')")
    p.add_argument("--self-written", type=int, default=0, help="prompts the model writes itself (requests)")
    p.add_argument("--heldout-fraction", type=float, default=0.2, help="share of each non-GSM8K source held out")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length limit")
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="longer prompts are skipped (and counted)")
    p.add_argument("--batch-size", type=int, default=32, help=f"sequences generated at once (1..{MAX_BATCH})")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per file source (smoke runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--card", action="store_true", help="only (re)write and print the data card of OUT (no source needed)"
    )
    p.add_argument(
        "--seal",
        action="store_true",
        help="only seal OUT's working files into new shards (a run does this itself when it stops) and rewrite "
        "its card; prints one JSON line (what was sealed, answers, shards)",
    )
    p.set_defaults(func=run)


def run_seal(out: Path) -> int:
    """`--seal`: seal OUT's working files, rewrite its card (card.md, card.json), print one JSON line
    (the new shards, the answers and shards now); nothing to seal is said in one line on stderr."""
    added = seal(out)
    card = write_card(out)
    if not added:
        print(f"data: nothing to seal in {out} (no working files with answers)", file=sys.stderr)
    summary = {
        "sealed": [e["file"] for e in added],
        "answers": card["answers"],
        "response_tokens": card["response_tokens"],
        "shards": len(card["shards"]),
        "card": str(out / "card.md"),
    }
    print(json.dumps(summary))
    return 0


def run(args) -> int:
    if args.seal:  # the folder's own manifest is the truth: no source flags, nothing generated
        return run_seal(Path(args.out))
    if args.card:
        print(json.dumps(write_card(Path(args.out)), indent=1))
        return 0
    cfg = DataConfig(
        out=args.out,
        gsm8k=args.gsm8k,
        self_instruct=args.self_instruct,
        prompts=args.prompts,
        self_written=args.self_written,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        heldout_fraction=args.heldout_fraction,
        batch_size=args.batch_size,
        seed=args.seed,
        limit=args.limit,
    )
    check_threads(args.threads)
    check_device(args.device)
    check_folder(Path(args.out))  # a file, or a folder mtp did not write, refused before the model loads
    file_prompts(cfg)  # every source file read (and a test split refused) before the model loads
    engine = Engine.load(EngineConfig(model=args.model, adapter="none", threads=args.threads, device=args.device))

    def on_term(signum, frame):  # `kill` stops a long run as Ctrl-C does: lines flushed, card written
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        card = run_engine(engine, cfg)
    except KeyboardInterrupt:
        print(f"mtp data: interrupted; rerun the same command to resume ({args.out})", file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(
        f"{card['answers']:,} answers, {card['response_tokens']:,} response tokens, "
        f"{card['cut_by_length_limit']:,} cut by the length limit -> {args.out} ({len(card['shards'])} shards) "
        f"(card: {args.out}/card.md)",
        file=sys.stderr,
    )
    return 0
