"""The `mtp` command. Subcommands live beside the code they run: each module listed in SUBCOMMANDS
has `add_cli(subparsers)` that registers its parser and sets `func`. Bad input ends in a one-line
`mtp: error: ...` and exit status 2, never a traceback."""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = [
    "mtp.cli.generate",
    "mtp.training.distill",
    "mtp.training.heads_train",
    "mtp.eval.bench",
    "mtp.serving.app",
    "mtp.serving.shadow",
    "mtp.pipeline.stages",
]


class UserError(Exception):
    """An input problem to report in one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtp", description="Multi-token prediction decoding for causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # not written yet
                continue
            raise
        mod.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError, KeyError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"mtp: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

