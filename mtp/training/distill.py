"""Mask-token self-distillation (`mtp train`): a next-token model becomes a multi-token predictor.

Student-forced online distillation with a hard teacher (Kirchenbauer et al., arXiv 2602.06019):
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
The optimisation loop, checkpoints and resume are `mtp.training.trainer`'s; every step's batch and
span layout are a pure function of (seed, step), so a resumed run continues bit for bit.
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from mtp.core.runtime.adapter import (
    MODES,
    TARGETS,
    WEIGHTS,
    adapter_files,
    adapter_layers,
    add_adapters,
    check_layers,
    is_adapter_dir,
    load_trainable,
    read_adapter,
)
from mtp.core.runtime.artifacts import file_digest, load_safetensors, replaceable, write_dir_atomic
from mtp.training.data import Example
from mtp.training.trainer import Trainer, TrainerConfig, batch_indices, check_lr, distributed

TEACHERS = ("hard", "soft", "ground-truth")
# settings that must match when resuming (they shape the model, the data or the optimisation)
RESUME_KEYS = (
    "mode",
    "rank",
    "alpha",
    "targets",
    "seed",
    "teacher",
    "k_max",
    "spans",
    "seq_len",
    "batch_size",
    "lr",
    "warmup",
    "n_examples",
    "world",
    "lora_layers",
    "init_adapter",
)
# the adapter's shape: a run started from an adapter (--init-adapter) takes these from it
SHAPE_KEYS = ("mode", "rank", "alpha", "targets", "lora_layers")


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
    lora_layers: tuple | None = (
        None  # (FROM, TO): LoRA on layers FROM..TO-1 only (None: all); FROM > 0 freezes the mask row
    )
    init_adapter: str | None = None  # start from this adapter's weights (fresh optimizer); its shape must match
    amp: bool = False  # forward under bf16 autocast (`trainer.use_bf16`; `mtp train --amp`); weights stay fp32
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
            attn[row, first : row + 1] = True
            positions[row] = s.p + j
            row += 1
        rows = [s.p] + list(range(first, first + s.k - 1))
        pred_rows += rows
        depth += list(range(1, s.k + 1))
        span_of += [si] * s.k
        feeds += list(range(first, first + s.k - 1)) + [-1]
    return (positions, attn, torch.tensor(pred_rows), torch.tensor(depth), torch.tensor(span_of), torch.tensor(feeds))


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


def make_batch(
    examples: list[Example],
    mask_id: int,
    n_spans: int,
    k_max: int,
    seq_len: int,
    gen: torch.Generator | None,
    spans_of: list[list[Span]] | None = None,
) -> Batch:
    """The padded layout of `examples`, each with `n_spans` random spans (`sample_spans`), or with
    the given spans_of[i] for example i (evaluation: fixed spans, no generator needed)."""
    parts = []
    for i, ex in enumerate(examples):
        ids = (ex.prompt_ids + ex.response_ids)[:seq_len]
        spans = spans_of[i] if spans_of is not None else sample_spans(len(ex.prompt_ids), len(ids), n_spans, k_max, gen)
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
        tokens[b, G : G + m] = mask_id
        positions[b, col] = p
        attn[b, col.view(-1, 1), col.view(1, -1)] = a
        out_index[b, :nl], valid[b, :nl], depth[b, :nl] = col[r], True, d
        span_start[b, :nl], gt_target[b, :nl] = st, gt
        feeds[b, :nl] = torch.where(fd >= 0, col[fd.clamp_min(0)], fd)
    return Batch(
        tokens, positions, attn, out_index, valid, depth, span_start, feeds, gt_target, G, sum(len(p[1]) for p in parts)
    )


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
    """Student logits (with grad), its proposals [B, L], teacher logits or None. Logits are [B, L, V],
    or with `split` [n, V] for the n valid entries only (row-major: what `distill_loss` reads).

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
        d1 = depth == 1  # [B, L]: depth-1 rows are ground-truth rows, the others mask rows (or padding)
        valid = batch.valid.to(dev)
        rows_a, take_a = _compact(torch.where(d1, out_index, -1))  # [B, Sa] GT rows whose logits we need
        rows_b, take_b = _compact(torch.where(d1 | ~valid, -1, out_index - G))  # [B, Sb] mask rows
        kv = PrefixKV()
        with torch.no_grad(), model.base_only(), ac:
            logits_a = model(
                tokens[:, :G], positions[:, :G], cache=kv, attn_mask=attn[:, :G, :G], out_index=rows_a
            ).float()  # [B, Sa, V]
        kv.extend = True
        with ac:
            logits_b = student(
                tokens[:, G:], positions[:, G:], cache=kv, attn_mask=attn[:, G:], out_index=rows_b
            ).float()  # [B, Sb, V]
        s_logits = _scatter_rows(logits_a, take_a, logits_b, take_b, d1, valid)
    else:
        with ac:
            s_logits = student(tokens, positions, attn_mask=attn, out_index=out_index).float()  # [B, L, V]
    s_logits[..., mask_id] = float("-inf")  # the mask is never a prediction
    if split:  # [n, V] over the valid entries -> proposals [B, L] (0 at padding)
        proposals = torch.zeros(batch.valid.shape, dtype=torch.long, device=dev)
        proposals[valid] = s_logits.detach().argmax(-1)
    else:
        proposals = s_logits.detach().argmax(-1)  # [B, L]
    if teacher == "ground-truth":
        return s_logits, proposals, None
    t_tok = teacher_tokens(batch, proposals).to(dev)
    with torch.no_grad(), ac:
        if split:
            with model.base_only():
                logits_c = model(
                    t_tok[:, G:], positions[:, G:], cache=kv, attn_mask=attn[:, G:], out_index=rows_b
                ).float()
            t_logits = _scatter_rows(logits_a, take_a, logits_c, take_b, d1, valid)
        elif teacher_model is not None:
            t_logits = teacher_model(t_tok, positions, attn_mask=attn, out_index=out_index).float()
        else:
            with model.base_only():
                t_logits = model(t_tok, positions, attn_mask=attn, out_index=out_index).float()
    t_logits[..., mask_id] = float("-inf")
    return s_logits, proposals, t_logits


