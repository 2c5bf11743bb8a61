"""The one error wrapper of every command (and of a pipeline stage under torchrun): user errors become
one line, `mtp: error: ...`, and exit status 2."""

from __future__ import annotations

import sys


class UserError(Exception):
    """An input problem to report in one line."""


USER_ERRORS = (
    UserError,
    ValueError,
    FileNotFoundError,
    KeyError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


def report(e: BaseException) -> int:
    """Print a user error as `mtp: error: ...` (its first line); return the exit status (2)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, KeyError):
        msg = f"missing field {msg}"
    print(f"mtp: error: {msg}", file=sys.stderr, flush=True)
    return 2
