"""The directories mtp writes and reads back: adapters, heads, checkpoints, converted models.

Guarantees:
- `atomic_dir` / `write_dir_atomic` build a directory under a temporary name and swap it into
  place, so a reader sees the old directory or the new one, never a half-written one. The work
  folders of a save (`.NAME.tmp-*`, `.NAME.old-*`, from `tempfile.mkdtemp`) hold a marker file
  (`MARKER`, with the saving process's id); the next save removes those a killed save left (and
  puts back a previous directory a kill left aside), and never touches a folder without the marker.
- Saved and loaded weights are finite (`check_finite`), and a float16 copy never overflows
  (`cast_checked`): a NaN or inf weight is refused, naming the file and the tensor.
- Nothing mtp did not write is ever replaced: an existing target must be empty or an mtp
  directory of the same kind (`replaceable`), else the save is refused before any work.
- No command writes into the package's shipped assets (`ASSETS`, `check_not_shipped`): the CLI
  refuses every output option pointing inside them before any work, and `cache_root` a
  `$MTP_CACHE_DIR` inside them. An output the command cannot write is refused before any work too
  (`check_writable`).
- `base_hash` fingerprints base weights, so an adapter or heads directory refuses to load on
  other weights (`check_trained_on`).
- `load_safetensors` / `read_json` name the file in the one-line error a corrupt file gives.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import safetensors.torch
import torch
from safetensors import SafetensorError


class ArtifactError(ValueError):
    """A file or directory that cannot be used as asked (one line, names the path)."""


CACHE_ENV = "MTP_CACHE_DIR"


def cache_root() -> Path:
    """Where mtp keeps what it derives once (converted models, built kernels): `$MTP_CACHE_DIR`, default
    `~/.cache/mtp`. A `$MTP_CACHE_DIR` inside the shipped assets is an ArtifactError (`check_not_shipped`)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        check_not_shipped(env, CACHE_ENV)
    return Path(env or Path.home() / ".cache" / "mtp")


ASSETS = Path(__file__).resolve().parents[2] / "assets"  # mtp/assets: what the package ships
MARKER = ".mtp-save-in-progress"  # in every work folder of a save; nothing else is ever removed
CONFIG = "config.json"  # an artifact directory's config (its `format`, sizes, the base weights' hash)


def _mark(folder: Path) -> None:
    (folder / MARKER).write_text(json.dumps({"pid": os.getpid()}))


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (another user's counts: it may not be signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _left_by_a_killed_save(folder: Path) -> bool:
    """`folder` is a work folder of an mtp save (marker file) whose process is gone (or is us). A kill
    between creating the folder and writing its marker leaves it without one (or with a partial one):
    then the PID its name carries (`work_folder`) says whose it was, and only an empty folder counts."""
    try:
        pid = json.loads((folder / MARKER).read_text()).get("pid")
    except (OSError, ValueError, AttributeError):
        named = re.fullmatch(r"\..+\.(?:tmp|old)-(\d+)-[^/]+", folder.name)
        if named is None or any(p.name != MARKER for p in folder.iterdir()):
            return False
        pid = int(named.group(1))
    return type(pid) is int and pid > 0 and (pid == os.getpid() or not pid_alive(pid))


def work_folder(path: Path, kind: str) -> Path:
    """A new marked work folder `.NAME.{kind}-PID-*` beside `path` (its name says whose it is from the
    moment it exists, before the marker inside is written)."""
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.{kind}-{os.getpid()}-", dir=path.parent))
    _mark(folder)
    return folder


def leftovers(path: Path, kind: str) -> list[Path]:
    """Work folders (`kind` "tmp" or "old") that interrupted mtp saves of `path` left beside it,
    newest first; a folder without mtp's marker, or of a save still running, is not listed."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    found = [
        p
        for p in path.parent.glob(f".{path.name}.{kind}-*")
        if p.is_dir() and not p.is_symlink() and _left_by_a_killed_save(p)
    ]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def recover_interrupted(path: Path) -> None:
    """After a kill inside `atomic_dir`: put the previous directory back if the kill came between
    the two renames (`path` missing), then remove the work folders interrupted saves left."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        for held in leftovers(path, "old"):
            if (held / path.name).is_dir():
                os.replace(held / path.name, path)
                break
    for folder in leftovers(path, "tmp") + leftovers(path, "old"):
        shutil.rmtree(folder, ignore_errors=True)


def first_nonfinite(tensors: dict) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an inf, else None."""
    for name, t in tensors.items():
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def check_finite(tensors: dict, where, action: str = "load") -> None:
    """Refuse weights holding NaN or inf: one line naming `where` (a file) and the tensor."""
    bad = first_nonfinite(tensors)
    if bad is not None:
        raise ArtifactError(f"{where}: tensor {bad} holds NaN or inf values; refusing to {action} it")


def cast_checked(tensors: dict, dtype: torch.dtype) -> dict:
    """Floating-point tensors cast to `dtype`; a finite value beyond its range (which would become
    inf) is refused, naming the tensor."""
    out = {}
    for name, t in tensors.items():
        if not t.is_floating_point():
            out[name] = t
            continue
        c = t.to(dtype)
        if not bool(torch.isfinite(c).all()):
            big = float(t.detach().abs().max())
            raise ArtifactError(
                f"tensor {name}: a value of magnitude {big:.3g} does not fit {dtype} "
                f"(largest {torch.finfo(dtype).max:.5g}); refusing a copy with inf in it"
            )
        out[name] = c
    return out


def check_not_shipped(path, flag: str) -> None:
    """Refuse an output `path` (given as option `flag`) that lies inside the shipped assets or is
    their folder, symlinks followed: the shipped adapter, heads, drafter, datastore and evaluation
    hashes are never replaced or added to by a command. A folder around them is not refused."""
    target, assets = Path(path).expanduser().resolve(), Path(ASSETS).resolve()
    if target == assets or assets in target.parents:
        shown = f"{path} ({target})" if str(target) != str(path) else str(path)
        raise ArtifactError(
            f"{flag} {shown} lies inside mtp's shipped assets ({assets}); they are never "
            "overwritten: choose an output path outside them"
        )


@contextlib.contextmanager
def exclusive_lock(lock_file: Path, waiting: str):
    """Hold an exclusive flock on `lock_file` (created if absent) for the block; the OS releases it when its
    holder dies, so a killed holder never blocks the next one. When another process holds it, the line
    `mtp: {waiting}` goes to stderr once and this one waits for it."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"mtp: {waiting}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_writable(path, flag: str) -> None:
    """Refuse, before any work, an output `path` (given as option `flag`) that cannot be written: the
    folder a save writes in (its nearest existing ancestor), and `path` itself when it is an existing
    folder, must take a new entry. Probed by creating and removing an empty folder there (read-only
    file systems, immutable folders and permissions alike); nothing is left behind."""
    path = Path(path).expanduser()
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    for folder in (parent, path) if path.is_dir() else (parent,):
        if not folder.is_dir():
            raise ArtifactError(f"{flag} {path}: {folder} is not a directory")
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".mtp-write-probe-", dir=folder))
        except OSError as e:
            raise ArtifactError(f"{flag} {path}: cannot write in {folder} ({e.strerror or e})") from None


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
        raise ArtifactError(
            f"{path} is not empty and not an mtp directory of this kind; refusing to "
            "overwrite it (choose another output path)"
        )


