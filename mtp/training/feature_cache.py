"""The frozen trunk's features over a list of examples, cached in blocks: computed once, resumable, grown.

A trainer that reads the trunk's states (heads, EAGLE-3) computes them once per example. This cache
cuts the example list into blocks of `block` consecutive examples and keeps each block's features
as one safetensors file named by a hash of (what the features depend on, the block's examples):

- an extraction stopped at any moment (kill -9 included) loses at most the block in flight; the
  next call reuses every finished block (files are written to a temporary name, then renamed) and
  removes the temporary files killed processes left (`remove_stale_temps`: a block can weigh GBs);
- the data set grows by appending shards, so a longer list keeps its earlier blocks' keys: only the
  new examples (and the one partial block at the old end) are computed again.

`extract(examples)` returns a dict of tensors in one of three kinds, named by the caller:
- per row (concatenated across blocks): e.g. "hidden", "aux", "tokens";
- `example_fields`: per row, the index of its example within the block (shifted by the examples of
  the earlier blocks when joined);
- `offset_fields`: [E+1] row offsets of the block's examples (joined into one [N_examples+1] offset
  table over all rows).
Everything else is per example or per row and is concatenated as is.

A large per-row field can stay on disk (`join_blocks(on_disk=...)`, a `BlockRows`): its rows are read
from the memory-mapped block files when sliced, so a trainer's resident memory does not grow with the
data set (EAGLE-3's streams: ~0.75 GB per 1,000 answers in bf16).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtp.core.runtime.artifacts import ArtifactError, pid_alive, write_text_atomic

BLOCK = 256  # examples per cached file (~5 min of one core for SmolLM2-135M, 256-token answers)


def block_key(depends_on: str, examples) -> str:
    h = hashlib.sha256(f"{depends_on}:".encode())
    for ex in examples:
        h.update(json.dumps([list(ex.prompt_ids), list(ex.response_ids)]).encode())
    return h.hexdigest()[:16]


_TEMP = re.compile(r"^\..+\.tmp-(\d+)$")  # `.NAME.tmp-PID`: a block or index file being written by PID


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove the temporary files (`.NAME.tmp-PID`) of block or index writes whose process is gone
    (or is this one: no write of ours is in flight between blocks); returns them."""
    gone = []
    for p in Path(folder).iterdir():
        m = _TEMP.match(p.name)
        if m and p.is_file() and not p.is_symlink() and (int(m[1]) == os.getpid() or not pid_alive(int(m[1]))):
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def cached_blocks(
    folder: Path,
    depends_on: str,
    examples,
    extract: Callable,
    block: int = BLOCK,
    progress=None,
    metadata: dict | None = None,
) -> Path:
    """Compute (or reuse) every block's features under `folder`; returns the index file naming them.

    `progress(done, total)` counts examples over the whole list, cached blocks included."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder)
    files = []
    for start in range(0, len(examples), block):
        part = examples[start : start + block]
        path = folder / f"{block_key(depends_on, part)}.safetensors"
        if not path.exists():
            inner = (lambda i, n, _s=start: progress(_s + i, len(examples))) if progress else None
            feats = extract(part, progress=inner)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            save_file(
                {k: v.contiguous() for k, v in feats.items()},
                str(tmp),
                metadata={**(metadata or {}), "examples": str(len(part))},
            )
            tmp.replace(path)
        elif progress:
            progress(start + len(part), len(examples))
        files.append(path.name)
    index = folder / f"{block_key(depends_on + ':index', examples)}.json"
    if not index.exists():
        write_text_atomic(
            index, json.dumps({"depends_on": depends_on, "examples": len(examples), "blocks": files}, indent=1) + "\n"
        )
    return index


class BlockRows:
    """A per-row field of a block cache, left in its (memory-mapped) block files.

    Behaves like the joined [rows, ...] tensor for what trainers do with it: `shape`, `dtype`, `len`,
    and `rows[a:b]` (a new tensor of those rows, read from the files that hold them)."""

    def __init__(self, paths, key: str):
        self.key = key
        self._files = [safe_open(str(p), "pt") for p in paths]
        shapes = [f.get_slice(key).get_shape() for f in self._files]
        self._starts = [0]
        for s in shapes:
            self._starts.append(self._starts[-1] + s[0])
        self.shape = torch.Size([self._starts[-1], *shapes[0][1:]])
        self.dtype = self._files[0].get_slice(key)[0:0].dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("BlockRows reads contiguous row ranges only: rows[a:b]")
        a, b, _ = rows.indices(len(self))
        parts = []
        i = max(bisect.bisect_right(self._starts, a) - 1, 0)
        while a < b:
            end = min(b, self._starts[i + 1])
            parts.append(self._files[i].get_slice(self.key)[a - self._starts[i] : end - self._starts[i]])
            a, i = end, i + 1
        if not parts:
            return torch.empty((0, *self.shape[1:]), dtype=self.dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def join_blocks(index: Path, example_fields=(), offset_fields=(), dtypes: dict | None = None, on_disk=()) -> dict:
    """The blocks named by `index` as one dict (one allocation per tensor, filled block by block).

    `dtypes` converts a field while joining (e.g. {"agree": torch.bool}); the per-row fields named in
    `on_disk` are not loaded but returned as `BlockRows`, read when sliced."""
    index = Path(index)
    try:
        names = json.loads(index.read_text())["blocks"]
    except (OSError, ValueError, KeyError) as e:
        raise ArtifactError(f"{index}: not a feature-cache index ({e})") from None
    paths = [index.parent / n for n in names]
    shapes: dict[str, list] = {}
    for p in paths:
        if not p.exists():
            raise ArtifactError(f"{p}: a block named by {index.name} is missing; rerun to compute it again")
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                shapes.setdefault(k, []).append(f.get_slice(k).get_shape())
    missing = [k for k in on_disk if k not in shapes]
    if missing:
        raise ArtifactError(f"{index}: the blocks hold no field {missing[0]!r}")
    out: dict[str, torch.Tensor] = {}
    fill = {k: 0 for k in shapes}
    examples_before = rows_before = 0
    for p in paths:
        with safe_open(str(p), "pt") as f:
            n_examples = int(f.metadata()["examples"])
            block_rows = 0
            for k in f.keys():
                if k in on_disk:
                    continue
                t = f.get_tensor(k)
                if k in offset_fields:
                    block_rows = int(t[-1])
                    t = t[1:] + rows_before if fill[k] else t + rows_before
                elif k in example_fields:
                    t = t + examples_before
                if k not in out:
                    rows = sum(s[0] for s in shapes[k]) - (len(paths) - 1 if k in offset_fields else 0)
                    out[k] = torch.empty((rows, *t.shape[1:]), dtype=(dtypes or {}).get(k, t.dtype))
                out[k][fill[k] : fill[k] + len(t)] = t
                fill[k] += len(t)
        examples_before += n_examples
        rows_before += block_rows
    out.update({k: BlockRows(paths, k) for k in on_disk})
    return out
