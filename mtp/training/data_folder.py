"""An `mtp data` folder: its manifest (the settings the work order is a pure function of, `manifest`; a
resume must match it, `open_folder`), the working files answers and written requests are appended to
(TRAIN, INSTRUCTIONS; sealed into shards when a run stops, `seal`), and its lock (`locked`: one run or
seal at a time). A folder mtp did not write is refused before anything changes (`check_folder`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from dataclasses import asdict
from pathlib import Path

from mtp.core.runtime.artifacts import ArtifactError, base_hash
from mtp.training import shards
from mtp.training.data_sources import DataConfig

TRAIN = "train.jsonl"  # working files (append-only; sealed into shards when a run stops: `shards.seal`)
INSTRUCTIONS = "instructions.jsonl"
MANIFEST = shards.MANIFEST
LOCK = ".lock"


def manifest(cfg: DataConfig, engine) -> dict:
    # --self-written N is not a setting of the run but how far to take it: request j is fixed by
    # (seed, j), so a larger N later continues the same run
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("out", "batch_size", "self_written")}
    for k in ("gsm8k", "self_instruct", "prompts"):
        keep[k] = Path(keep[k]).name if keep[k] else None
    return {"format": "mtp-data", "version": 2, "base_hash": base_hash(engine.model), **keep}


@contextlib.contextmanager
def locked(out: Path):
    """Hold OUT/.lock for the duration: a second run (or seal) on the same folder is refused in one line."""
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ArtifactError(
                f"{out}: another `mtp data` run holds it (pid {other}); wait for it or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def check_folder(out: Path) -> dict | None:
    """The manifest of `--out` if it is an mtp data set, None if it is new or empty; refuses (without
    changing anything, and without a model) a file, anyone else's manifest.json, or a non-empty folder
    mtp did not write."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a directory")
    if (out / MANIFEST).exists():
        return shards.read_manifest(out)  # "not an mtp data set" for anyone else's manifest.json
    if out.exists() and any(p.name != LOCK for p in out.iterdir()):
        raise ArtifactError(f"{out} is not empty and not an mtp data set (no {MANIFEST}); choose another --out")
    return None


def open_folder(out: Path, want: dict | None) -> dict:
    """The folder's manifest (created from `want` for a new folder); refuses a folder mtp did not
    write (`check_folder`), or one made with other settings."""
    have = check_folder(out)
    if have is not None:
        if want is not None:
            diff = [k for k in want if k != "version" and have.get(k) != want[k]]
            if diff:
                raise ValueError(
                    f"{out} holds a data set made with other settings ({diff[0]}: "
                    f"{have.get(diff[0])!r}, now {want[diff[0]]!r}); choose another --out"
                )
        return have
    if want is None:
        raise ArtifactError(f"{out} is not an mtp data set (no {MANIFEST})")
    out.mkdir(parents=True, exist_ok=True)
    have = {**want, "shards": []}
    shards.write_manifest(out, have)
    return have


def seal(out, log=None) -> list[dict]:
    """Seal the working files of OUT into new shards (`shards.seal`), under the folder's lock."""
    out = Path(out)
    open_folder(out, None)
    with locked(out):
        added = shards.seal(out)
    for e in added:
        (log or (lambda m: print(m, file=sys.stderr, flush=True)))(
            f"data: sealed {e['lines']:,} lines into {out / e['file']}"
        )
    return added
