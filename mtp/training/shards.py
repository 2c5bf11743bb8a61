"""An append-only data set kept in a repository: sealed, checksummed, compressed shards.

A data folder made by `mtp data` (e.g. `data/smollm2-135m/mix-v1/`) holds

    manifest.json              the run's settings, and "shards": one entry per sealed file
    train-00001.jsonl.gz ...   answers, one JSON record per line (`id`, `source`, `category`,
                               `prompt_ids`, `response_ids`, `finish`); never rewritten
    instructions-00001.jsonl.gz ...  the requests the model wrote (`mtp data --self-written`)
    train.jsonl, instructions.jsonl   the working files a running `mtp data` appends to
    heldout/*.jsonl, card.md, card.json

`seal(folder)` moves every working line not yet in a shard into one new shard per log (written to a
temporary name, fsynced, renamed), records its sha256, line count and tokens in the manifest, and only
then empties the working file, so a kill at any moment loses no sealed line: a crash before the manifest
names the new shard leaves the lines in the working file (the orphan shard is overwritten at the next
seal); a crash after leaves them in both, and ids already sealed are skipped. `read(folder, log)`
returns every record of the sealed shards (each verified against its checksum: a truncated or changed
shard is refused in one line) and of the working file, by id.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
from pathlib import Path

from mtp.core.runtime.artifacts import write_text_atomic  # noqa: F401  (shards.write_text_atomic: one writer)

MANIFEST = "manifest.json"
LOGS = ("train", "instructions")  # the working file of log L is L.jsonl; its shards L-00001.jsonl.gz, ...


class ShardError(ValueError):
    """A shard that does not match its manifest entry (one line for the user)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise ShardError(f"{path}: not a readable data manifest") from None
    if not isinstance(m, dict) or m.get("format") != "mtp-data":
        raise ShardError(f'{path}: not an mtp data set (no "format": "mtp-data")')
    if not isinstance(m.get("shards", []), list):
        raise ShardError(f'{path}: "shards" is not a list')
    return m


def write_manifest(folder: Path, manifest: dict) -> None:
    write_text_atomic(Path(folder) / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def shard_entries(manifest: dict, log: str) -> list[dict]:
    return [s for s in manifest.get("shards", []) if isinstance(s, dict) and s.get("log") == log]


ID_LISTS = ("prompt_ids", "response_ids")
_INT = {int}  # a token list's element types must be exactly int (not bool, not float)


def parse_line(line: bytes | str, key: str = "id") -> dict | None:
    """A record (a JSON object with `key` and int lists `prompt_ids`, `response_ids`), or None. A key
    other than those lists must be a string or an integer (records are looked up by it)."""
    try:
        rec = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    ok = (
        isinstance(rec, dict)
        and key in rec
        and all(isinstance(rec.get(f), list) and set(map(type, rec[f])) <= _INT for f in ID_LISTS)
    )
    if ok and key not in ID_LISTS:
        ok = type(rec[key]) in (str, int)  # e.g. {"id": [1]} is unhashable: a corrupt line, not a crash
    return rec if ok else None


def read_shard(folder: Path, entry: dict, key: str = "id") -> list[dict]:
    """The records of one sealed shard, after checking its checksum and line count."""
    path = Path(folder) / str(entry.get("file", ""))
    if not path.is_file():
        raise ShardError(f"{path}: shard named in the manifest is missing (restore it: git checkout -- {path.name})")
    if sha256_file(path) != entry.get("sha256"):
        raise ShardError(
            f"{path}: checksum does not match the manifest (truncated or changed); "
            f"restore it from git, shards are never rewritten"
        )
    try:
        raw = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, gzip.BadGzipFile):
        raise ShardError(f"{path}: not a readable gzip file") from None
    recs = [parse_line(x, key) for x in raw.splitlines() if x.strip()]
    if any(r is None for r in recs) or len(recs) != entry.get("lines"):
        raise ShardError(
            f"{path}: {sum(r is None for r in recs)} unreadable line(s), {len(recs)} lines "
            f"against {entry.get('lines')} in the manifest"
        )
    return recs


def read_working(path: Path, key: str = "id", repair: bool = True) -> tuple[list[dict], int]:
    """Records of an append-only working file and the number of corrupt lines skipped. With `repair`
    a torn last line (a kill while writing) is cut off the file, so appending continues cleanly."""
    if not path.exists():
        return [], 0
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        raw = raw[: raw.rfind(b"\n") + 1]
        if repair:
            with open(path, "r+b") as f:
                f.truncate(len(raw))
    recs = [parse_line(x, key) for x in raw.splitlines() if x.strip()]
    return [r for r in recs if r is not None], sum(r is None for r in recs)


def read(folder, log: str = "train", key: str = "id", repair: bool = True) -> tuple[dict, int]:
    """({id: record}, corrupt working lines skipped) over the sealed shards, then the working file."""
    folder = Path(folder)
    done: dict = {}
    if (folder / MANIFEST).exists():
        for entry in shard_entries(read_manifest(folder), log):
            for rec in read_shard(folder, entry, key):
                done.setdefault(rec[key], rec)
    recs, bad = read_working(folder / f"{log}.jsonl", key, repair)
    for rec in recs:
        done.setdefault(rec[key], rec)
    return done, bad


def _next_name(manifest: dict, log: str) -> str:
    """The next shard name of `log`: after the highest number the manifest names, never one it names
    (so a sealed shard is never overwritten, whatever entries were removed or reordered)."""
    named = {str(e.get("file")) for e in manifest.get("shards", []) if isinstance(e, dict)}
    numbers = [int(m.group(1)) for f in named if (m := re.fullmatch(rf"{re.escape(log)}-(\d+)\.jsonl\.gz", f))]
    n = max(numbers, default=0) + 1
    while f"{log}-{n:05d}.jsonl.gz" in named:
        n += 1
    return f"{log}-{n:05d}.jsonl.gz"


def _gzip_lines(recs: list[dict]) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as z:  # same bytes for same lines
        for rec in recs:
            z.write((json.dumps(rec) + "\n").encode())
    return buf.getvalue()


def seal(folder, key: str = "id") -> list[dict]:
    """Move the working files' new lines into new shards; return the new manifest entries."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    added = []
    for log in LOGS:
        work = folder / f"{log}.jsonl"
        entries = shard_entries(manifest, log)
        sealed = {r[key] for e in entries for r in read_shard(folder, e, key)}
        recs, _ = read_working(work, key)
        new, seen = [], set(sealed)
        for r in recs:
            if r[key] not in seen:
                seen.add(r[key])
                new.append(r)
        if new:
            name = _next_name(manifest, log)
            data = _gzip_lines(new)
            tmp = folder / f".{name}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(folder / name)
            entry = {
                "log": log,
                "file": name,
                "sha256": hashlib.sha256(data).hexdigest(),
                "lines": len(new),
                "response_tokens": sum(len(r["response_ids"]) for r in new),
            }
            manifest = {**manifest, "shards": [*manifest.get("shards", []), entry]}
            write_manifest(folder, manifest)
            added.append(entry)
        if work.exists() and work.stat().st_size:
            with open(work, "r+b") as f:  # everything in it is sealed now
                f.truncate(0)
    return added
