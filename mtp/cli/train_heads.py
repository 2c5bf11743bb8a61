"""`mtp train-heads`: train DeepSeek-style MTP heads on the frozen model's cached hidden states."""

from __future__ import annotations

import time
from pathlib import Path

from mtp.cli.train import add_machine_flags, check_example_flags, counter, example_meta, prepare_examples, say
from mtp.core.decoding.proposers.heads import HeadsConfig
from mtp.core.runtime import loading
from mtp.core.runtime.checks import check_device
from mtp.training.heads_train import TrainHeadsConfig, cached_features, is_heads_dir, train_heads
from mtp.training.trainer import check_run_out, use_bf16


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train-heads",
        help="train DeepSeek-style MTP heads on the frozen model's hidden states",
        description="Self-distil MTP heads: the targets are the base model's own greedy answers; "
        "its hidden states are computed once and cached, then the heads train on them.",
    )
    p.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file, or smollm2-135m (default)")
    p.add_argument("--data", help="JSONL file of prompts (e.g. $MTP_DATA_DIR/gsm8k/train.jsonl)")
    p.add_argument("--examples", help="JSONL of token ids {prompt_ids, response_ids} (e.g. `mtp data`'s train.jsonl)")
    p.add_argument("--prompt-field", default="question")
    p.add_argument("--response-field", default="answer", help="used when not --self-generate")
    p.add_argument(
        "--self-generate",
        action="store_true",
        help="targets = the model's own greedy answers (cached on disk); default: the data's responses",
    )
    p.add_argument("--limit", type=int, default=200, help="number of prompts (or examples) to use")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length of self-generated answers")
    p.add_argument("--gen-batch-size", type=int, default=16, help="prompts per batch when self-generating")
    p.add_argument("--depths", type=int, default=2, help="D: tokens guessed per pass (1..8)")
    p.add_argument("--blocks", type=int, default=0, help="L: transformer blocks per depth (0 = projection only)")
    p.add_argument("--width", type=int, default=0, help="block width (0 = the model's width)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=256, help="token positions per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of answers held out for evaluation")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="draft only from the N most frequent target tokens: cheaper drafting (0 = all)",
    )
    p.add_argument("--out", required=True, help="output directory (config.json + heads.safetensors)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    add_machine_flags(
        p,
        "answers and hidden-state cache (default $MTP_CACHE_DIR or ~/.cache/mtp)",
        "compute the hidden-state cache under bf16 autocast: auto = CUDA or a CPU with native bf16 "
        "(~2.6x faster there; cached apart from fp32 states)",
    )
    p.set_defaults(func=run_train_heads)


def run_train_heads(args) -> int:
    cfg = TrainHeadsConfig(
        depths=args.depths,
        blocks=args.blocks,
        width=args.width,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        save_every=args.save_every,
        val_fraction=args.val_fraction,
        seed=args.seed,
        draft_vocab=args.draft_vocab,
    )
    check_example_flags(args)
    out = Path(args.out)
    check_run_out(out, is_heads_dir, "heads", args.resume)
    check_device(args.device)
    cache_dir = Path(args.cache_dir) if args.cache_dir else loading.cache_root()
    # the same examples as `mtp train` makes, so both share the self-generated answers on disk
    engine, _, examples = prepare_examples(
        args,
        args.device,
        None if args.self_generate else args.response_field,
        lambda mc: HeadsConfig.for_model(mc, cfg.depths, cfg.blocks, cfg.width),
        cache_dir,
        say,
    )
    t0 = time.perf_counter()
    amp = use_bf16(args.amp, args.device)
    feats, path = cached_features(engine.model, examples, cache_dir, progress=counter("hidden states"), amp=amp)
    agree = feats["agree"].float().mean().item()
    say(
        f"{len(feats['hidden']):,} rows of hidden states in {time.perf_counter() - t0:.0f}s ({path}); "
        f"trunk agrees with the targets on {agree:.1%} of rows"
    )
    meta = {**example_meta(args), "max_new_tokens": args.max_new_tokens, "amp_features": amp}
    train_heads(engine.model, feats, cfg, out, resume=args.resume, meta=meta, log=say)
    print(f"heads written to {out}")
    return 0
