"""Launching P pipeline stages as local processes (`mtp pipeline --stages P`), and the stage
program each process runs, with its options: one per process under torchrun is the pipeline's own
entry point (`python -m mtp.pipeline`, `stage_main`), which needs nothing from the CLI."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from mtp.core.engine import Engine
from mtp.core.loading import model_layers
from mtp.core.options import (USER_ERRORS, add_model_args, add_sampling_args, check_decoding_args, engine_config,
                              read_prompt, report, sampling_params)
from mtp.pipeline.stages import PipelineModel, layer_ranges, run_stage
from mtp.pipeline.transport import PipelineConfig, PipelineError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MTP_PIPELINE_STORE="external",
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        code = fn(rank, world, *args)
    except PipelineError as e:
        if e.first or rank == 0:
            print(f"mtp: error: pipeline: {e}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def launch_local(stages: int, fn, args: tuple = (), grace_s: float = 3.0) -> int:
    """Run `fn(rank, stages, *args)` in `stages` fresh processes on this machine; this process hosts
    the rendezvous store (so it outlives any stage). Returns stage 0's exit status, or the first
    failure's. Once a stage exits non-zero the others have `grace_s` to follow (their watchdogs see
    the posted failure within a heartbeat); then the stragglers (e.g. a stopped process) are killed."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_local_entry, args=(r, stages, store.port, fn, args)) for r in range(stages)]
    for p in procs:
        p.start()
    deadline, killed = None, set()
    try:
        while any(p.exitcode is None for p in procs):
            codes = [p.exitcode for p in procs]
            if deadline is None and any(c not in (None, 0) for c in codes):
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for r, p in enumerate(procs):
                    if p.exitcode is None:
                        p.kill()
                        killed.add(r)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        return 130
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if codes[0] is not None and codes[0] < 0:
        if 0 not in killed:  # stage 0 killed by a signal from outside: nobody printed why
            print(f"mtp: error: pipeline: stage 0 was killed by signal {-codes[0]}", file=sys.stderr)
        return 1
    if codes[0]:
        return codes[0]
    return next((c for c in codes if c and c > 0), 1 if any(codes) else 0)


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--link-delay-ms", type=float, default=0.0,
                   help="delay every inter-stage message by this many ms (P messages per pass)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="a stage silent this long (dead, hung) fails the run with an error naming it")
    p.add_argument("--backend", default="auto", help="torch.distributed backend: auto (gloo on CPU, nccl on CUDA)")


def add_stage_args(p: argparse.ArgumentParser) -> None:
    """The options of one decoding run across stages (`mtp pipeline` and `python -m mtp.pipeline`)."""
    p.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    add_model_args(p)
    add_sampling_args(p)
    add_pipeline_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--show-chunks", action="store_true", help="colour each forward pass's tokens")


def config_from_args(args) -> PipelineConfig:
    if args.link_delay_ms < 0:
        raise ValueError("--link-delay-ms must be >= 0")
    if args.timeout_s <= 0:
        raise ValueError("--timeout-s must be > 0")
    return PipelineConfig(link_delay_ms=args.link_delay_ms, timeout_s=args.timeout_s, backend=args.backend)


def cli_stage(rank: int, world: int, args) -> int:
    """Stage `rank` of `world` for checked stage options (`add_stage_args`): load the model, keep this
    stage's slice, decode; stage 0 prints the result. A user error is reported by stage 0 (status 2)."""
    if not args.threads:  # stages on one machine share its cores; oversubscribed OpenMP threads crawl
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        args.threads = max(1, (os.cpu_count() or 1) // local)
    try:
        engine = Engine.load(engine_config(args))  # every stage loads the model and keeps its slice
        run_stage(rank, world, engine.model, config_from_args(args),
                  lambda pipe: _cli_generate(engine, pipe, args, world))
    except USER_ERRORS as e:
        return report(e) if rank == 0 else 2
    return 0


def _cli_generate(engine, pipe: PipelineModel, args, world: int) -> None:
    engine.model = pipe  # Engine.generate -> decode.stream -> decode_step(pipe, ...)
    result = engine.generate(args.prompt, args.strategy, sampling_params(args), chat=args.chat)
    s = result.summary
    if args.json:
        print(json.dumps({**result.to_json(), "stages": world, "link_delay_ms": args.link_delay_ms}), flush=True)
        return
    print(engine.render_chunks(result) if args.show_chunks else result.text, flush=True)
    print(f"[{result.strategy}] {len(result.token_ids)} tokens, {s['forward_passes']} passes, "
          f"{s['tokens_per_forward']:.2f} tokens/forward, {s['tokens_per_s']:.1f} tokens/s, "
          f"{world} stages, link delay {args.link_delay_ms:g} ms, finish={result.finish_reason}",
          file=sys.stderr, flush=True)


def stage_main(argv: list[str] | None = None) -> int:
    """`python -m mtp.pipeline` under torchrun: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the env."""
    p = argparse.ArgumentParser(prog="python -m mtp.pipeline",
                                description="One pipeline stage; start one per node with torchrun.")
    add_stage_args(p)
    args = p.parse_args(argv)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError:
        print("mtp: error: run under torchrun (RANK and WORLD_SIZE unset), or use `mtp pipeline --stages P`",
              file=sys.stderr)
        return 2
    try:
        check_decoding_args(args)
        config_from_args(args)
        n_layers = model_layers(args.model)
        if n_layers is not None:
            layer_ranges(n_layers, world)
        if rank == 0:
            args.prompt = read_prompt(args)
    except USER_ERRORS as e:
        return report(e)
    try:
        return cli_stage(rank, world, args)
    except PipelineError as e:
        if e.first or rank == 0:
            print(f"mtp: error: pipeline: {e}", file=sys.stderr, flush=True)
        return 1
