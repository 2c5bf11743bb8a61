"""`mtp tune`: the fastest configuration within a quality tolerance, as a deploy file (`mtp.tune.run`).

    mtp tune --data gsm8k:test.jsonl --tolerance 0.02 --metric answer --out tuned/
    mtp serve --deploy tuned/deploy.json --rollout 0.1 --rollout-step 0.2 --shadow-rate 1

Options may also come from `--config FILE` (TOML or JSON, the same names with `_` or `-`); a flag
given on the command line wins over the file. `mtp tune --toy` prints the toy check (blocks forming on
counting, a repeated phrase and a list) and needs nothing else. Every option is checked before the
model loads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mtp.cli.options import add_model_args, engine_config
from mtp.core.runtime.artifacts import check_not_shipped

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: JSON config files only
    tomllib = None
# what reading an unreadable --config file raises (a name: `except` takes classes or a tuple of them)
CONFIG_ERRORS = (json.JSONDecodeError, UnicodeDecodeError) + ((tomllib.TOMLDecodeError,) if tomllib else ())

FIELDS = {
    "data": str,
    "tolerance": float,
    "metric": str,
    "latency_ms": float,
    "limit": int,
    "max_new_tokens": int,
    "probe": int,
    "calibrate": int,
    "measure": int,
    "measure_rows": int,
    "measure_all": bool,
    "batch": int,
    "candidates": str,
    "out": str,
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "tune",
        help="choose the fastest configuration within a quality tolerance; write deploy.json",
        description="Reference answers, this machine's t(q), predictability, calibration, a priced "
        "sweep and a measured final round; writes deploy.json, results.json, report.html.",
    )
    add_model_args(p)
    p.add_argument("--data", default=None, help="gsm8k:PATH or prompts:PATH (JSONL with 'prompt', optional 'category')")
    p.add_argument("--tolerance", type=float, default=None, help="largest quality loss accepted, in [0, 1]")
    p.add_argument("--metric", default=None, help="exact | answer | rougeL (default: answer for gsm8k, rougeL else)")
    p.add_argument("--latency-ms", type=float, default=None, help="target milliseconds per token (reported against)")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts (default 100)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 256")
    p.add_argument(
        "--probe",
        type=int,
        default=None,
        help="prompts a decoded candidate decodes, batched (default 8; replayable lossless ones use every prompt)",
    )
    p.add_argument(
        "--calibrate",
        type=int,
        default=None,
        help="prompts a decoded proposer (mask adapter) decodes for its calibration (default 48)",
    )
    p.add_argument("--measure", type=int, default=None, help="prompts the finalists decode one at a time (default 8)")
    p.add_argument("--measure-rows", type=int, default=None, help="finalists besides ntp (default 3)")
    p.add_argument(
        "--measure-all",
        action="store_const",
        const=True,
        default=None,
        help="measure every qualifying candidate (a full sweep, to check the choice)",
    )
    p.add_argument("--batch", type=int, default=None, help="rows decoded together offline (default 32)")
    p.add_argument(
        "--candidates",
        default=None,
        help="comma list STRATEGY@PROPOSER replacing the default sweep, e.g. verify:4@heads,conf_adapt:0.95:4@mask",
    )
    p.add_argument("--config", default=None, help="TOML or JSON file with these options")
    p.add_argument("--out", default=None, help="output folder (deploy.json, results.json, report.html)")
    p.add_argument("--toy", action="store_true", help="print the toy check (blocks forming) and exit")
    p.set_defaults(func=run)


def read_config(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {path}: no such file")
    if p.suffix != ".json" and tomllib is None:
        raise ValueError(f"--config {path}: TOML needs Python 3.11; give a .json file")
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except CONFIG_ERRORS as e:
        raise ValueError(f"--config {path}: not valid {'JSON' if p.suffix == '.json' else 'TOML'} ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a table of options")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ValueError(f"--config {path}: unknown option {key!r}; known: {', '.join(sorted(FIELDS))}")
        want = FIELDS[name]
        ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ValueError(f"--config {path}: {key} must be {want.__name__}, got {value!r}")
        out[name] = value
    return out


def options(args) -> dict:
    """File options overridden by flags given on the command line."""
    merged = read_config(args.config) if args.config else {}
    for name in FIELDS:
        v = getattr(args, name)
        if v is not None:
            merged[name] = v
    return merged


def run(args) -> int:
    from mtp.core.engine import Engine

    if args.toy:
        from mtp.tune import toy

        engine = Engine.load(engine_config(args))
        toy.run(engine, colour=sys.stdout.isatty())
        return 0
    from mtp.eval.bench import load_data
    from mtp.tune.run import TuneConfig, check_out, write
    from mtp.tune.run import run as tune

    opts = options(args)
    for need in ("data", "tolerance", "out"):
        if need not in opts:
            raise ValueError(f"mtp tune needs --{need} (or '{need}' in --config); or run mtp tune --toy")
    out = Path(opts.pop("out"))
    if args.out is None:  # --out is checked with every command's outputs (`mtp.cli.check_outputs`); a file's here
        check_not_shipped(out, f"--config {args.config}: out")
    cfg = TuneConfig(**opts)
    load_data(cfg.data, cfg.limit)  # a missing or empty prompts file: before the model loads
    check_out(out)
    if cfg.candidates:
        from mtp.tune.candidates import parse

        parse(cfg.candidates)
    engine = Engine.load(engine_config(args))
    result = tune(engine, cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    write(result, out, "mtp " + " ".join(sys.argv[1:]))
    d = result["deploy"]
    m = d.extra["measured"]
    print(
        f"mtp tune: {d.tuned} within {d.tolerance:g} {d.metric} loss: {m['tokens_per_s']:.1f} tokens/s, "
        f"{m['speedup_vs_ntp']:.2f}x ntp (fallback {d.fallback}); wrote {out}/deploy.json, results.json, report.html"
    )
    return 0
