"""The `mtp` command: one module per subcommand under `mtp.cli`, each with `add_parser(subparsers)`
that registers its parser and sets `func`. Bad input ends in a one-line `mtp: error: ...` and exit
status 2 (`report`), never a traceback. Checked here, once, before any command runs (`check_setup`):
no command writes into the shipped assets (every output option in `OUTPUTS`, and `$MTP_CACHE_DIR`:
`artifacts.check_not_shipped`), every output it writes is writable (`WRITTEN`, `artifacts.check_writable`:
a read-only or immutable folder fails now, not after the work), and `MTP_KERNEL_ISA` names a path."""

from __future__ import annotations

import argparse
import importlib
import sys

from mtp.cli.errors import USER_ERRORS, report
from mtp.core.runtime import kernels
from mtp.core.runtime.artifacts import cache_root, check_not_shipped, check_writable

# command -> its module under mtp.cli, imported when the parser is built: importing one of them (a
# pipeline stage imports mtp.cli.pipeline) loads this package, and that must not load the server or the trainers
COMMANDS = {
    "generate": "generate",
    "train": "train",
    "train-heads": "train_heads",
    "train-eagle3": "train_eagle3",
    "export": "export",
    "data": "data",
    "datastore": "datastore",
    "bench": "bench",
    "serve": "serve",
    "shadow-report": "shadow",
    "pipeline": "pipeline",
    "tune": "tune",
}
# every option that names a place a command writes (its parsed attribute: the flag); a new output
# option belongs here, so the shipped assets stay out of reach of every command
OUTPUTS = {"out": "--out", "export": "--export", "cache_dir": "--cache-dir", "shadow_log": "--shadow-log"}
# the output options every command that has them writes (serve writes --shadow-log only in shadow mode)
WRITTEN = ("out", "export", "cache_dir")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole `mtp` parser; `only` (a command of COMMANDS): that command's parser in full, the others
    as bare names, so a run imports the module of its own command only (the others' imports cost
    ~0.3 s of every start)."""
    parser = argparse.ArgumentParser(prog="mtp", description="Multi-token prediction decoding for causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        if only in (None, name):
            importlib.import_module(f"mtp.cli.{module}").add_parser(sub)
        else:
            sub.add_parser(name)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The command `argv` runs (its first word, when COMMANDS has it), else None."""
    return argv[0] if argv and argv[0] in COMMANDS else None


def check_outputs(args) -> None:
    """Refuse, before any work, an output option of `args` that points into the shipped assets, or,
    for the options in `WRITTEN`, one that cannot be written."""
    for attr, flag in OUTPUTS.items():
        value = getattr(args, attr, None)
        if value is not None:
            check_not_shipped(value, flag)
            if attr in WRITTEN:
                check_writable(value, flag)


def check_setup(args) -> None:
    """Everything a command is refused for before it does any work: the environment (`$MTP_CACHE_DIR`
    outside the shipped assets, a known `MTP_KERNEL_ISA`), then its output options."""
    cache_root()
    kernels.check_isa_env()
    check_outputs(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(command_of(argv))
    args = parser.parse_args(argv)
    try:
        check_setup(args)
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        return report(e)
    except KeyboardInterrupt:
        print("mtp: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
