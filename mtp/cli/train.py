"""`mtp train`: self-distil an MTP adapter (mask token + gated LoRA) with `mtp.training.distill`.

Under torchrun every process trains a replica (DDP: gloo on CPU, nccl on CUDA); rank 0 generates
and caches the self-generated answers first, then the others read that cache."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mtp.cli.options import check_device, check_threads
from mtp.core.adapter import MODES, TARGETS, is_adapter_dir
from mtp.core.artifacts import replaceable
from mtp.core.engine import Engine, EngineConfig
from mtp.training.data import build_examples, check_examples_for, load_examples, load_prompts
from mtp.training.distill import TEACHERS, TrainConfig, check_export, describe, train
from mtp.training.trainer import check_lr, distributed


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="self-distil an MTP adapter (mask token + gated LoRA)",
                       description="Student-forced online self-distillation (mask token + gated LoRA).")
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
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha")
    p.add_argument("--targets", default=",".join(TARGETS), help="projections with LoRA")
    p.add_argument("--k-max", type=int, default=16, help="span length k ~ U[2, K_MAX]")
    p.add_argument("--spans", type=int, default=5, help="mask spans per sequence")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (longer ones are cut)")
    p.add_argument("--teacher", default="hard", choices=TEACHERS)
    p.add_argument("--mode", default="gated", choices=MODES)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", required=True, help="adapter + checkpoint directory")
    p.add_argument("--export", default=None, help="also write a float16 adapter-only copy here at the end")
    p.add_argument("--resume", action="store_true", help="continue the run in --out (same settings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu | cuda (under torchrun: each process its own GPU)")
    p.set_defaults(func=run)


def run(args) -> int:
    if bool(args.data) == bool(args.examples):
        raise ValueError("give exactly one of --data FILE or --examples FILE")
    if args.data and not args.self_generate and not args.response_field:
        raise ValueError("--data needs --response-field FIELD or --self-generate")
    check_lr(args.lr)
    check_export(args.out, args.export)
    check_threads(args.threads)
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
        replaceable(Path(args.out), is_adapter_dir)  # never overwrite what mtp did not write
        if args.export:
            replaceable(Path(args.export), is_adapter_dir)
        prompts = load_prompts(args.data, args.prompt_field, args.response_field, args.limit) if args.data else None
        examples = load_examples(args.examples) if args.examples else None
        if examples is not None and args.limit:
            examples = examples[: args.limit]
        engine = Engine.load(EngineConfig(model=args.model, adapter="none", threads=args.threads, device=device))
        d, rank, _ = distributed()
        if examples is not None:
            check_examples_for(examples, engine.model, args.examples)
        if prompts is not None:
            if d is not None and rank != 0:
                d.barrier()  # rank 0 generates (and caches) first; the others then read its cache
            examples = build_examples(engine, prompts, args.self_generate, args.max_new_tokens,
                                      args.gen_batch_size, progress=rank == 0)
            if d is not None and rank == 0:
                d.barrier()
        ctx = engine.context_window
        too_long = [i for i, ex in enumerate(examples) if len(ex.prompt_ids) >= ctx]
        if too_long:
            raise ValueError(f"example {too_long[0]} is longer than the context window ({ctx} tokens)")
        cfg = TrainConfig(
            out=args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
            mode=args.mode, rank=args.rank, alpha=args.alpha, targets=tuple(args.targets.split(",")),
            k_max=args.k_max, spans=args.spans, seq_len=args.seq_len, teacher=args.teacher,
            save_every=args.save_every, seed=args.seed, resume=args.resume, device=device,
            log_every=args.log_every, export=args.export,
            meta={"model": args.model, "data": Path(args.data or args.examples).name,
                  "self_generate": bool(args.self_generate), "limit": args.limit})
        t0 = time.perf_counter()
        state = train(cfg, engine.model, examples, n_used_tokens=len(engine.tokenizer))
        if d is not None:
            d.barrier()  # nobody tears the group down while a peer still talks (gloo aborts)
        if rank == 0:
            last = state["history"][-1] if state["history"] else {}
            print(f"trained {state['step']} steps in {time.perf_counter() - t0:.0f} s "
                  f"(total {state['wall_s']:.0f} s); last: {describe(last) if last else '-'}; adapter -> {cfg.out} "
                  f"[{cfg.meta['data']}, {len(examples)} examples]"
                  + (f"; {state['world']} processes, replicas in sync: {state['ranks_in_sync']}"
                     if "ranks_in_sync" in state else ""), file=sys.stderr)
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
