"""`mtp train`: self-distil an MTP adapter (mask token + gated LoRA) with `mtp.training.distill`.

Under torchrun every process trains a replica (DDP: gloo on CPU, nccl on CUDA); rank 0 generates
and caches the self-generated answers first, then the others read that cache."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from mtp.core.engine import SHIPPED, Engine, EngineConfig
from mtp.core.runtime.adapter import MODES, TARGETS, adapter_layers, check_layers, is_adapter_dir, read_adapter_config
from mtp.core.runtime.artifacts import ArtifactError, read_json, recover_interrupted, replaceable
from mtp.core.runtime.checks import check_batch_size, check_device, check_threads
from mtp.core.runtime.loading import model_layers
from mtp.training.data import Example, build_examples, check_examples_for, load_prompts, read_examples
from mtp.training.distill import (
    RESUME_KEYS,
    SHAPE_KEYS,
    TEACHERS,
    TrainConfig,
    check_export,
    describe,
    shape_conflict,
    train,
)
from mtp.training.trainer import AMP_CHOICES, STATE, check_lr, distributed, use_bf16

# the adapter-shape flags left unset without --init-adapter take TrainConfig's defaults (with --resume:
# the checkpoint's, `resumed_config`)
DEFAULT_SHAPE = {f.name: f.default for f in fields(TrainConfig) if f.name in ("mode", "rank", "alpha", "targets")}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="self-distil an MTP adapter (mask token + gated LoRA)",
        description="Student-forced online self-distillation (mask token + gated LoRA).",
    )
    p.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file, or smollm2-135m (default)")
    p.add_argument("--data", help="JSONL of prompts (e.g. $MTP_DATA_DIR/gsm8k/train.jsonl)")
    p.add_argument("--examples", help="JSONL of token ids {prompt_ids, response_ids} (e.g. a self-generate cache)")
    p.add_argument("--prompt-field", default="question")
    p.add_argument("--response-field", default=None, help="field holding the response (else --self-generate)")
    p.add_argument("--self-generate", action="store_true", help="responses = the model's own greedy answers")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length cap of self-generated answers")
    p.add_argument("--gen-batch-size", type=int, default=16, help="sequences generated at once")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (per process under torchrun)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rank", type=int, default=None, help="LoRA rank (default 16)")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 32)")
    p.add_argument("--targets", default=None, help=f"projections with LoRA (default {','.join(TARGETS)})")
    p.add_argument(
        "--lora-layers",
        default=None,
        metavar="FROM:TO",
        help="LoRA on layers FROM..TO-1 only (FROM: = to the last layer); FROM > 0 also freezes the "
        "mask embedding, so the backward pass stops at layer FROM (faster steps)",
    )
    p.add_argument(
        "--init-adapter",
        default=None,
        metavar="DIR|auto",
        help="start from this adapter's weights (auto: the shipped one) with a fresh optimizer; "
        "mode, rank, alpha, targets and layers come from it",
    )
    p.add_argument("--k-max", type=int, default=16, help="span length k ~ U[2, K_MAX]")
    p.add_argument("--spans", type=int, default=5, help="mask spans per sequence")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (longer ones are cut)")
    p.add_argument("--teacher", default="hard", choices=TEACHERS)
    p.add_argument("--mode", default=None, choices=MODES, help="adapter mode (default gated)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", required=True, help="adapter + checkpoint directory")
    p.add_argument("--export", default=None, help="also write a float16 adapter-only copy here at the end")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out (same settings; adapter-shape flags left out come from it)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu | cuda (under torchrun: each process its own GPU)")
    p.add_argument(
        "--amp",
        choices=AMP_CHOICES,
        default="auto",
        help="bf16 autocast for the forward passes (auto: on where bf16 is native: CUDA, AVX-512 BF16 / AMX CPUs)",
    )
    p.set_defaults(func=run)


def add_machine_flags(p, cache_help: str, amp_help: str) -> None:
    """Where `train-heads` and `train-eagle3` run: --cache-dir (`cache_help`), --threads, --device and
    --amp (`amp_help`)."""
    p.add_argument("--cache-dir", default=None, help=cache_help)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", choices=AMP_CHOICES, default="auto", help=amp_help)


def check_example_flags(args) -> None:
    """A trainer's data flags (`mtp train`, `train-heads`, `train-eagle3`), before any work: exactly one
    of --data or --examples, --data with --response-field or --self-generate, --limit >= 1 (or unset),
    and the threads and generation batch size."""
    if bool(args.data) == bool(args.examples):
        raise ValueError("give exactly one of --data FILE or --examples FILE")
    if args.data and not args.self_generate and not args.response_field:
        raise ValueError("--data needs --response-field FIELD or --self-generate")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    check_threads(args.threads)
    check_batch_size(args.gen_batch_size, "--gen-batch-size")


def prepare_examples(
    args,
    device: str,
    response_field: str | None,
    sizes: Callable | None = None,
    cache_dir: Path | None = None,
    log=None,
) -> tuple[Engine, object, list[Example]]:
    """What a trainer trains on, its flags checked (`check_example_flags`): --examples read, or the
    prompts of --data (with the responses of `response_field`; None: self-generated), each checked
    against the evaluation sets before any weight loads; then the model loaded without an adapter,
    `sizes(its ModelConfig)` computed (the trainer's module sizes: bad ones fail before any work), and
    the examples checked against the model, or built from the prompts (self-generated answers cached
    under `cache_dir`, default the cache root; under torchrun rank 0 generates first and the other
    ranks then read its cache). `log(line)` is told how many examples and how long they took.
    Returns (the engine, the sizes or None, the examples)."""
    prompts = load_prompts(args.data, args.prompt_field, response_field, args.limit) if args.data else None
    examples = read_examples(args.examples, args.model, args.limit) if args.examples else None
    engine = Engine.load(EngineConfig(model=args.model, adapter="none", threads=args.threads, device=device))
    shape = sizes(engine.model.config) if sizes is not None else None
    t0 = time.perf_counter()
    d, rank, _ = distributed()
    if examples is not None:
        check_examples_for(examples, engine.model, args.examples)
    else:
        if d is not None and rank != 0:
            d.barrier()  # rank 0 generates (and caches) first; the others then read its cache
        examples = build_examples(
            engine,
            prompts,
            args.self_generate,
            args.max_new_tokens,
            args.gen_batch_size,
            cache_dir / "selfgen" if cache_dir is not None else None,
            progress=rank == 0,
        )
        if d is not None and rank == 0:
            d.barrier()
    if log is not None:
        log(f"{len(examples)} examples ready in {time.perf_counter() - t0:.0f}s")
    return engine, shape, examples


def example_meta(args) -> dict:
    """What a trained artifact records of the examples it learnt from (its config's `meta`)."""
    return {
        "model": args.model,
        "data": Path(args.data or args.examples).name,
        "self_generate": bool(args.self_generate),
        "limit": args.limit,
    }


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def counter(what: str) -> Callable[[int, int], None]:
    """progress(i, n) that keeps one stderr line `what i/n` up to date."""
    return lambda i, n: print(f"\r{what} {i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)


def run(args) -> int:
    check_example_flags(args)
    check_lr(args.lr)
    check_export(args.out, args.export)
    shape = adapter_shape(args)  # before the model loads: bad ranges and conflicting flags fail fast
    device = args.device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            check_device(device)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    check_device(device)
    try:
        out = Path(args.out)
        check_out(out, args.resume)  # never overwrite what is not this run's checkpoint
        if args.export:
            check_export_target(Path(args.export), out)
        cfg = TrainConfig(
            out=args.out,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup=args.warmup,
            **shape,
            k_max=args.k_max,
            spans=args.spans,
            seq_len=args.seq_len,
            teacher=args.teacher,
            save_every=args.save_every,
            seed=args.seed,
            resume=args.resume,
            device=device,
            log_every=args.log_every,
            export=args.export,
            amp=use_bf16(args.amp, device),
            meta=example_meta(args),
        )
        if args.resume:
            cfg = resumed_config(cfg, args)
        engine, _, examples = prepare_examples(args, device, args.response_field)
        d, rank, _ = distributed()
        ctx = engine.context_window
        too_long = [i for i, ex in enumerate(examples) if len(ex.prompt_ids) >= ctx]
        if too_long:
            raise ValueError(f"example {too_long[0]} is longer than the context window ({ctx} tokens)")
        t0 = time.perf_counter()
        state = train(cfg, engine.model, examples, n_used_tokens=len(engine.tokenizer))
        if d is not None:
            d.barrier()  # nobody tears the group down while a peer still talks (gloo aborts)
        if rank == 0:
            last = state["history"][-1] if state["history"] else {}
            print(
                f"trained {state['step']} steps in {time.perf_counter() - t0:.0f} s "
                f"(total {state['wall_s']:.0f} s); last: {describe(last) if last else '-'}; adapter -> {cfg.out} "
                f"[{cfg.meta['data']}, {len(examples)} examples]"
                + (
                    f"; {state['world']} processes, replicas in sync: {state['ranks_in_sync']}"
                    if "ranks_in_sync" in state
                    else ""
                ),
                file=sys.stderr,
            )
    finally:
        d = distributed()[0]
        if d is not None:
            d.destroy_process_group()
            if sys.exc_info()[0] is None:
                # gloo's worker threads can abort the interpreter's own shutdown ("terminate called
                # without an active exception", SIGABRT) after a run that finished cleanly: leave now.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
    return 0


def parse_layers(text: str, n_layers: int | None = None) -> tuple[int, int | None]:
    """'FROM:TO' -> (FROM, TO); 'FROM:' -> (FROM, n_layers): up to the last layer (None while it is unknown)."""
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(lo), (int(hi) if hi.strip() else n_layers)
    except ValueError:
        raise ValueError(
            f"--lora-layers {text!r}: expected FROM:TO (e.g. 15:30) or FROM: (to the last layer)"
        ) from None


def adapter_shape(args) -> dict:
    """TrainConfig's mode, rank, alpha, targets, lora_layers and init_adapter from the flags, checked
    before any weight loads: a layer range the model lacks, or (with --init-adapter) a flag that
    contradicts the adapter, is one line. The layer count comes from the model's config alone."""
    given = {
        "mode": args.mode,
        "rank": args.rank,
        "alpha": args.alpha,
        "targets": tuple(args.targets.split(",")) if args.targets else None,
    }
    n_layers = model_layers(args.model) if args.lora_layers or args.init_adapter else None
    layers = parse_layers(args.lora_layers, n_layers) if args.lora_layers else None
    if layers is not None:
        if layers[1] is None:
            raise ValueError(
                f"--lora-layers {args.lora_layers}: give TO as well (the layer count of "
                f"{args.model} is known only once it loads)"
            )
        check_layers(layers, n_layers)
        if (args.mode or DEFAULT_SHAPE["mode"]) == "full":
            raise ValueError("--lora-layers needs --mode gated or plain (full mode trains every weight)")
    if not args.init_adapter:
        return {**{k: v if v is not None else DEFAULT_SHAPE[k] for k, v in given.items()}, "lora_layers": layers}
    path = init_adapter_dir(args.init_adapter, args.model)
    acfg = read_adapter_config(path)
    have = adapter_layers(acfg, n_layers) if n_layers is not None else acfg.get("layers")
    if n_layers is not None:
        bad = shape_conflict({**given, "lora_layers": layers}, acfg, path, n_layers)
        if bad:
            raise ValueError(bad)
    # all layers is the default (None), so a run started from an all-layer adapter records no range
    every = have is None or (n_layers is not None and tuple(have) == (0, n_layers))
    return {
        "mode": acfg["mode"],
        "rank": acfg["rank"],
        "alpha": acfg["alpha"],
        "targets": tuple(acfg["targets"]),
        "lora_layers": None if every else tuple(have),
        "init_adapter": str(path.resolve()),
    }


def init_adapter_dir(value: str, model: str) -> Path:
    """--init-adapter DIR, or auto: the adapter shipped for --model."""
    if value == "auto":
        shipped = SHIPPED.get(model)
        if shipped is None or not (shipped / "adapter" / "config.json").exists():
            raise ValueError(f"--init-adapter auto: no shipped adapter for --model {model}; give a directory")
        return shipped / "adapter"
    path = Path(value)
    if not path.is_dir():
        raise ValueError(f"--init-adapter: adapter directory not found: {value}")
    return path


def check_out(out: Path, resume: bool) -> None:
    """--out before any work holds nothing but this run: without --resume a new or empty folder, with
    --resume a run's checkpoint (an adapter directory with its `trainer_state.json`). An adapter
    without a checkpoint (an --export copy, a shipped adapter) is never replaced, nor is a file or a
    folder mtp did not write (`artifacts.replaceable`)."""
    recover_interrupted(out)  # a save a kill interrupted: the previous directory back, as a save would
    replaceable(out, is_adapter_dir)
    if out.is_dir() and any(out.iterdir()):
        if not (out / STATE).exists():
            raise ArtifactError(
                f"{out} holds an adapter but no training checkpoint (an --export copy or a shipped "
                f"adapter); refusing to replace it: choose another --out (to start from it: "
                f"--init-adapter {out})"
            )
        if not resume:
            raise ValueError(f"{out} already holds a training run; pass --resume to continue or choose another --out")
    elif resume:
        raise ValueError(f"--resume: no checkpoint in {out}; drop --resume to start a new run")


def check_export_target(export: Path, out: Path) -> None:
    """--export replaces nothing but this run's own float16 copy: a new or empty folder, or an adapter
    without a checkpoint whose config records an export by a run with this --out to this --export.
    Another run's copy, a run, a shipped or any other adapter: refused before any work."""
    replaceable(export, is_adapter_dir)
    if not (export.is_dir() and any(export.iterdir())):
        return
    meta = read_json(export / "config.json", "adapter config").get("meta")
    made = meta.get("training") if isinstance(meta, dict) else None
    made = made if isinstance(made, dict) else {}
    ours = all(
        isinstance(made.get(key), str) and Path(made[key]).resolve() == path.resolve()
        for key, path in (("out", out), ("export", export))
    )
    if (export / STATE).exists() or not ours:
        raise ArtifactError(
            f"--export {export} holds an adapter that is not this run's earlier export (of --out "
            f"{out}); refusing to replace it: choose a new or empty folder"
        )


def _comparable(key: str, value, n_layers: int | None):
    """A setting as a given and a recorded one compare: JSON lists as tuples, all layers (None) as
    (0, n_layers)."""
    value = tuple(value) if isinstance(value, list) else value
    return (0, n_layers) if key == "lora_layers" and value is None and n_layers is not None else value


def _shown(key: str, value) -> str:
    if key == "targets" and isinstance(value, tuple):
        return ",".join(value)
    if key == "lora_layers" and isinstance(value, tuple):
        return f"{value[0]}:{value[1]}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def resumed_config(cfg: TrainConfig, args) -> TrainConfig:
    """--resume: `cfg` checked against the settings the checkpoint in --out recorded, before any
    weight loads. An adapter-shape flag left out (--mode, --rank, --alpha, --targets, --lora-layers,
    --init-adapter) takes the checkpoint's value; any other setting that differs is one line naming
    the flag, both values and the checkpoint (the trainer checks the rest once the data is read: the
    example count and the process count)."""
    was = read_json(Path(cfg.out) / STATE, "trainer state").get("settings")
    was = was if isinstance(was, dict) else {}
    n_layers = model_layers(args.model)
    left_out = set()
    if args.init_adapter is None:  # else the shape came from that adapter (`adapter_shape`): compared
        left_out = {"init_adapter"} | {k for k in SHAPE_KEYS if getattr(args, k) is None}
    now = asdict(cfg)
    keep = {}
    for k in (k for k in RESUME_KEYS if k in now):  # not n_examples, world: known once data and processes are
        given, before = _comparable(k, now[k], n_layers), _comparable(k, was.get(k), n_layers)
        if k not in left_out and given != before:
            raise ValueError(
                f"--resume: --{k.replace('_', '-')} {_shown(k, given)} contradicts the checkpoint in "
                f"{cfg.out} ({k} {_shown(k, before)}); a resumed run keeps the settings it started "
                "with: drop the flag or train into another --out"
            )
        keep[k] = tuple(was[k]) if isinstance(was.get(k), list) else was.get(k)  # as recorded: the trainer compares
    if keep.get("init_adapter") and not Path(keep["init_adapter"]).is_dir():
        raise ValueError(
            f"--resume: the run in {cfg.out} started from --init-adapter {keep['init_adapter']}, "
            "which is gone; put it back to resume"
        )
    return replace(cfg, **keep)
