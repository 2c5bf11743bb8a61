"""The `mtp` command: one module per subcommand under `mtp.cli`, each with `add_parser(subparsers)`
that registers its parser and sets `func`. Bad input ends in a one-line `mtp: error: ...` and exit
status 2 (`report`), never a traceback."""
from __future__ import annotations

import argparse

from mtp.cli import (bench, data, datastore, export, generate, pipeline, serve, shadow, train, train_eagle3,
                     train_heads, tune)
from mtp.cli.errors import USER_ERRORS, report

COMMANDS = [generate, train, train_heads, train_eagle3, export, data, datastore, bench, serve, shadow, pipeline, tune]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtp", description="Multi-token prediction decoding for causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        return report(e)
    except KeyboardInterrupt:
        return 130
