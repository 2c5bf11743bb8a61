"""`mtp serve`: the OpenAI-compatible server (`mtp.serving.app`) with its flags.

The API key comes from `--api-key KEY` (seen by anyone who runs `ps`), `--api-key-file PATH` (its one
line) or the environment variable MTP_API_KEY, in that order; an empty one is refused, as is giving
both flags. Every flag is checked before the model loads.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from mtp.cli.options import add_model_args, add_sampling_args, check_decoding_args, engine_config
from mtp.core.decoding.proposers import AUTO
from mtp.core.engine import Engine
from mtp.core.policy import deploy as deploy_file
from mtp.core.policy.costmodel import CostModel, measured_cost
from mtp.core.runtime.checks import MAX_BATCH
from mtp.core.runtime.weights import check_weights
from mtp.serving.config import MAX_MESSAGES, ServeConfig, check_shutdown_timeout
from mtp.serving.scheduler import SchedulerConfig

API_KEY_ENV = "MTP_API_KEY"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and shadow mode")
    add_model_args(p, AUTO)  # the shipped model: its best measured merge (mtp.core.decoding.proposers)
    add_sampling_args(p)
    _add_endpoint_args(p)
    _add_limit_args(p)
    _add_rollout_args(p)
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def _add_endpoint_args(p) -> None:
    """Where the server listens, who may call it, and the model name clients use."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (all but /health); "
        f"visible in `ps`: prefer --api-key-file or ${API_KEY_ENV}",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"read the API key from this file (default: ${API_KEY_ENV}, if set)",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")


def _add_limit_args(p) -> None:
    """What the server takes on: batch, lengths, the cache budget, K per pass (adaptive), request sizes."""
    p.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help=f"requests decoded together (KV-cache rows, 1..{MAX_BATCH}; the cache must fit in memory)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + max_tokens per request, at least 2 (default: min(context window, 1024))",
    )
    p.add_argument(
        "--max-cache-tokens",
        type=int,
        default=0,
        help="admission budget: sum of prompt + max_tokens + K over running requests "
        "(default, or 0: max-batch x max-model-len)",
    )
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cap K per pass with the cost model when proposals do not pay (default on)",
    )
    p.add_argument(
        "--cost-model", default=None, help="cost-model JSON from `mtp bench --profile` (default: measured at start-up)"
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        help="largest request body accepted (HTTP 413 above it; default 4 MiB)",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=0,
        help="largest prompt in characters, checked before tokenising (default, or 0: 32 x max-model-len)",
    )
    p.add_argument(
        "--max-messages",
        type=int,
        default=MAX_MESSAGES,
        help=f"most messages in a chat request (default {MAX_MESSAGES})",
    )


def _add_rollout_args(p) -> None:
    """`mtp tune`'s deploy file rolled out, and the shadow comparisons against ntp that guard it."""
    p.add_argument(
        "--deploy",
        default=None,
        metavar="DEPLOY.json",
        help="serve `mtp tune`'s choice: requests without their own strategy get the tuned configuration "
        "(a --rollout fraction of them) or its lossless fallback",
    )
    p.add_argument(
        "--rollout",
        type=float,
        default=1.0,
        help="with --deploy: fraction of requests given the tuned configuration at start (default 1)",
    )
    p.add_argument(
        "--rollout-step",
        type=float,
        default=0.0,
        help="with --deploy: added to the fraction after each window of shadow comparisons within "
        "the tolerance (default 0: no ramp)",
    )
    p.add_argument(
        "--rollout-window",
        type=int,
        default=20,
        help="with --deploy: shadow comparisons per window (fallback when a window's loss exceeds "
        "the deploy file's tolerance)",
    )
    p.add_argument(
        "--shadow-rate",
        type=float,
        default=None,
        help="fraction of MTP requests re-decoded with ntp (default 0; 1 with --deploy)",
    )
    p.add_argument("--shadow-log", default="mtp-shadow.jsonl", help="JSONL log of shadow comparisons")


