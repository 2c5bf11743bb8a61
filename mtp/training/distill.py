"""`mtp train`: turn a next-token model into a multi-token predictor by online self-distillation.

Student-forced distillation with a hard teacher (Kirchenbauer et al., arXiv 2602.06019; PAPER.md B):
  1. each training sequence (prompt + response, ground truth) gets several mask spans: span s sits
     after prefix position p_s and predicts k_s tokens (k_s ~ U[2, k_max]): the model's own
     prediction at p_s, then one per `<mtp_mask>` token (k_s - 1 masks);
  2. one student pass over the sequence with every span appended (layout: `build_layout`) gives the
     student's proposal y' = argmax at each predicting position;
  3. one teacher pass (frozen base: `model.base_only()`) over the same layout with each span's masks
     replaced by the student's proposals gives P_T(. | x + y'_<j) at every depth j (chain rule);
  4. loss at depth j: cross-entropy of the student against the teacher's argmax (hard), or its
     whole distribution (soft), weighted by the teacher's probability of the proposal prefix
     prod_{i<j} P_T(y'_i | x + y'_<i); `ground-truth` instead uses the data's tokens, unweighted.
Checkpoints (adapter + AdamW state in safetensors, step and settings in JSON) are written
atomically into --out every --save-every steps; `--resume` continues bit for bit, because every
step's batch and span layout are a pure function of (seed, step).
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from mtp.core.adapter import (MODES, TARGETS, WEIGHTS, adapter_files, add_adapters, load_trainable,
                      write_dir_atomic)
from mtp.training.data import Example

OPTIMIZER = "optimizer.safetensors"
STATE = "trainer_state.json"
TEACHERS = ("hard", "soft", "ground-truth")
# settings that must match when resuming (they shape the model, the data or the optimisation)
RESUME_KEYS = ("mode", "rank", "alpha", "targets", "seed", "teacher", "k_max", "spans", "seq_len", "batch_size",
               "lr", "warmup", "n_examples", "world")


@dataclass
class TrainConfig:
    out: str
    steps: int = 200
    batch_size: int = 8  # sequences per step per process
    lr: float = 5e-4
    warmup: int = 10
    mode: str = "gated"
    rank: int = 16
    alpha: float = 32.0
    targets: tuple = TARGETS
    k_max: int = 16
    spans: int = 5
    seq_len: int = 512
    teacher: str = "hard"
    save_every: int = 50
    seed: int = 0
    resume: bool = False
    device: str = "cpu"
    log_every: int = 10
    full_layout: bool = False  # gated: one pass over the whole layout instead of the split forward
    export: str | None = None  # also write a float16 adapter-only copy here at the end
    meta: dict = field(default_factory=dict)  # data provenance, written into the adapter config


@dataclass
class Span:
    p: int  # last ground-truth position the span conditions on (its prefix is tokens[0..p])
    k: int  # tokens it predicts: the model's own at p, then one per mask (k - 1 masks)


def build_layout(n_tokens: int, spans: list[Span]):
    """Rows, positions and attention for one training sequence with mask spans appended.

    Rows 0..N-1 are the ground truth; then each span's k-1 masks. Mask j (1-based) of a span after
    prefix position p sits at RoPE position p + j, sees tokens 0..p and masks 1..j of its own span;
    ground-truth rows are plainly causal and never see a mask. E.g. N=4, one span p=1, k=3:
        rows  t0 t1 t2 t3 m1 m2     positions 0 1 2 3 2 3
        m1 sees t0 t1 m1; m2 sees t0 t1 m1 m2.
    Returns (positions [T], attn [T, T] bool, pred_rows [L], depth [L], span_of [L], feeds [L]):
    pred_rows are the rows predicting depths 1..k of each span (p, then its masks), and feeds[l] is
    the mask row where the proposal at l is fed to the teacher (-1 for a span's last depth)."""
    T = n_tokens + sum(s.k - 1 for s in spans)
    attn = torch.zeros(T, T, dtype=torch.bool)
    attn[:n_tokens, :n_tokens] = torch.ones(n_tokens, n_tokens, dtype=torch.bool).tril()
    positions = torch.empty(T, dtype=torch.long)
    positions[:n_tokens] = torch.arange(n_tokens)
    pred_rows, depth, span_of, feeds = [], [], [], []
    row = n_tokens
    for si, s in enumerate(spans):
        if not (0 <= s.p and s.k >= 2):
            raise ValueError(f"bad span {s}")
        first = row
        for j in range(1, s.k):
            attn[row, : s.p + 1] = True
            attn[row, first: row + 1] = True
            positions[row] = s.p + j
            row += 1
        rows = [s.p] + list(range(first, first + s.k - 1))
        pred_rows += rows
        depth += list(range(1, s.k + 1))
        span_of += [si] * s.k
        feeds += list(range(first, first + s.k - 1)) + [-1]
    return (positions, attn, torch.tensor(pred_rows), torch.tensor(depth), torch.tensor(span_of),
            torch.tensor(feeds))


def sample_spans(prompt_len: int, n_tokens: int, n_spans: int, k_max: int, gen: torch.Generator) -> list[Span]:
    """Random spans inside the response: p in [prompt_len-1, N-3], k ~ U[2, k_max] cut to fit N."""
    lo, hi = prompt_len - 1, n_tokens - 3
    spans = []
    for _ in range(n_spans):
        p = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        k = int(torch.randint(2, k_max + 1, (1,), generator=gen))
        spans.append(Span(p, min(k, n_tokens - 1 - p)))
    return spans


@dataclass
class Batch:
    """A padded batch of laid-out sequences. Columns 0..n_gt-1 hold the ground truth (padded to the
    longest), columns n_gt.. the mask spans (padded likewise), so the ground truth can also run as a
    pass of its own (`split` forward)."""
    tokens: torch.Tensor  # [B, T] ground truth + masks (pad 0), T = n_gt + max masks
    positions: torch.Tensor  # [B, T]
    attn: torch.Tensor  # [B, T, T] bool
    out_index: torch.Tensor  # [B, L] predicting rows
    valid: torch.Tensor  # [B, L] bool
    depth: torch.Tensor  # [B, L] 1..k (0 = pad)
    span_start: torch.Tensor  # [B, L] index in L of the entry's span's depth-1 entry
    feeds: torch.Tensor  # [B, L] mask row fed with the proposal at l (-1: none)
    gt_target: torch.Tensor  # [B, L] ground-truth token at depth d (p + d)
    n_gt: int  # columns of ground truth
    n_tokens: int  # real (non-pad) rows


def make_batch(examples: list[Example], mask_id: int, n_spans: int, k_max: int, seq_len: int,
               gen: torch.Generator) -> Batch:
    parts = []
    for ex in examples:
        ids = (ex.prompt_ids + ex.response_ids)[:seq_len]
        spans = sample_spans(len(ex.prompt_ids), len(ids), n_spans, k_max, gen)
        pos, attn, rows, depth, span_of, feeds = build_layout(len(ids), spans)
        starts = torch.tensor([span_of.tolist().index(s) for s in span_of.tolist()])
        gt_pos = torch.tensor([spans[s].p + d for s, d in zip(span_of.tolist(), depth.tolist())])
        parts.append((ids, pos, attn, rows, depth, starts, feeds, torch.tensor(ids)[gt_pos]))
    B = len(parts)
    G = max(len(p[0]) for p in parts)  # ground-truth columns
    M = max(len(p[1]) - len(p[0]) for p in parts)  # mask columns
    T, L = G + M, max(len(p[3]) for p in parts)
    tokens = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    attn = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)  # pad rows see themselves (no empty softmax)
    out_index = torch.zeros(B, L, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    depth = torch.zeros(B, L, dtype=torch.long)
    span_start = torch.zeros(B, L, dtype=torch.long)
    feeds = torch.full((B, L), -1, dtype=torch.long)
    gt_target = torch.zeros(B, L, dtype=torch.long)
    for b, (ids, p, a, r, d, st, fd, gt) in enumerate(parts):
        n, m, nl = len(ids), len(p) - len(ids), len(r)
        # layout row i -> batch column: ground truth stays, masks move to G..G+m-1
        col = torch.cat([torch.arange(n), G + torch.arange(m)])
        tokens[b, :n] = torch.tensor(ids)
        tokens[b, G:G + m] = mask_id
        positions[b, col] = p
        attn[b, col.view(-1, 1), col.view(1, -1)] = a
        out_index[b, :nl], valid[b, :nl], depth[b, :nl] = col[r], True, d
        span_start[b, :nl], gt_target[b, :nl] = st, gt
        feeds[b, :nl] = torch.where(fd >= 0, col[fd.clamp_min(0)], fd)
    return Batch(tokens, positions, attn, out_index, valid, depth, span_start, feeds, gt_target, G,
                 sum(len(p[1]) for p in parts))


class PrefixKV:
    """Stands in for a KV cache in training: the ground-truth pass records every layer's keys and
    values; mask-block passes then attend over [those; their own] (their attn_mask says which)."""

    def __init__(self):
        self.k: list[torch.Tensor] = []  # per layer [B, kv_heads, n_gt, head_dim]
        self.v: list[torch.Tensor] = []
        self.extend = False

    def writer(self, layer: int, positions, slots):
        def write(k, v):
            if not self.extend:
                self.k.append(k)
                self.v.append(v)
                return k, v
            return torch.cat([self.k[layer], k], 2), torch.cat([self.v[layer], v], 2)
        return write


def teacher_tokens(batch: Batch, proposals: torch.Tensor) -> torch.Tensor:
    """The layout with every mask replaced by the student's proposal it stands for: [B, T]."""
    t = batch.tokens.clone()
    rows = batch.feeds >= 0
    t[torch.nonzero(rows)[:, 0], batch.feeds[rows]] = proposals.cpu()[rows]
    return t


def forward_pair(student, model, teacher_model, batch: Batch, teacher: str, split: bool, amp: bool):
    """Student logits [B, L, V] (with grad), its proposals [B, L], teacher logits [B, L, V] or None.

    split (gated adapters only): the ground truth runs once without grad as the frozen base (its
    rows are base-model rows for student and teacher alike), recording keys/values; then the
    student's mask block and the teacher's proposal block each attend over that prefix. The
    backward pass then only covers the mask rows. Same numbers as the one-pass layout."""
    dev = model.device
    mask_id = model.config.mask_token_id
    tokens, positions, attn = batch.tokens.to(dev), batch.positions.to(dev), batch.attn.to(dev)
    out_index, depth = batch.out_index.to(dev), batch.depth.to(dev)
    ac = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp)
    G = batch.n_gt
    if split:
        d1 = (depth == 1).unsqueeze(-1)  # [B, L, 1]: depth-1 rows are ground-truth rows
        idx_a = torch.where(depth == 1, out_index, 0)
        idx_b = torch.where(depth == 1, 0, out_index - G).clamp_min(0)
        kv = PrefixKV()
        with torch.no_grad(), model.base_only(), ac:
            logits_a = model(tokens[:, :G], positions[:, :G], cache=kv, attn_mask=attn[:, :G, :G],
                             out_index=idx_a).float()
        kv.extend = True
        with ac:
            logits_b = student(tokens[:, G:], positions[:, G:], cache=kv, attn_mask=attn[:, G:],
                               out_index=idx_b).float()
        s_logits = torch.where(d1, logits_a, logits_b)
    else:
        with ac:
            s_logits = student(tokens, positions, attn_mask=attn, out_index=out_index).float()  # [B, L, V]
    s_logits[..., mask_id] = float("-inf")  # the mask is never a prediction
    proposals = s_logits.detach().argmax(-1)  # [B, L]
    if teacher == "ground-truth":
        return s_logits, proposals, None
    t_tok = teacher_tokens(batch, proposals).to(dev)
    with torch.no_grad(), ac:
        if split:
            with model.base_only():
                logits_c = model(t_tok[:, G:], positions[:, G:], cache=kv, attn_mask=attn[:, G:],
                                 out_index=idx_b).float()
            t_logits = torch.where(d1, logits_a, logits_c)
        elif teacher_model is not None:
            t_logits = teacher_model(t_tok, positions, attn_mask=attn, out_index=out_index).float()
        else:
            with model.base_only():
                t_logits = model(t_tok, positions, attn_mask=attn, out_index=out_index).float()
    t_logits[..., mask_id] = float("-inf")
    return s_logits, proposals, t_logits


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, batch: Batch, teacher: str,
                 proposals: torch.Tensor):
    """Loss and per-entry agreement. student/teacher logits: [B, L, V] (mask column already -inf);
    proposals: [B, L] the student's argmax."""
    logp = F.log_softmax(student_logits.float(), -1)  # [B, L, V]
    valid = batch.valid
    if teacher == "ground-truth":
        target = batch.gt_target
        ce = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [B, L]
        weight = torch.ones_like(ce)
    else:
        q = F.softmax(teacher_logits.float(), -1)  # [B, L, V]
        target = q.argmax(-1)  # [B, L]
        if teacher == "hard":
            ce = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        else:
            ce = -(q * logp.clamp_min(-1e4)).sum(-1)
        # weight at depth d: prod_{i<d} P_T(y'_i | x + y'_<i), within each span (exclusive cumprod)
        logq = q.gather(-1, proposals.unsqueeze(-1)).squeeze(-1).clamp_min(1e-30).log()  # [B, L]
        logq = torch.where(valid, logq, torch.zeros_like(logq))
        excl = logq.cumsum(1) - logq  # [B, L]
        weight = (excl - excl.gather(1, batch.span_start)).exp()
    n = valid.sum().clamp_min(1)
    loss = (weight * ce * valid).sum() / n
    agree = (proposals == target) & valid  # [B, L]
    return loss, agree


