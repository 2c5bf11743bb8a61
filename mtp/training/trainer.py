"""The one optimisation loop: both `mtp train` (mask-token distillation) and `mtp train-heads` run it.

A family (distillation, heads) brings its parameters, its loss for step s (`step_fn(s)`, a pure
function of the seed and s, so a resumed run sees exactly the batches an uninterrupted one
would), the files that make its checkpoint loadable on their own (`files_fn`), and the settings
that must match to resume. The trainer owns everything else, written once:
- the learning-rate schedule (`lr_at`: linear warm-up, cosine decay to a tenth of --lr);
- AdamW state in safetensors (`optimizer_tensors` / `load_optimizer_tensors`) and the RNG state;
- the checkpoint: a directory replaced atomically (`mtp.core.runtime.artifacts`) holding the family's
  files, `optimizer.safetensors` and `trainer_state.json` (step, settings, history, wall time),
  every `save_every` steps, at the end, and on Ctrl-C between steps;
- resume: refuse a checkpoint made with other settings, naming the setting; refuse to start over
  a checkpoint without --resume; recover a checkpoint a kill left aside (`artifacts.recover_interrupted`);
- divergence: weights with a NaN or inf after a step stop the run with one line naming the step and
  the tensor; such weights are never saved, so the last good checkpoint stays;
- progress: a rich bar on a terminal, else one line every `log_every` steps;
- several processes (DDP): rank 0 writes, the others wait at a barrier.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as torch_dist
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mtp.core.runtime.artifacts import (
    first_nonfinite,
    has_format,
    load_safetensors,
    read_json,
    recover_interrupted,
    replaceable,
    write_dir_atomic,
)

OPTIMIZER = "optimizer.safetensors"
STATE = "trainer_state.json"
CHECKPOINT = "checkpoint"  # sub-directory of a finished run's --out that holds the resumable trainer state
MAX_LR = 10.0  # a larger learning rate only ever diverges (and 1e38 overflows AdamW's update)


class DivergedError(ValueError):
    """Training produced NaN or inf weights (one line: the step, the tensor, the checkpoint kept)."""


def check_lr(lr) -> None:
    """--lr is a finite number in (0, MAX_LR]; every trainer checks it before any work."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and 0 < lr <= MAX_LR):
        raise ValueError(f"--lr must be a finite number in (0, {MAX_LR:g}], got {lr}")


def run_dir_kinds(fmt: str, weights: str) -> tuple[Callable[[Path], bool], Callable[[Path], bool]]:
    """The `kind` tests (`artifacts.replaceable`) of a trainer whose --out ends as `config.json` (format
    `fmt`) + `weights` and holds `CHECKPOINT/` while it runs: (is_out_dir, is_checkpoint_dir)."""

    def is_checkpoint(path: Path) -> bool:
        return {p.name for p in Path(path).iterdir()} <= {weights, OPTIMIZER, STATE}

    def is_out(path: Path) -> bool:
        names = {p.name for p in Path(path).iterdir()}
        if names == {CHECKPOINT}:
            return (Path(path) / CHECKPOINT).is_dir() and is_checkpoint(Path(path) / CHECKPOINT)
        return has_format(fmt, {"config.json", weights, CHECKPOINT})(path)

    return is_out, is_checkpoint


def recover_run_out(out: Path) -> None:
    """Undo what a kill (SIGKILL, power loss) inside a save left in a run's --out that holds
    `CHECKPOINT/` (`artifacts.recover_interrupted`, which touches only mtp's marked work folders of
    dead processes): a kill inside the final write of --out leaves it aside in `.OUT.old-*` (between
    the two renames) and a `.OUT.tmp-*` beside it; a kill inside a checkpoint save leaves
    `.checkpoint.tmp-*` / `.checkpoint.old-*` inside --out, which would make --out "not an mtp
    directory" to `replaceable`, and (between the renames) the previous checkpoint aside."""
    out = Path(out)
    recover_interrupted(out)
    if out.is_dir() and not out.is_symlink():
        recover_interrupted(out / CHECKPOINT)


def check_run_out(out: Path, kind: Callable[[Path], bool], what: str, resume: bool) -> None:
    """Before any work (a trunk-feature pass can take hours): --out is not a folder mtp did not write
    (`artifacts.replaceable` with the run's `kind`), and one that holds a finished run (config.json)
    or a checkpoint is continued only with --resume, and --resume finds a checkpoint to continue.
    What a killed save left is undone first (`recover_run_out`)."""
    recover_run_out(out)
    replaceable(out, kind)
    if not resume and ((out / "config.json").exists() or (out / CHECKPOINT).exists()):
        raise ValueError(f"{out} already holds {what}; pass --resume to continue or choose another --out")
    if resume:
        if not (out / CHECKPOINT / STATE).exists():
            raise ValueError(f"--resume: no checkpoint in {out / CHECKPOINT}; drop --resume to start a new run")


AMP_CHOICES = ("auto", "on", "off")


