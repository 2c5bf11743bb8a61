"""The directories mtp writes and reads back: adapters, heads, checkpoints, converted models.

Guarantees:
- `atomic_dir` / `write_dir_atomic` build a directory under a temporary name and swap it into
  place, so a reader sees the old directory or the new one, never a half-written one; temporary
  folders a killed earlier save left beside the target are removed on the next save.
- Nothing mtp did not write is ever replaced: an existing target must be empty or an mtp
  directory of the same kind (`replaceable`), else the save is refused before any work.
- `base_hash` fingerprints base weights, so an adapter or heads directory refuses to load on
  other weights (`check_trained_on`).
- `load_safetensors` / `read_json` name the file in the one-line error a corrupt file gives.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
import safetensors.torch
from safetensors import SafetensorError


class ArtifactError(ValueError):
    """A file or directory that cannot be used as asked (one line, names the path)."""


def stale_temps(path: Path) -> list[Path]:
    """Temporary folders of earlier, interrupted saves of `path` (`.NAME.tmp-*` beside it)."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    return [p for p in path.parent.glob(f".{path.name}.tmp-*") if p.is_dir()]


def replaceable(path: Path, kind: Callable[[Path], bool] | None) -> None:
    """Refuse to overwrite `path` unless it is absent, an empty directory, or a directory that
    `kind(path)` recognises as one mtp wrote for the same purpose."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir() or path.is_symlink():
        raise ArtifactError(f"{path} exists and is not a directory; choose another output path")
    if not any(path.iterdir()):
        return
    if kind is None or not kind(path):
        raise ArtifactError(f"{path} is not empty and not an mtp directory of this kind; refusing to "
                            "overwrite it (choose another output path)")


@contextlib.contextmanager
def atomic_dir(path: Path, kind: Callable[[Path], bool] | None = None):
    """Build a directory under a temp name (yielded), then swap it into place in two renames.

    A failure at any point leaves the previous directory (if any) untouched and no partial one;
    a kill between the two renames leaves the previous one at `.NAME.old` (training resumes it).
    `kind`: see `replaceable` (None: only an absent or empty target may be replaced)."""
    path = Path(path)
    replaceable(path, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in stale_temps(path):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    old = path.parent / f".{path.name}.old"
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        for f in tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old.exists():
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_files(root: Path, files: dict) -> None:
    """Write `files` under `root`: a name ending in .safetensors maps to a dict of tensors, a
    name ending in / (or holding a dict of such names) to a sub-directory, anything else to JSON."""
    for name, content in files.items():
        if name.endswith("/"):
            (root / name).mkdir(parents=True, exist_ok=True)
            write_files(root / name, content)
        elif name.endswith(".safetensors"):
            safetensors.torch.save_file({k: v.detach().contiguous().cpu() for k, v in content.items()},
                                        str(root / name))
        else:
            (root / name).write_text(json.dumps(content, indent=1))


def write_dir_atomic(path: Path, files: dict, kind: Callable[[Path], bool] | None = None) -> None:
    """Write a directory all at once (`atomic_dir`); `files` as in `write_files`."""
    with atomic_dir(path, kind) as tmp:
        write_files(tmp, files)


def has_format(fmt: str, allowed: set[str]) -> Callable[[Path], bool]:
    """A `kind` test: config.json says `"format": fmt` and every entry's name is in `allowed`."""
    def test(path: Path) -> bool:
        names = {p.name for p in Path(path).iterdir()}
        if not names <= allowed:
            return False
        try:
            cfg = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(cfg, dict) and cfg.get("format") == fmt
    return test


def read_json(path: Path, what: str = "config") -> dict:
    """A JSON object from `path`; a missing, unreadable or non-object file is one named error."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such {what} file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: not a valid JSON {what} ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: the {what} must be a JSON object, got {type(data).__name__}")
    return data


def load_safetensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file; a truncated or corrupt file is one error naming it."""
    path = Path(path)
    try:
        return safetensors.torch.load_file(str(path), device=device)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def base_hash(model) -> str:
    """Fingerprint of the base weights (before any adapter): names, shapes and a strided sample of
    every tensor. Cheap (well under a second for 135M parameters) and enough to tell models apart."""
    cached = getattr(model, "base_weights_hash", None)
    if cached:
        return cached
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = flat[::step][:4096].float().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def check_trained_on(model, cfg: dict, path: Path, kind: str, weights: str) -> None:
    """Refuse a saved adapter/heads directory made for other base weights, or missing its weights."""
    have = base_hash(model)
    if cfg.get("base_hash") != have:
        raise ArtifactError(f"{kind} {path} was trained on another base model (base weights hash "
                            f"{cfg.get('base_hash')}, this model {have})")
    if not (Path(path) / weights).exists():
        raise ArtifactError(f"no {weights} in {kind} directory {path}")


def file_digest(path: Path, chunk=1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()[:16]