def agreement_by_depth(agree: torch.Tensor, batch: Batch, k_max: int) -> list[float | None]:
    out = []
    for d in range(1, k_max + 1):
        sel = batch.valid & (batch.depth == d)
        out.append(float(agree[sel].float().mean()) if bool(sel.any()) else None)
    return out


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10 % of --lr at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def batch_indices(step: int, n: int, batch_size: int, seed: int, rank: int, world: int) -> list[int]:
    """The examples of `step` for this process: a stream of seeded epoch permutations, cut in steps."""
    gb = batch_size * world
    out = []
    for i in range(step * gb + rank, (step + 1) * gb, world):
        epoch, j = divmod(i, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        out.append(int(perm[j]))
    return out


def _dist():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


def optimizer_tensors(opt: torch.optim.Optimizer, params: list) -> dict[str, torch.Tensor]:
    out = {"rng.cpu": torch.get_rng_state()}
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            out[f"{i}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return out


def load_optimizer_tensors(opt: torch.optim.Optimizer, params: list, tensors: dict[str, torch.Tensor]) -> None:
    for i, p in enumerate(params):
        state = {k.split(".", 1)[1]: v.to(p.device) if k.split(".", 1)[1] != "step" else v
                 for k, v in tensors.items() if k.split(".", 1)[0] == str(i)}
        if state:
            opt.state[p] = state
    if "rng.cpu" in tensors:
        torch.set_rng_state(tensors["rng.cpu"])


def prepare_examples(examples: list[Example], seq_len: int) -> list[Example]:
    """Keep examples with a prompt that fits --seq-len and at least 2 response tokens inside it."""
    kept = [ex for ex in examples if len(ex.prompt_ids) + 2 <= seq_len and len(ex.response_ids) >= 2]
    if not kept:
        raise ValueError(f"no example fits --seq-len {seq_len} (prompt + at least 2 response tokens)")
    return kept


def train(cfg: TrainConfig, model, examples: list[Example], n_used_tokens: int | None = None,
          progress: bool | None = None, _kill_after: int | None = None) -> dict:
    """Train (or resume) in place on `model` (a base Transformer); return the final trainer state."""
    if cfg.teacher not in TEACHERS:
        raise ValueError(f"unknown --teacher {cfg.teacher!r}; choose from {', '.join(TEACHERS)}")
    if cfg.mode not in MODES:
        raise ValueError(f"unknown --mode {cfg.mode!r}; choose from {', '.join(MODES)}")
    if cfg.k_max < 2:
        raise ValueError("--k-max must be >= 2")
    if cfg.spans < 1 or cfg.batch_size < 1 or cfg.steps < 1:
        raise ValueError("--spans, --batch-size and --steps must be >= 1")
    if cfg.seq_len > model.config.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's context window {model.config.max_seq_len}")
    dist, rank, world = _dist()
    out = Path(cfg.out)
    examples = prepare_examples(examples, cfg.seq_len)
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
    settings["n_examples"] = len(examples)
    settings["world"] = world
    state = {"step": 0, "history": [], "wall_s": 0.0}
    if cfg.resume:
        old = out.parent / f".{out.name}.old"  # killed between write_dir_atomic's two renames
        if not out.exists() and (old / STATE).exists():
            os.replace(old, out)
        if not (out / STATE).exists():
            raise ValueError(f"--resume: no checkpoint in {out}")
        state = json.loads((out / STATE).read_text())
        for k in RESUME_KEYS:
            if state["settings"].get(k) != settings.get(k):
                raise ValueError(f"--resume: {k} was {state['settings'].get(k)!r} in {out}, now {settings.get(k)!r}")
    elif (out / STATE).exists():
        raise ValueError(f"{out} already holds a training run: pass --resume or another --out")

    torch.manual_seed(cfg.seed)
    params = add_adapters(model, cfg.rank, cfg.alpha, tuple(cfg.targets), cfg.mode, n_used_tokens)
    mask_id = model.config.mask_token_id
    teacher_model = copy.deepcopy(model).requires_grad_(False) if cfg.mode == "full" else None
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.999), weight_decay=0.0)
    if cfg.resume:
        from safetensors.torch import load_file
        load_trainable(model, load_file(str(out / WEIGHTS)))
        load_optimizer_tensors(opt, params, load_file(str(out / OPTIMIZER)))
    model.train()
    student = model
    if dist is not None:
        from torch.nn.parallel import DistributedDataParallel
        student = DistributedDataParallel(model, device_ids=None if cfg.device == "cpu" else [model.device])
    dev = model.device
    use_amp = dev.type == "cuda"
    split = cfg.mode == "gated" and not cfg.full_layout
    if progress is None:
        progress = sys.stderr.isatty() and rank == 0
    bar = _Progress(cfg, state["step"]) if progress else None

    def checkpoint(step: int):
        if rank == 0:
            state.update(step=step, settings=settings)
            meta = {"step": step, "training": settings, "wall_s": round(state["wall_s"], 1)}
            files = adapter_files(model, meta)
            files[OPTIMIZER] = optimizer_tensors(opt, params)
            files[STATE] = state
            write_dir_atomic(out, files)
        if dist is not None:
            dist.barrier()

    step = state["step"]
    try:
        while step < cfg.steps:
            t0 = time.perf_counter()
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + rank)
            idx = batch_indices(step, len(examples), cfg.batch_size, cfg.seed, rank, world)
            batch = make_batch([examples[i] for i in idx], mask_id, cfg.spans, cfg.k_max, cfg.seq_len, gen)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            s_logits, proposals, t_logits = forward_pair(student, model, teacher_model, batch, cfg.teacher,
                                                         split, use_amp)
            loss, agree = distill_loss(s_logits, t_logits, _to(batch, dev), cfg.teacher, proposals)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            state["wall_s"] += dt
            agree_d = agreement_by_depth(agree.cpu(), batch, cfg.k_max)
            rec = {"step": step, "loss": round(float(loss.detach()), 5), "lr": lr_at(step - 1, cfg),
                   "agree": [None if a is None else round(a, 4) for a in agree_d[:6]],
                   "tokens_per_s": round(batch.n_tokens * world / dt, 1)}
            if step % cfg.log_every == 0 or step == cfg.steps:
                state["history"].append(rec)
                if bar is None and rank == 0:
                    print(_line(rec), file=sys.stderr, flush=True)
            if bar is not None:
                bar.update(rec)
            if step % cfg.save_every == 0 or step == cfg.steps:
                checkpoint(step)
            if _kill_after is not None and step >= _kill_after:
                raise KeyboardInterrupt  # tests: a kill between checkpoints
    finally:
        if bar is not None:
            bar.close()
        model.eval()
    if dist is not None:  # DDP keeps replicas identical; prove it
        sums = torch.stack([p.detach().double().sum() for p in params]).cpu()
        lo, hi = sums.clone(), sums.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        state["ranks_in_sync"] = bool(torch.equal(lo, hi))
        state["world"] = world
    if cfg.export and rank == 0:
        write_dir_atomic(Path(cfg.export), adapter_files(
            model, {"step": step, "training": settings, "wall_s": round(state["wall_s"], 1)}, dtype=torch.float16))
    return state