def api_key(args) -> str | None:
    """The key from --api-key, --api-key-file or $MTP_API_KEY (None: no authentication)."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        if "\n" in key:
            raise ValueError(f"--api-key-file {args.api_key_file} holds more than one line")
        return key
    if args.api_key is None and API_KEY_ENV in os.environ:
        key = os.environ[API_KEY_ENV].strip()
        if not key:
            raise ValueError(f"${API_KEY_ENV} is set but empty; give a key, or unset it for no authentication")
        return key
    return args.api_key


def read_deploy(args):
    """The --deploy file, checked (before any model loads), or None; the --rollout flags need it. A file
    tuned with other --weights than this server's is refused (`deploy.check_weights`): other arithmetic,
    other text, so its measured loss would not hold."""
    if args.deploy is None:
        if args.rollout != 1.0 or args.rollout_step or args.rollout_window != 20:
            raise ValueError("--rollout, --rollout-step and --rollout-window need --deploy DEPLOY.json")
        return None
    deploy = deploy_file.read(args.deploy)
    # what will run the model: --weights, or torch with --no-pack or off the CPU (mtp.core.runtime.weights.attach)
    on_cpu = str(getattr(args, "device", "cpu")) == "cpu"
    here = check_weights(args.weights) if getattr(args, "pack", True) and on_cpu else "torch"
    deploy_file.check_weights(deploy, here, args.deploy)
    if deploy.metric == "rougeL":
        try:
            import rouge_score  # noqa: F401
        except ImportError:
            raise ValueError(
                f"{args.deploy}: its metric rougeL needs the rouge-score package (pip install 'mtp[bench]')"
            ) from None
    return deploy


def build_config(args, context_window: int, deploy=None) -> ServeConfig:
    max_len = args.max_model_len if args.max_model_len is not None else min(context_window, 1024)
    if max_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {max_len}")
    if max_len > context_window:
        raise ValueError(f"--max-model-len {max_len} exceeds the model's context window {context_window}")
    shadow_rate = args.shadow_rate if args.shadow_rate is not None else (1.0 if deploy is not None else 0.0)
    sched = SchedulerConfig(
        max_batch=args.max_batch, max_model_len=max_len, max_cache_tokens=args.max_cache_tokens, adaptive=args.adaptive
    )
    return ServeConfig(
        model_name=args.served_model_name or args.model,
        strategy=args.strategy,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_new_tokens,
        stop=list(args.stop or []),
        seed=args.seed,
        api_key=api_key(args),
        shadow_rate=shadow_rate,
        shadow_log=args.shadow_log,
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        max_messages=args.max_messages,
        scheduler=sched,
        deploy=deploy,
        rollout=args.rollout,
        rollout_step=args.rollout_step,
        rollout_window=args.rollout_window,
    )


def run(args) -> int:
    # the server's modules need the optional [serve] dependencies (fastapi, uvicorn): imported here, so
    # every other command works without them
    from mtp.serving.app import create_app, serve_app

    check_decoding_args(args)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    check_shutdown_timeout(args.shutdown_timeout)
    deploy = read_deploy(args)
    build_config(args, 1 << 30, deploy)  # every server flag (API key, shadow log, limits) before the model loads
    cost_model = CostModel.load(args.cost_model) if args.cost_model else None  # a bad file: before the load too
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), format="%(message)s")
    ecfg = engine_config(args)
    if deploy is not None:  # the tuned proposer (calibrated as tuned) is the engine's
        arms = [a for a in (deploy.tuned, deploy.fallback) if not a.strategy.plain]
        ecfg.proposer = arms[0].proposer if arms else ecfg.proposer
        ecfg.calibration = dict(deploy.calibration)
    engine = Engine.load(ecfg)
    if deploy is not None:
        for arm in (deploy.tuned, deploy.fallback):
            if not arm.strategy.plain:
                engine.proposer(arm.proposer)  # loads its assets, so their hashes can be checked
        deploy_file.check_engine(deploy, engine)
    config = build_config(args, engine.context_window, deploy)
    pass_time = None
    if cost_model is not None:
        engine.cost_model = cost_model  # also what tree:auto sizes its trees by
    if config.scheduler.adaptive:
        if cost_model is not None:
            pass_time = cost_model.pass_time
        elif engine.can_propose():
            print("mtp serve: measuring the pass-time cost model (--cost-model PATH skips this)...", file=sys.stderr)
            cost = measured_cost(engine.model, config.scheduler.max_batch)
            pass_time = cost.pass_time
            engine.cost_model = cost
            print(
                "mtp serve: t(q) ms: " + ", ".join(f"{q}:{1000 * t:.0f}" for q, t in cost.points.items()),
                file=sys.stderr,
            )
    app = create_app(engine, config, pass_time)
    print(
        f"mtp serve: {config.model_name} on http://{args.host}:{args.port}/v1 (strategy {config.strategy}, "
        f"max batch {config.scheduler.max_batch})",
        file=sys.stderr,
    )
    if deploy is not None:
        print(
            f"mtp serve: rolling out {deploy.tuned} to {100 * config.rollout:.0f}% of requests"
            f"{f', +{100 * config.rollout_step:.0f}% per clean window' if config.rollout_step else ''} "
            f"(fallback {deploy.fallback}; {deploy.metric} loss within {deploy.tolerance:g} over windows of "
            f"{config.rollout_window}, shadow rate {config.shadow_rate:g})",
            file=sys.stderr,
        )
    return serve_app(app, args.host, args.port, args.log_level, args.shutdown_timeout)