def use_bf16(choice: str, device) -> bool:
    """--amp: whether a trainer's forward runs under bf16 autocast (weights and optimizer stay fp32).
    auto = where bf16 matmuls are native: CUDA, or a CPU oneDNN runs bf16 on (AVX-512 BF16/AMX; an
    EPYC with AVX512-BF16 steps an EAGLE-3 drafter ~2.3x faster: benchmarks/results/train_amp/)."""
    if choice not in AMP_CHOICES:
        raise ValueError(f"--amp must be one of {', '.join(AMP_CHOICES)}, got {choice!r}")
    if choice != "auto":
        return choice == "on"
    if torch.device(device).type == "cuda":
        return True
    return torch.device(device).type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def accuracy_line(counted: str) -> Callable[[dict], str]:
    """A `Trainer.describe` for records {loss, acc: per depth, `counted`, step_s}: loss, the
    accuracies and `counted` per second, e.g. "loss 2.310 acc 0.61 0.40 5200 tokens/s"."""
    return lambda rec: (
        f"loss {rec['loss']:.3f} acc {' '.join(f'{a:.2f}' for a in rec['acc'])} "
        f"{rec[counted] / rec['step_s']:.0f} {counted}/s"
    )


def lr_at(step: int, lr: float, warmup: int, steps: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10 % of `lr` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def batch_indices(step: int, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1) -> list[int]:
    """The items of `step` for process `rank` of `world`: a stream of seeded epoch permutations of
    range(n), cut into global batches of batch_size * world, each process taking every world-th.
    A pure function of its arguments, so a resumed run sees exactly the batches an uninterrupted
    one would."""
    gb = batch_size * world
    positions = range(step * gb + rank, (step + 1) * gb, world)
    perms: dict[int, torch.Tensor] = {}
    out = []
    for i in positions:
        epoch, j = divmod(i, n)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        out.append(int(perms[epoch][j]))
    return out


def distributed() -> tuple[object | None, int, int]:
    """(torch.distributed or None, rank, world size) of this process."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist, torch_dist.get_rank(), torch_dist.get_world_size()
    return None, 0, 1


def optimizer_tensors(opt: torch.optim.Optimizer, params: list) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state by parameter index, and the CPU RNG state."""
    out = {"rng.cpu": torch.get_rng_state()}
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            out[f"{i}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return out


def load_optimizer_tensors(opt: torch.optim.Optimizer, params: list, tensors: dict[str, torch.Tensor]) -> None:
    for i, p in enumerate(params):
        state = {
            k.split(".", 1)[1]: v.to(p.device) if k.split(".", 1)[1] != "step" else v
            for k, v in tensors.items()
            if k.split(".", 1)[0] == str(i)
        }
        if state:
            opt.state[p] = state
    if "rng.cpu" in tensors:
        torch.set_rng_state(tensors["rng.cpu"])


@dataclass
class TrainerConfig:
    steps: int
    lr: float
    warmup: int
    save_every: int
    log_every: int = 10
    clip_norm: float | None = None  # clip the gradient's global norm (None: no clipping)
    what: str = "training run"  # named in messages ("OUT already holds a training run")

    def __post_init__(self):
        check_lr(self.lr)


@dataclass
class Trainer:
    """Run `config.steps` optimizer steps of `step_fn` over `params` with `opt`, checkpointed in `ckpt`.

    step_fn(step) -> (loss, record): the loss to minimise at `step` and a dict of numbers to log.
    files_fn() -> {name: content}: the family's own files of a checkpoint (`write_files` format).
    load_fn(tensors_by_file): restore the family's tensors from a checkpoint being resumed.
    settings: what must match when resuming (`resume_keys` of them are checked).
    kind(path): recognises a checkpoint directory this trainer may replace (`artifacts.replaceable`).
    describe(record) -> str: one log line's text after "step N/M".
    on_step(step): called after every completed step (tests interrupt runs with it)."""

    config: TrainerConfig
    params: list
    opt: torch.optim.Optimizer
    ckpt: Path
    step_fn: Callable[[int], tuple[torch.Tensor, dict]]
    files_fn: Callable[[], dict]
    load_fn: Callable[[Path], None]
    settings: dict
    resume_keys: tuple
    kind: Callable[[Path], bool]
    describe: Callable[[dict], str] = lambda rec: f"loss {rec['loss']:.4f}"
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)
    progress: bool = False
    state: dict = field(default_factory=lambda: {"step": 0, "history": [], "wall_s": 0.0})

    # ---- starting and resuming -----------------------------------------------------------------
    def start(self, resume: bool) -> int:
        """Check the checkpoint directory (and load it when resuming); return the first step."""
        ckpt = self.ckpt
        recover_interrupted(ckpt)  # a save a kill interrupted: its work folders, the previous checkpoint
        if resume:
            if not (ckpt / STATE).exists():
                raise ValueError(f"--resume: no checkpoint in {ckpt}; drop --resume to start a new run")
            state = read_json(ckpt / STATE, "trainer state")
            for k in self.resume_keys:
                was, now = state.get("settings", {}).get(k), self.settings.get(k)
                if was != now:
                    raise ValueError(
                        f"--resume: {k} was {was!r} in {ckpt}, now {now!r} (the checkpoint was made "
                        f"with other --{k.replace('_', '-')})"
                    )
            self.state = state
            self.load_fn(ckpt)
            load_optimizer_tensors(self.opt, self.params, load_safetensors(ckpt / OPTIMIZER))
        elif (ckpt / STATE).exists():
            raise ValueError(
                f"{ckpt.parent if ckpt.name == 'checkpoint' else ckpt} already holds a "
                f"{self.config.what}: pass --resume or another --out"
            )
        return self.state["step"]

    def diverged(self, step: int, name: str) -> DivergedError:
        saved = read_json(self.ckpt / STATE, "trainer state").get("step") if (self.ckpt / STATE).exists() else None
        kept = f"the last good checkpoint (step {saved}) in {self.ckpt} is kept" if saved else "nothing was saved"
        return DivergedError(f"step {step}: {name} holds NaN or inf (training diverged; try a lower --lr); {kept}")

    def check_finite(self, step: int) -> None:
        """Stop at the first step whose weights hold a NaN or inf, naming the tensor."""
        if bool(torch.stack([torch.isfinite(p).all() for p in self.params]).all()):
            return
        names = {
            t.data_ptr(): n
            for content in self.files_fn().values()
            if isinstance(content, dict)
            for n, t in content.items()
            if torch.is_tensor(t)
        }  # the saved names share the storage
        bad = next(i for i, p in enumerate(self.params) if not bool(torch.isfinite(p).all()))
        raise self.diverged(step, f"tensor {names.get(self.params[bad].data_ptr(), f'parameter {bad}')}")

    def save(self, step: int) -> None:
        dist, rank, _ = distributed()
        if rank == 0:
            self.state.update(step=step, settings=self.settings)
            files = dict(self.files_fn())
            files[OPTIMIZER] = optimizer_tensors(self.opt, self.params)
            for fname, content in files.items():  # never replace a good checkpoint with NaN or inf
                bad = first_nonfinite(content) if fname.endswith(".safetensors") else None
                if bad is not None:
                    raise self.diverged(step, f"{fname} tensor {bad}")
            files[STATE] = self.state
            write_dir_atomic(self.ckpt, files, kind=self.kind)
        if dist is not None:
            dist.barrier()

    # ---- the loop ------------------------------------------------------------------------------
    def train_module(
        self,
        module: torch.nn.Module,
        resume: bool,
        on_step: Callable[[int], None] | None,
        held_out: Callable[[], dict],
        counts: dict,
    ) -> dict:
        """`run` with `module` in training mode; then, in eval mode, its held-out metrics (`held_out()`)
        with `counts` and the seconds all of it took (`train_s`), logged and returned."""
        t0 = time.perf_counter()
        module.train()
        self.run(resume, on_step)
        module.eval()
        metrics = held_out()
        metrics.update({**counts, "train_s": round(time.perf_counter() - t0, 1)})
        self.log("held-out: " + json.dumps(metrics))
        return metrics

    def run(self, resume: bool = False, on_step: Callable[[int], None] | None = None) -> dict:
        """Train from the checkpoint's step (or 0) to `config.steps`; return the trainer state."""
        cfg = self.config
        step = self.start(resume)
        _, rank, _ = distributed()
        bar = _Bar(cfg.steps, step) if self.progress and rank == 0 else None
        stepping = False
        try:
            while step < cfg.steps:
                t0 = time.perf_counter()
                lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps)
                for g in self.opt.param_groups:
                    g["lr"] = lr
                loss, rec = self.step_fn(step)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.params, cfg.clip_norm)
                stepping = True
                self.opt.step()
                step += 1
                stepping = False
                self.check_finite(step)
                dt = time.perf_counter() - t0
                self.state["wall_s"] += dt
                rec = {"step": step, "loss": round(float(loss.detach()), 5), "lr": lr, **rec, "step_s": round(dt, 4)}
                if step % cfg.log_every == 0 or step == cfg.steps:
                    self.state["history"].append(rec)
                    if bar is None and rank == 0:
                        self.log(f"step {step}/{cfg.steps} {self.describe(rec)} lr {lr:.2e} {dt:.2f} s/step")
                if bar is not None:
                    bar.update(step, self.describe(rec))
                if step % cfg.save_every == 0 or step == cfg.steps:
                    self.save(step)
                if on_step is not None:
                    on_step(step)
        except KeyboardInterrupt:
            dist, _, _ = distributed()
            if not stepping and step > 0 and dist is None:  # weights are consistent after `step` steps
                self.save(step)
            self.log(f"interrupted after step {step}: checkpoint in {self.ckpt}; rerun with --resume")
            raise
        finally:
            if bar is not None:
                bar.close()
        return self.state


class _Bar:
    """A rich progress bar with the latest record's line."""

    def __init__(self, total: int, start: int):
        self.p = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            transient=False,
        )
        self.task = self.p.add_task("train", total=total, completed=start, info="")
        self.p.start()

    def update(self, step: int, info: str) -> None:
        self.p.update(self.task, completed=step, info=info)

    def close(self) -> None:
        self.p.stop()
