"""`mtp train-eagle3`: train an EAGLE-3 drafter on the frozen model's cached residual streams."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mtp.cli.train import add_machine_flags, check_example_flags, counter, example_meta, prepare_examples, say
from mtp.core.decoding.proposers.eagle3 import Eagle3Config
from mtp.core.runtime import loading
from mtp.core.runtime.checks import check_device
from mtp.training.eagle3_train import TrainEagle3Config, cached_features, is_drafter_dir, train_eagle3
from mtp.training.trainer import check_run_out, use_bf16


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train-eagle3",
        help="train an EAGLE-3 drafter (for --proposer eagle3 and vLLM)",
        description="Self-distil an EAGLE-3 drafter: features from a low, a middle and a high "
        "trunk layer, one decoder layer, a reduced draft vocabulary, training-time "
        "test over --ttt-steps. The trunk's states are computed once and cached.",
    )
    p.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file, or smollm2-135m (default)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="JSONL file of prompts (e.g. $MTP_DATA_DIR/gsm8k/train.jsonl)")
    src.add_argument("--examples", help="JSONL of token ids {prompt_ids, response_ids} (e.g. `mtp data`'s train.jsonl)")
    p.add_argument("--prompt-field", default="question")
    p.add_argument("--response-field", default="answer", help="used with --data when not --self-generate")
    p.add_argument("--self-generate", action="store_true", help="targets = the model's own greedy answers (cached)")
    p.add_argument("--limit", type=int, default=200, help="number of prompts (or examples) to use")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length of self-generated answers")
    p.add_argument("--gen-batch-size", type=int, default=16)
    p.add_argument(
        "--aux-layers",
        default="",
        help="trunk layers fused, e.g. 2,15,27 (default: low, middle, "
        "high as vLLM: 2, n/2, n-3; id k = after k layers)",
    )
    p.add_argument("--draft-vocab", type=int, default=4096, help="N most frequent answer tokens the drafter emits")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time test steps (drafts learned per pass)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8, help="examples per step")
    p.add_argument("--max-len", type=int, default=512, help="tokens per example kept (prompt + answer)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--group-by-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="batches of examples of similar lengths (less padding; default on)",
    )
    add_machine_flags(
        p,
        "answers and feature cache (default $MTP_CACHE_DIR or ~/.cache/mtp)",
        "bf16 autocast for the drafter's steps (auto: on where bf16 is native: CUDA, AVX-512 BF16 / AMX CPUs)",
    )
    p.set_defaults(func=run_train_eagle3)


def parse_layers(text: str) -> tuple[int, ...]:
    if not text.strip():
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--aux-layers must be comma-separated layer ids, got {text!r}") from None


def run_train_eagle3(args) -> int:
    cfg = TrainEagle3Config(
        aux_layers=parse_layers(args.aux_layers),
        draft_vocab=args.draft_vocab,
        ttt_steps=args.ttt_steps,
        steps=args.steps,
        batch_size=args.batch_size,
        max_len=args.max_len,
        lr=args.lr,
        save_every=args.save_every,
        val_fraction=args.val_fraction,
        seed=args.seed,
        group_by_length=args.group_by_length,
    )
    check_example_flags(args)
    out = Path(args.out)
    check_run_out(out, is_drafter_dir, "a drafter", args.resume)
    check_device(args.device)
    cfg.amp = use_bf16(args.amp, args.device)
    cache_dir = Path(args.cache_dir) if args.cache_dir else loading.cache_root()
    engine, ecfg, examples = prepare_examples(
        args,
        args.device,
        None if args.self_generate else args.response_field,
        lambda mc: Eagle3Config.for_model(mc, cfg.draft_vocab, cfg.aux_layers or None),
        cache_dir,
        say,
    )
    t0 = time.perf_counter()
    feats, path = cached_features(
        engine.model, examples, ecfg.aux_layers, cache_dir, cfg.max_len, progress=counter("trunk states")
    )
    say(f"{len(feats['tokens']):,} positions of layers {ecfg.aux_layers} in {time.perf_counter() - t0:.0f}s ({path})")
    train_eagle3(
        engine.model,
        feats,
        cfg,
        out,
        resume=args.resume,
        meta=example_meta(args),
        log=say,
        progress=sys.stderr.isatty(),
    )
    print(f"EAGLE-3 drafter written to {out}")
    return 0
