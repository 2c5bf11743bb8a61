"""`mtp bench`: every strategy and peer on the same prompts, interleaved (`mtp.eval.bench`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mtp.cli.options import add_model_args, check_context, engine_config
from mtp.core.engine import Engine
from mtp.core.policy import deploy as deploy_file
from mtp.eval.bench import BenchConfig, check_out, load_data, parse_strategies, print_summary, run_bench, write_outputs
from mtp.eval.peers import OPTIONAL_ARG, PARAMETRISED, PEERS, parse_baselines


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark strategies and peers: speed, quality, cost model, report",
        description="Greedy decoding of every prompt by every strategy and peer, interleaved; each row's "
        "speed end to end (tokens / wall time of the request, prompt included) and decode-only (after the "
        "prompt's pass; llama-server's own timings), each with its ratio to ntp; "
        "writes results.jsonl, pareto.png, acceptance.png and report.html to --out.",
    )
    add_model_args(p)
    p.add_argument(
        "--data",
        required=True,
        help="gsm8k:PATH (GSM8K JSONL or its folder) or prompts:PATH (JSONL with 'prompt' or 'turns')",
    )
    p.add_argument(
        "--strategies",
        default="ntp",
        help="comma list and sweeps, e.g. 'verify:4,conf_adapt:0.99,0.9,static:1..8' (ntp always runs); "
        "STRATEGY@PROPOSER gives a row its own proposer, e.g. verify:4@mask-single",
    )
    p.add_argument(
        "--baselines",
        default="",
        help="peers to run alongside: "
        + ",".join(n + (":DIR" if n in PARAMETRISED else "[:GGUF]" if n in OPTIONAL_ARG else "") for n in PEERS),
    )
    p.add_argument("--limit", type=int, default=None, help="use the first N items")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="timed repeats per prompt (median and spread)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--profile", action="store_true", help="measure t(q), predict speedups, advise K")
    p.add_argument("--profile-cache-len", type=int, default=300)
    p.add_argument("--profile-repeats", type=int, default=5)
    p.add_argument(
        "--calibration",
        metavar="DEPLOY.json",
        default=None,
        help="an `mtp tune` deploy file: every proposer reads its calibrated confidences, as under "
        "`mtp serve --deploy` (merged trees rank their parts' nodes by them)",
    )
    p.add_argument("--chunk-examples", type=int, default=2, help="prompts shown in the report's chunk view")
    p.add_argument("--out", default="bench-out", help="output directory")
    p.set_defaults(func=run)


def run(args) -> int:
    # every input check before the model loads
    for flag in ("limit", "repeats", "max_new_tokens"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    strategies = parse_strategies(args.strategies)
    baselines = parse_baselines(args.baselines)
    kind, items = load_data(args.data, args.limit)
    check_out(Path(args.out))
    deploy = deploy_file.read(args.calibration) if args.calibration else None
    cfg = BenchConfig(
        strategies,
        baselines,
        args.repeats,
        args.max_new_tokens,
        args.warmup,
        args.chat,
        args.profile,
        args.profile_cache_len,
        args.profile_repeats,
    )
    console = Console(stderr=True)
    ecfg = engine_config(args)
    check_context(args)
    if deploy is not None:
        ecfg.calibration = dict(deploy.calibration)
    engine = Engine.load(ecfg)
    if deploy is not None:
        for spec in strategies:
            if not spec.strategy.plain:
                engine.proposer(spec.proposer)  # loads its assets, so the deploy file's hashes can be checked
        deploy_file.check_engine(deploy, engine)
    n_rows = len(strategies) + len(baselines)
    total = len(items) * args.repeats * n_rows + (n_rows if args.warmup else 0) + (1 if args.profile else 0)
    if console.is_terminal:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            task = progress.add_task("bench", total=total)
            res = run_bench(
                engine, kind, items, cfg, on_step=lambda label: progress.update(task, advance=1, description=label)
            )
    else:  # a log file: one plain line per step
        done = iter(range(1, total + 1))
        t0 = time.perf_counter()
        res = run_bench(
            engine,
            kind,
            items,
            cfg,
            on_step=lambda label: print(
                f"[{next(done, total)}/{total} {time.perf_counter() - t0:.0f}s] {label}", file=sys.stderr, flush=True
            ),
        )
    out = Path(args.out)
    write_outputs(res, out, engine, "mtp " + " ".join(sys.argv[1:]), args.chunk_examples)
    print_summary(res, Console() if sys.stdout.isatty() else Console(width=200))  # a log: the whole table
    console.print(
        f"wrote {out}/results.jsonl, pareto.png, acceptance.png, report.html"
        + (", profile.json" if res.cost is not None else "")
    )
    return 0