@contextlib.contextmanager
def atomic_dir(path: Path, kind: Callable[[Path], bool] | None = None):
    """Build a directory under a temp name (yielded), then swap it into place in two renames.

    A failure at any point leaves the previous directory (if any) untouched and no partial one; a
    kill between the two renames leaves the previous one in a marked `.NAME.old-*` folder, which the
    next save or `--resume` puts back (`recover_interrupted`).
    `kind`: see `replaceable` (None: only an absent or empty target may be replaced)."""
    path = Path(path)
    recover_interrupted(path)
    replaceable(path, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    work = work_folder(path, "tmp")
    try:
        new = work / path.name
        new.mkdir()
        yield new
        os.chmod(new, 0o755)
        for f in new.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        held = None
        if path.exists():
            held = work_folder(path, "old")
            os.replace(path, held / path.name)
        os.replace(new, path)
        if held is not None:
            shutil.rmtree(held)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_files(root: Path, files: dict) -> None:
    """Write `files` under `root`: a name ending in .safetensors maps to a dict of tensors, a
    name ending in / (or holding a dict of such names) to a sub-directory, anything else to JSON."""
    for name, content in files.items():
        if name.endswith("/"):
            (root / name).mkdir(parents=True, exist_ok=True)
            write_files(root / name, content)
        elif name.endswith(".safetensors"):
            check_finite(content, name, "save")
            safetensors.torch.save_file(
                {k: v.detach().contiguous().cpu() for k, v in content.items()}, str(root / name)
            )
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


def read_config(path, fmt: str, what: str) -> dict:
    """The config.json of directory `path`, an mtp artifact of format `fmt`; `what` names it in the
    errors (e.g. "heads"). A missing, unreadable or non-object file, or one of another format, is one
    ArtifactError naming it."""
    cfg_path = Path(path) / CONFIG
    if not cfg_path.is_file():
        raise ArtifactError(f"no {CONFIG} in {what} directory {path}")
    cfg = read_json(cfg_path, f"{what} config")
    if cfg.get("format") != fmt:
        raise ArtifactError(f"{cfg_path} is not an mtp {what} config")
    return cfg


def load_safetensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file; a truncated or corrupt file is one error naming it."""
    path = Path(path)
    try:
        return safetensors.torch.load_file(str(path), device=device)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically (temporary file beside it, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


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
        raise ArtifactError(
            f"{kind} {path} was trained on another base model (base weights hash "
            f"{cfg.get('base_hash')}, this model {have})"
        )
    if not (Path(path) / weights).exists():
        raise ArtifactError(f"no {weights} in {kind} directory {path}")


def file_digest(path: Path, chunk=1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()[:16]