def _compact(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """index [B, L] with -1 for entries not wanted -> (rows [B, S] the wanted entries, in order and
    right-padded with row 0, S = the most any batch row wants; take [B, S] bool: which are real).
    E.g. [[4, -1, 7], [-1, 2, -1]] -> rows [[4, 7], [2, 0]], take [[T, T], [T, F]]."""
    want = index >= 0
    n = want.sum(1)  # [B]
    S = max(int(n.max()), 1)
    order = torch.argsort((~want).to(torch.int8), dim=1, stable=True)[:, :S]  # wanted entries first, in order
    rows = index.gather(1, order).clamp_min(0)
    take = torch.arange(S, device=index.device).view(1, S) < n.view(-1, 1)
    return rows, take


def _scatter_rows(logits_a, take_a, logits_b, take_b, d1: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[n, V] logits of the n valid entries in row-major order, from the GT rows' logits (where d1)
    and the mask rows' (valid, not d1): only the rows a loss needs were computed, in `_compact` order."""
    where = torch.full(valid.shape, -1, dtype=torch.long, device=valid.device)
    where[valid] = torch.arange(int(valid.sum()), device=valid.device)  # (b, l) -> row of the flat output
    out = logits_a.new_empty(int(valid.sum()), logits_a.shape[-1])
    out[where[d1 & valid]] = logits_a[take_a]
    out[where[~d1 & valid]] = logits_b[take_b]
    return out


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    batch: Batch,
    teacher: str,
    proposals: torch.Tensor,
):
    """Loss and per-entry agreement [B, L] with the target.

    student/teacher logits: [B, L, V], or [n, V] for the n valid entries in row-major order (what
    the split forward returns), the mask column already -inf; proposals: [B, L] the student's
    argmax. Work happens on the valid entries only: cross-entropy and log-probabilities come from
    logsumexp, so no full softmax is built (except for the soft teacher, which needs it)."""
    valid = batch.valid
    s = student_logits[valid] if student_logits.dim() == 3 else student_logits  # [n, V]
    s = s.float()
    if teacher == "ground-truth":
        target = batch.gt_target[valid]
        ce = F.cross_entropy(s, target, reduction="none")  # [n]
        weight = torch.ones_like(ce)
    else:
        tl = (teacher_logits[valid] if teacher_logits.dim() == 3 else teacher_logits).float()  # [n, V]
        target = tl.argmax(-1)  # [n]
        if teacher == "hard":
            ce = F.cross_entropy(s, target, reduction="none")
        else:
            q = F.softmax(tl, -1)
            ce = -(q * F.log_softmax(s, -1).clamp_min(-1e4)).sum(-1)
        # weight at depth d: prod_{i<d} P_T(y'_i | x + y'_<i), within each span (exclusive cumprod)
        log_z = tl.logsumexp(-1)
        logq = (tl.gather(-1, proposals[valid].unsqueeze(-1)).squeeze(-1) - log_z).clamp_min(math.log(1e-30))
        logq_bl = torch.zeros(valid.shape, dtype=logq.dtype, device=logq.device)
        logq_bl[valid] = logq
        excl = logq_bl.cumsum(1) - logq_bl  # [B, L]
        weight = (excl - excl.gather(1, batch.span_start)).exp()[valid]
    n = valid.sum().clamp_min(1)
    loss = (weight * ce).sum() / n
    target_bl = torch.zeros_like(proposals)
    target_bl[valid] = target.to(proposals.dtype)
    agree = (proposals == target_bl) & valid  # [B, L]
    return loss, agree


def agreement_by_depth(agree: torch.Tensor, batch: Batch, k_max: int) -> list[float | None]:
    out = []
    for d in range(1, k_max + 1):
        sel = batch.valid & (batch.depth == d)
        out.append(float(agree[sel].float().mean()) if bool(sel.any()) else None)
    return out


def prepare_examples(examples: list[Example], seq_len: int) -> list[Example]:
    """Keep examples with a prompt that fits --seq-len and at least 2 response tokens inside it."""
    kept = [ex for ex in examples if len(ex.prompt_ids) + 2 <= seq_len and len(ex.response_ids) >= 2]
    if not kept:
        raise ValueError(f"no example fits --seq-len {seq_len} (prompt + at least 2 response tokens)")
    return kept


def check_config(cfg: TrainConfig, model) -> None:
    if cfg.teacher not in TEACHERS:
        raise ValueError(f"unknown --teacher {cfg.teacher!r}; choose from {', '.join(TEACHERS)}")
    if cfg.mode not in MODES:
        raise ValueError(f"unknown --mode {cfg.mode!r}; choose from {', '.join(MODES)}")
    if cfg.k_max < 2:
        raise ValueError("--k-max must be >= 2")
    if cfg.spans < 1 or cfg.batch_size < 1 or cfg.steps < 1 or cfg.save_every < 1 or cfg.log_every < 1:
        raise ValueError("--spans, --batch-size, --steps, --save-every and --log-every must be >= 1")
    check_lr(cfg.lr)
    if cfg.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if cfg.seq_len > model.config.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's context window {model.config.max_seq_len}")
    check_layers(cfg.lora_layers, len(model.layers))
    if cfg.lora_layers is not None and cfg.mode == "full":
        raise ValueError("--lora-layers needs --mode gated or plain (full mode trains every weight)")


def shape_of(adapter_cfg: dict, n_layers: int) -> dict:
    """The SHAPE_KEYS settings an adapter config implies (lora_layers as a concrete (FROM, TO))."""
    return {
        "mode": adapter_cfg["mode"],
        "rank": adapter_cfg["rank"],
        "alpha": adapter_cfg["alpha"],
        "targets": tuple(adapter_cfg["targets"]),
        "lora_layers": adapter_layers(adapter_cfg, n_layers),
    }


def shape_conflict(given: dict, adapter_cfg: dict, path, n_layers: int) -> str | None:
    """One line naming the first setting in `given` (SHAPE_KEYS; a missing or None one is not
    compared; lora_layers as a concrete (FROM, TO)) that differs from the adapter at `path`, else None."""
    have = shape_of(adapter_cfg, n_layers)
    for k in SHAPE_KEYS:
        want = given.get(k)
        if want is None:
            continue
        want = tuple(want) if isinstance(want, (list, tuple)) else want
        if want != have[k]:
            show = {"targets": ",".join, "lora_layers": lambda v: f"{v[0]}:{v[1]}"}.get(k, str)
            return (
                f"--{k.replace('_', '-')} {show(want)} conflicts with --init-adapter {path} ({k} {show(have[k])}); "
                f"drop it: a run started from an adapter keeps its {', '.join(SHAPE_KEYS)}"
            )
    return None


def init_from(model, cfg: TrainConfig, n_used_tokens: int | None) -> tuple[dict, dict]:
    """--init-adapter: the adapter's tensors, checked against the base `model` (before any adapter is
    added: same base weights, mask row, finite) and against cfg's shape; and a record of the source
    (path, weights digest, its training step) for the run's settings."""
    path = Path(cfg.init_adapter)
    acfg, tensors = read_adapter(model, path, n_used_tokens)
    n = len(model.layers)
    given = {**{k: getattr(cfg, k) for k in SHAPE_KEYS}, "lora_layers": cfg.lora_layers or (0, n)}
    bad = shape_conflict(given, acfg, path, n)
    if bad:
        raise ValueError(bad)
    source = {
        "path": str(path),
        "weights_digest": file_digest(path / WEIGHTS),
        "step": acfg.get("meta", {}).get("step") if isinstance(acfg.get("meta"), dict) else None,
    }
    return tensors, source


def check_export(out, export) -> None:
    """--export lies apart from --out: the float16 copy replaces its folder whole, so an export equal to
    --out would wipe the checkpoint, one inside it would make --out no adapter directory (no --resume),
    and one containing it would swallow it."""
    if not export:
        return
    o, e = Path(out).resolve(), Path(export).resolve()
    if e == o or o in e.parents or e in o.parents:
        raise ValueError(
            f"--export {export} must be a folder apart from --out {out} (not the same, inside or "
            "around it): the float16 copy replaces its folder whole"
        )


def train(
    cfg: TrainConfig,
    model,
    examples: list[Example],
    n_used_tokens: int | None = None,
    progress: bool | None = None,
    on_step=None,
) -> dict:
    """Train (or resume) in place on `model` (a base Transformer); return the final trainer state.

    --out is both the adapter and the checkpoint (`mtp.training.trainer`); with --export a
    float16 adapter-only copy is written at the end. on_step(step): see `Trainer.run`."""
    check_config(cfg, model)
    check_export(cfg.out, cfg.export)
    dist, rank, world = distributed()
    out = Path(cfg.out)
    replaceable(out, is_adapter_dir)  # before any work: never overwrite what mtp did not write
    if cfg.export:
        replaceable(Path(cfg.export), is_adapter_dir)
    examples = prepare_examples(examples, cfg.seq_len)
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
    settings["n_examples"] = len(examples)
    settings["world"] = world
    init = None
    if cfg.init_adapter:
        init, settings["init_from"] = init_from(model, cfg, n_used_tokens)

    torch.manual_seed(cfg.seed)
    params = add_adapters(
        model, cfg.rank, cfg.alpha, tuple(cfg.targets), cfg.mode, n_used_tokens, layers=cfg.lora_layers
    )
    teacher_model = copy.deepcopy(model).requires_grad_(False) if cfg.mode == "full" else None  # the base
    if init is not None:
        load_trainable(model, init)  # step 0 = the source adapter; the optimizer starts fresh
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.999), weight_decay=0.0)
    student = model
    if dist is not None:
        student = DistributedDataParallel(model, device_ids=None if cfg.device == "cpu" else [model.device])
    step_fn = _step_fn(cfg, model, student, teacher_model, examples, rank, world)
    if progress is None:
        progress = sys.stderr.isatty() and rank == 0
    trainer = _trainer(cfg, model, params, opt, step_fn, settings, progress)
    model.train()
    try:
        state = trainer.run(cfg.resume, on_step)
    finally:
        model.eval()
    if dist is not None:  # DDP keeps replicas identical; prove it
        state["ranks_in_sync"] = ranks_in_sync(dist, params)
        state["world"] = world
    if cfg.export and rank == 0:
        write_dir_atomic(
            Path(cfg.export), adapter_files(model, _meta(state, settings), dtype=torch.float16), kind=is_adapter_dir
        )
    return state