def _to(batch: Batch, dev) -> Batch:
    return Batch(**{k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in batch.__dict__.items()})


def _line(rec: dict) -> str:
    # agreement with the teacher's argmax: own = the model's next token, m1 = the first mask, ...
    ag = " ".join(f"{'own' if d == 0 else f'm{d}'}={a:.2f}" for d, a in enumerate(rec["agree"]) if a is not None)
    return f"step {rec['step']} loss {rec['loss']:.4f} agree {ag} {rec['tokens_per_s']:.0f} tok/s"


class _Progress:
    """rich progress bar: loss, per-depth agreement (d1 = the model's own token), tokens/s."""

    def __init__(self, cfg: TrainConfig, start: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        self.p = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                          TextColumn("{task.fields[info]}"), transient=False)
        self.task = self.p.add_task("train", total=cfg.steps, completed=start, info="")
        self.p.start()

    def update(self, rec: dict):
        self.p.update(self.task, completed=rec["step"], info=_line(rec).split(" ", 2)[2])

    def close(self):
        self.p.stop()


# ---------------------------------------------------------------------------------------------- CLI

def add_cli(sub) -> None:
    p = sub.add_parser("train", help="self-distil an MTP adapter (mask token + gated LoRA)",
                       description="Student-forced online self-distillation (PAPER.md part B).")
    p.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file, or smollm2-135m (default)")
    p.add_argument("--data", help="JSONL of prompts (e.g. $MTP_DATA_DIR/gsm8k/train.jsonl)")
    p.add_argument("--examples", help="JSONL of token ids {prompt_ids, response_ids} (e.g. a self-generate cache)")
    p.add_argument("--prompt-field", default="question")
    p.add_argument("--response-field", default=None, help="field holding the response (else --self-generate)")
    p.add_argument("--self-generate", action="store_true", help="responses = the model's own greedy answers")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length cap of self-generated answers")
    p.add_argument("--gen-batch-size", type=int, default=16, help="sequences generated at once")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (per process under torchrun)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha")
    p.add_argument("--targets", default=",".join(TARGETS), help="projections with LoRA")
    p.add_argument("--k-max", type=int, default=16, help="span length k ~ U[2, K_MAX]")
    p.add_argument("--spans", type=int, default=5, help="mask spans per sequence")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (longer ones are cut)")
    p.add_argument("--teacher", default="hard", choices=TEACHERS)
    p.add_argument("--mode", default="gated", choices=MODES)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", required=True, help="adapter + checkpoint directory")
    p.add_argument("--export", default=None, help="also write a float16 adapter-only copy here at the end")
    p.add_argument("--resume", action="store_true", help="continue the run in --out (same settings)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu | cuda (under torchrun: each process its own GPU)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mtp.training.data import build_examples, load_examples, load_prompts
    from mtp.core.engine import Engine, EngineConfig
    if bool(args.data) == bool(args.examples):
        raise ValueError("give exactly one of --data FILE or --examples FILE")
    if args.data and not args.self_generate and not args.response_field:
        raise ValueError("--data needs --response-field FIELD or --self-generate")
    device = args.device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device available")
    try:
        prompts = load_prompts(args.data, args.prompt_field, args.response_field, args.limit) if args.data else None
        examples = load_examples(args.examples) if args.examples else None
        if examples is not None and args.limit:
            examples = examples[: args.limit]
        engine = Engine.load(EngineConfig(model=args.model, adapter="none", threads=args.threads, device=device))
        if prompts is not None:
            _, rank, _ = _dist()
            d = _dist()[0]
            if d is not None and rank != 0:
                d.barrier()  # rank 0 generates (and caches) first; the others then read its cache
            examples = build_examples(engine, prompts, args.self_generate, args.max_new_tokens,
                                      args.gen_batch_size, progress=rank == 0)
            if d is not None and rank == 0:
                d.barrier()
        ctx = engine.context_window
        too_long = [i for i, ex in enumerate(examples) if len(ex.prompt_ids) >= ctx]
        if too_long:
            raise ValueError(f"example {too_long[0]} is longer than the context window ({ctx} tokens)")
        cfg = TrainConfig(
            out=args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
            mode=args.mode, rank=args.rank, alpha=args.alpha, targets=tuple(args.targets.split(",")),
            k_max=args.k_max, spans=args.spans, seq_len=args.seq_len, teacher=args.teacher,
            save_every=args.save_every, seed=args.seed, resume=args.resume, device=device,
            log_every=args.log_every, export=args.export,
            meta={"model": args.model, "data": Path(args.data or args.examples).name,
                  "self_generate": bool(args.self_generate), "limit": args.limit})
        cfg_meta = dict(cfg.meta)
        t0 = time.perf_counter()
        state = train(cfg, engine.model, examples, n_used_tokens=len(engine.tokenizer))
        if _dist()[0] is not None:
            _dist()[0].barrier()  # nobody tears the group down while a peer still talks (gloo aborts)
        if _dist()[1] == 0:
            last = state["history"][-1] if state["history"] else {}
            print(f"trained {state['step']} steps in {time.perf_counter() - t0:.0f} s "
                  f"(total {state['wall_s']:.0f} s); last: {_line(last) if last else '-'}; adapter -> {cfg.out} "
                  f"[{cfg_meta['data']}, {len(examples)} examples]"
                  + (f"; {state['world']} processes, replicas in sync: {state['ranks_in_sync']}"
                     if "ranks_in_sync" in state else ""), file=sys.stderr)
    finally:
        d = _dist()[0]
        if d is not None:
            d.destroy_process_group()
            if sys.exc_info()[0] is None:
                # gloo's worker threads can abort the interpreter's own shutdown ("terminate called
                # without an active exception", SIGABRT) after a run that finished cleanly: leave now.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
    return 0
