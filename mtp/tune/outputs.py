"""The files of `mtp tune --out`: the folder checked before any work (`check_out`: new, empty, or one an
earlier tune wrote, holding MARKER), then deploy.json (with the command that made it), results.json (every
candidate) and the pictures and report.html (`mtp.tune.report`)."""

from __future__ import annotations

import json
from pathlib import Path

from mtp.core.policy import deploy as D

MARKER = "mtp-tune.json"


def check_out(out: Path) -> None:
    """`--out` must be new, empty, or a folder an earlier `mtp tune` wrote (it holds MARKER)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ValueError(f"--out {out} holds files mtp tune did not write; choose a new or empty folder")


def write(result: dict, out: Path, command: str) -> None:
    from mtp.tune import report  # matplotlib only when writing

    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(json.dumps({"format": "mtp-tune", "command": command}) + "\n")
    deploy = result["deploy"]
    deploy.extra["command"] = command
    D.write(deploy, out / "deploy.json")
    plain = {k: v for k, v in result.items() if k != "deploy"}
    (out / "results.json").write_text(json.dumps(plain, indent=1) + "\n")
    report.write(result, out)