def _trainer(cfg: TrainConfig, model, params, opt, step_fn, settings: dict, progress: bool) -> Trainer:
    """The run's `Trainer`: --out is the adapter and the checkpoint at once (its files: the adapter's)."""

    def files_fn():
        return adapter_files(model, _meta(trainer.state, settings))

    def load_fn(ckpt: Path):
        load_trainable(model, load_safetensors(ckpt / WEIGHTS))

    trainer = Trainer(
        TrainerConfig(cfg.steps, cfg.lr, cfg.warmup, cfg.save_every, cfg.log_every, clip_norm=1.0),
        params,
        opt,
        Path(cfg.out),
        step_fn,
        files_fn,
        load_fn,
        settings,
        RESUME_KEYS,
        is_adapter_dir,
        describe=describe,
        progress=progress,
    )
    return trainer


def _meta(state: dict, settings: dict) -> dict:
    """What an adapter written by this run records: its step, the settings, the wall time so far."""
    return {"step": state["step"], "training": settings, "wall_s": round(state["wall_s"], 1)}


def _step_fn(cfg: TrainConfig, model, student, teacher_model, examples: list[Example], rank: int, world: int):
    """`Trainer`'s step: step -> (the loss of this rank's batch, its log figures: agreement with the
    teacher per depth, tokens and predictions over all ranks). The batch and its masks are fixed by
    (seed, step, rank), so a resumed run draws the same ones."""
    mask_id = model.config.mask_token_id
    dev = model.device
    split = cfg.mode == "gated" and not cfg.full_layout

    def step_fn(step: int):
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + rank)
        idx = batch_indices(step, len(examples), cfg.batch_size, cfg.seed, rank, world)
        batch = make_batch([examples[i] for i in idx], mask_id, cfg.spans, cfg.k_max, cfg.seq_len, gen)
        s_logits, proposals, t_logits = forward_pair(student, model, teacher_model, batch, cfg.teacher, split, cfg.amp)
        loss, agree = distill_loss(s_logits, t_logits, _to(batch, dev), cfg.teacher, proposals)
        agree_d = agreement_by_depth(agree.cpu(), batch, cfg.k_max)
        return loss, {
            "agree": [None if a is None else round(a, 4) for a in agree_d[:6]],
            "tokens": batch.n_tokens * world,
            "predictions": int(batch.valid.sum()) * world,
        }

    return step_fn


def ranks_in_sync(dist, params) -> bool:
    """Whether every rank holds the same trainable weights (each tensor's sum, its least and greatest over ranks)."""
    sums = torch.stack([p.detach().double().sum() for p in params]).cpu()
    lo, hi = sums.clone(), sums.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def _to(batch: Batch, dev) -> Batch:
    return Batch(**{k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in batch.__dict__.items()})


def describe(rec: dict) -> str:
    """A log line: loss, agreement with the teacher's argmax per depth (own = the model's next
    token, m1 = the first mask, ...), tokens/s."""
    ag = " ".join(f"{'own' if d == 0 else f'm{d}'}={a:.2f}" for d, a in enumerate(rec["agree"]) if a is not None)
    return (
        f"loss {rec['loss']:.4f} agree {ag} {rec['tokens'] / rec['step_s']:.0f} tok/s "
        f"{rec['predictions'] / rec['step_s']:.0f} predictions/s"
    )
