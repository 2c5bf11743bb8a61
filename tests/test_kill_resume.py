"""kill -9 in the middle of each trainer (`mtp train`, `mtp train-heads`, `mtp train-eagle3`), then
`--resume`: the final weights are bit for bit those of an uninterrupted run with the same seed and
steps (issue 47, "nothing lost, nothing silently wrong").

- a real SIGKILL of `python -m mtp.cli ...` once its first checkpoint is on disk, then `--resume`
  (in the test's process: a new model, trainer and feature-cache read);
- a kill inside a save, at the two places a kill leaves work folders behind (`artifacts.atomic_dir`):
  after the new directory is written but before any rename, and between the two renames (the
  previous directory then sits aside in a `.NAME.old-*` folder). Those windows last microseconds, so
  the kill is simulated in-process: `os.replace` raises at that moment and from then on nothing of
  the save is cleaned up, exactly as after SIGKILL. For `train-heads` / `train-eagle3` both the
  checkpoint's saves (`OUT/checkpoint`) and the final write of OUT itself are hit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_model_dir, random_examples, tiny_model, write_examples
from safetensors.torch import load_file

from mtp.cli import main

# the trainer, its arguments (tiny runs, one thread), the file of its final weights, and the file
# whose appearance says a checkpoint is on disk
TRAINERS = {
    "train": (
        ["--batch-size", "2", "--k-max", "3", "--spans", "1", "--seq-len", "32"],
        "adapter.safetensors",
        "trainer_state.json",
    ),
    "train-heads": (["--batch-size", "4"], "heads.safetensors", "checkpoint/trainer_state.json"),
    "train-eagle3": (
        ["--batch-size", "2", "--draft-vocab", "16"],
        "model.safetensors",
        "checkpoint/trainer_state.json",
    ),
}
# steps of the SIGKILL runs: about a second of training after the first checkpoint, so the kill lands
# mid-run (a checkpoint every step: the kill often lands inside a save)
KILL_STEPS = {"train": 25, "train-heads": 60, "train-eagle3": 35}
SMALL_STEPS = 4  # the in-process runs: saves at steps 2 and 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    model = make_tiny_model_dir(root / "tiny")
    ex = write_examples(root / "examples.jsonl", 12)
    return types.SimpleNamespace(root=root, model=model, examples=ex, reference={})


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def keep_threads():
    """The runs here use one thread (`--threads 1` sets this process's torch threads): put them back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def args_of(files, trainer, out, cache_dir, steps, save_every):
    extra, _, _ = TRAINERS[trainer]
    args = [
        trainer,
        "--model",
        files.model,
        "--examples",
        files.examples,
        *extra,
        "--steps",
        steps,
        "--save-every",
        save_every,
        "--seed",
        "5",
        "--threads",
        "1",
        "--out",
        out,
    ]
    if trainer != "train":
        args += ["--cache-dir", cache_dir]
    return [str(a) for a in args]


def weights(out: Path, trainer: str) -> dict:
    return load_file(str(Path(out) / TRAINERS[trainer][1]))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def reference(files, trainer, steps, save_every):
    """The uninterrupted run's final weights (in-process, one thread: what a subprocess computes)."""
    key = (trainer, steps, save_every)
    if key not in files.reference:
        out = files.root / f"ref-{trainer}-{steps}-{save_every}"
        assert main(args_of(files, trainer, out, files.root / f"cache-{trainer}-{steps}", steps, save_every)) == 0
        files.reference[key] = weights(out, trainer)
    return files.reference[key]


def env(tmp_path):
    return {**os.environ, "MTP_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}


# ---- a real SIGKILL at an arbitrary moment after the first checkpoint ----------------------------
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_sigkill_mid_run_then_resume_is_bit_for_bit(files, tmp_path, capsys, trainer):
    """SIGKILL once the first checkpoint is on disk (a checkpoint every step), `--resume`: the final
    weights equal the uninterrupted run's, and no work folder of the killed save is left."""
    steps = KILL_STEPS[trainer]
    out = tmp_path / "run"
    args = args_of(files, trainer, out, tmp_path / "feature-cache", steps, 1)  # its own feature cache
    state = out / TRAINERS[trainer][2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtp.cli", *args],
        env=env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill ({proc.returncode}): {err[-2000:]}"
    if trainer == "train":  # OUT is the checkpoint
        assert json.loads(state.read_text())["step"] < steps
    else:
        assert not (out / "config.json").exists()  # not finished
    code = main(args + ["--resume"])  # in this process: a fresh model, trainer and feature cache read
    assert code == 0, capsys.readouterr().err[-3000:]
    assert_same_weights(weights(out, trainer), reference(files, trainer, steps, 1))
    hidden = [p.name for p in [*out.parent.iterdir(), *out.iterdir()] if p.name.startswith(".")]
    assert not hidden, hidden  # the killed save's work folders are gone


# ---- a kill inside a save: after the files are written, between the two renames -------------------
class Killed(BaseException):
    """SIGKILL: nothing below the kill runs (no except, and `atomic_dir`'s cleanup is disabled)."""


def kill_inside_save(target: Path, where: str, nth: int):
    """Make the `nth` save of directory `target` die: where = "write" (its new directory written, no
    rename yet) or "rename" (the previous directory moved aside, the new one not yet in place).
    Returns a function that revives the process state (the cleanup `shutil.rmtree` works again)."""
    import mtp.core.runtime.artifacts as artifacts

    target = Path(target).resolve()
    real_replace, real_mkdtemp, real_rmtree = os.replace, tempfile.mkdtemp, artifacts.shutil.rmtree
    seen = {"saves": 0, "dead": False}

    def mkdtemp(*a, prefix=None, dir=None, **k):
        if prefix.startswith(f".{target.name}.tmp-") and dir is not None and Path(dir).resolve() == target.parent:
            seen["saves"] += 1
        return real_mkdtemp(*a, prefix=prefix, dir=dir, **k)

    def replace(src, dst):
        aside = Path(dst).parent.name.startswith(f".{target.name}.old-")
        if seen["saves"] == nth and not seen["dead"] and (aside or Path(dst).resolve() == target):
            if where == "rename" and aside:
                real_replace(src, dst)
            if where == "write" or aside:
                seen["dead"] = True
                raise Killed
        return real_replace(src, dst)

    def rmtree(path, *a, **k):
        if not seen["dead"]:
            real_rmtree(path, *a, **k)

    patch = pytest.MonkeyPatch()
    patch.setattr(tempfile, "mkdtemp", mkdtemp)
    patch.setattr(os, "replace", replace)
    patch.setattr(artifacts, "shutil", types.SimpleNamespace(rmtree=rmtree))
    return patch.undo


# (trainer, the saved directory hit, which of its saves): `train` saves OUT at steps 2 and 4 (the
# second replaces the first); heads/eagle3 save OUT/checkpoint at steps 2 and 4, then write OUT whole
WINDOWS = [pytest.param("train", "", 2, id="train-OUT-save2")] + [
    pytest.param(t, d, n, id=f"{t}-{d or 'OUT'}-save{n}")
    for t in ("train-heads", "train-eagle3")
    for d, n in (("checkpoint", 2), ("", 1))
]


@pytest.mark.parametrize("where", ["write", "rename"])
@pytest.mark.parametrize("trainer, sub, nth", WINDOWS)
def test_kill_inside_a_save_then_resume_is_bit_for_bit(files, tmp_path, capsys, trainer, sub, nth, where):
    """A kill inside a save leaves marked work folders (and, between the renames, the previous directory
    aside): `--resume` puts things back, continues, and ends bit for bit where an uninterrupted run ends."""
    out = tmp_path / "run"
    args = args_of(files, trainer, out, tmp_path / "feature-cache", SMALL_STEPS, 2)
    revive = kill_inside_save(out / sub if sub else out, where, nth)
    try:
        with pytest.raises(Killed):
            main(args)
    finally:
        revive()
    left = [p for p in [*tmp_path.iterdir(), *(out.iterdir() if out.is_dir() else [])] if p.name.startswith(".")]
    assert left, "the simulated kill left no work folder: it missed the save"
    code = main(args + ["--resume"])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert_same_weights(weights(out, trainer), reference(files, trainer, SMALL_STEPS, 2))
    hidden = [p.name for p in [*tmp_path.iterdir(), *out.iterdir()] if p.name.startswith(".")]
    assert not hidden, hidden


# ---- a kill inside the trunk-feature pass: the block in flight is lost, its temporary file too ----
def test_a_killed_feature_pass_leaves_no_temporary_file_and_resumes_to_the_same_features(tmp_path):
    from mtp.training import feature_cache
    from mtp.training import heads_train as H

    model, exs = tiny_model(0), random_examples(10)

    def extract(part, progress=None):
        return H.extract_features(model, part, 4, progress)

    clean = feature_cache.join_blocks(
        feature_cache.cached_blocks(tmp_path / "clean", "h", exs, extract, block=4), example_fields=("example",)
    )
    folder = tmp_path / "killed"
    feature_cache.cached_blocks(folder, "h", exs[:4], extract, block=4)  # the first block finished
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that is gone: SIGKILL hit it while it wrote the second block
    block = f"{feature_cache.block_key('h', exs[4:8])}.safetensors"
    stale = folder / f".{block}.tmp-{dead.pid}"
    stale.write_bytes(b"\x00" * 1000)  # half a safetensors file
    live = folder / f".{block}.tmp-1"  # a write still running (pid 1 is alive): left alone
    live.write_bytes(b"\x00")
    index = feature_cache.cached_blocks(folder, "h", exs, extract, block=4)
    assert not stale.exists() and live.exists()
    got = feature_cache.join_blocks(index, example_fields=("example",))
    assert got.keys() == clean.keys() and all(torch.equal(got[k], clean[k]) for k in got)
