"""`mtp pipeline`: decode one prompt across P pipeline stages (`mtp.pipeline`), as local processes
or, under torchrun, one stage per process (`python -m mtp.pipeline`, same options)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from mtp.cli.errors import USER_ERRORS, report
from mtp.cli.options import (
    add_model_args,
    add_sampling_args,
    check_context,
    check_decoding_args,
    engine_config,
    read_prompt,
    sampling_params,
)
from mtp.core.engine import Engine
from mtp.core.runtime.loading import model_layers
from mtp.pipeline.launch import launch_local
from mtp.pipeline.pricing import parse_cluster, predict_cluster
from mtp.pipeline.stages import PipelineModel, layer_ranges, run_stage
from mtp.pipeline.transport import PipelineConfig, PipelineError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "pipeline",
        help="decode across P pipeline stages (local processes) on torch.distributed",
        description="Split the model's layers over P local processes linked by torch.distributed "
        "and decode one prompt; across machines run `torchrun ... -m mtp.pipeline` "
        "with the same options.",
    )
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = local processes (default 2)")
    add_stage_args(p)
    p.add_argument(
        "--predict",
        metavar="SPEC",
        help="print the cost model's prediction for a cluster instead of running, e.g. "
        "stages=8,latency_ms=0.5,pass_ms=40,tokens_per_pass=3[,block_cost=1.1,"
        "bandwidth_gbps=10,dim=4096,vocab=128256,dtype_bytes=2]",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    """`mtp pipeline`: validate here, then launch the stages (stage 0 prints the result)."""
    if args.predict:
        print_prediction(args.predict)
        return 0
    check_decoding_args(args)
    check_context(args)
    config_from_args(args)
    if "eagle3" in args.proposer.split("+"):  # its drafter reads trunk layers that other stages hold
        raise ValueError(
            "mtp pipeline does not run --proposer eagle3 (its drafter reads residual streams of layers "
            "spread over the stages); use heads, suffix, lookup or a merge of them"
        )
    if args.stages < 1:
        raise ValueError("--stages must be >= 1")
    n_layers = model_layers(args.model)  # from the config alone: no stage starts before this check
    if n_layers is not None:
        layer_ranges(n_layers, args.stages)
    args.prompt = read_prompt(args)
    return launch_local(args.stages, cli_stage, (args,))


def print_prediction(spec: str) -> None:
    cluster = parse_cluster(spec)
    print(predict_cluster(**cluster)["text"])


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--link-delay-ms",
        type=float,
        default=0.0,
        help="delay every inter-stage message by this many ms (P messages per pass)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        help="a stage silent this long (dead, hung) fails the run with an error naming it",
    )
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
        run_stage(
            rank, world, engine.model, config_from_args(args), lambda pipe: _cli_generate(engine, pipe, args, world)
        )
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
    print(
        f"[{result.strategy}] {len(result.token_ids)} tokens, {s['forward_passes']} passes, "
        f"{s['tokens_per_forward']:.2f} tokens/forward, {s['tokens_per_s']:.1f} tokens/s, "
        f"{world} stages, link delay {args.link_delay_ms:g} ms, finish={result.finish_reason}",
        file=sys.stderr,
        flush=True,
    )


def stage_main(argv: list[str] | None = None) -> int:
    """`python -m mtp.pipeline` under torchrun: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the env."""
    p = argparse.ArgumentParser(
        prog="python -m mtp.pipeline", description="One pipeline stage; start one per node with torchrun."
    )
    add_stage_args(p)
    args = p.parse_args(argv)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError:
        print(
            "mtp: error: run under torchrun (RANK and WORLD_SIZE unset), or use `mtp pipeline --stages P`",
            file=sys.stderr,
        )
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
