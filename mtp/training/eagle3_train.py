"""Training an EAGLE-3 drafter (`mtp train-eagle3`) on the frozen trunk's cached residual streams.

As for the heads (`mtp.training.heads_train`), the trunk is frozen: its residual streams at the
drafter's `aux_layers` over every self-generated example are computed once and cached as
safetensors, one file per block of examples (`cached_features`), and the drafter trains on the
cache through the one optimisation loop of `mtp.training.trainer`. Targets are the answers
themselves (the model's own greedy continuation: the "hard teacher"), restricted to the draft
vocabulary.

Training-time test (EAGLE-3): the drafter is unrolled `ttt_steps` steps, as it runs when drafting.
Step 0 at anchor p reads the trunk's fused features at p and the token p+1 and predicts p+2; step j
reads its own step j-1 hidden state and the token p+j+1 at position p+j and predicts p+j+2. Its
query sees the step-0 keys of positions 0..p (what the trunk committed, as in the drafter's cache)
and its own chain's keys of steps 1..j: exactly what it sees while drafting token j+1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mtp.core.decoding.proposers.eagle3 import (
    CONFIG,
    FORMAT,
    WEIGHTS,
    Eagle3Config,
    Eagle3Drafter,
    drafter_files,
    exportable_layers,
)
from mtp.core.runtime.artifacts import base_hash, load_safetensors, replaceable, write_dir_atomic
from mtp.core.runtime.model import Transformer
from mtp.training import feature_cache
from mtp.training.heads_train import split_rows
from mtp.training.trainer import (
    CHECKPOINT,
    Trainer,
    TrainerConfig,
    accuracy_line,
    check_lr,
    recover_run_out,
    run_dir_kinds,
)

RESUME_KEYS = (
    "aux_layers",
    "draft_vocab",
    "ttt_steps",
    "batch_size",
    "max_len",
    "seed",
    "lr",
    "warmup",
    "val_fraction",
    "group_by_length",
)


# ---- the feature cache -------------------------------------------------------------------------


def extract_features(
    model: Transformer,
    examples,
    aux_layers,
    max_len: int = 512,
    dtype=torch.bfloat16,
    batch_size: int = 4,
    progress=None,
) -> dict:
    """Run the frozen trunk once over prompt + response of every example (cut to `max_len` tokens).

    Returns {"aux": [N, A*dim] (`dtype`), "tokens": [N] int64, "offsets": [E+1], "prompt_len": [E]}:
    example e owns rows offsets[e]..offsets[e+1]-1, one per token, aux = the residual streams after
    the `aux_layers` at that token's position."""
    seqs = [(list(ex.prompt_ids) + list(ex.response_ids))[:max_len] for ex in examples]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    got: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            T = max(len(seqs[i]) for i in idx)
            tokens = torch.zeros(len(idx), T, dtype=torch.long)
            for j, i in enumerate(idx):
                tokens[j, : len(seqs[i])] = torch.tensor(seqs[i])
            _, _, aux = model(
                tokens.to(model.device),
                out_index=torch.zeros(len(idx), 1, dtype=torch.long, device=model.device),
                aux_layers=tuple(aux_layers),
            )
            for j, i in enumerate(idx):
                got[i] = aux[j, : len(seqs[i])].to("cpu", dtype)
            if progress:
                progress(min(b + batch_size, len(order)), len(order))
    lens = [len(s) for s in seqs]
    offsets = torch.tensor([0] + lens).cumsum(0)
    return {
        "aux": torch.cat([got[i] for i in range(len(seqs))]),
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.long),
        "offsets": offsets,
        "prompt_len": torch.tensor([min(len(ex.prompt_ids), max_len) for ex in examples], dtype=torch.long),
    }


def cached_features(
    model: Transformer, examples, aux_layers, cache_dir, max_len: int = 512, dtype: str = "bfloat16", progress=None
) -> tuple[dict, Path]:
    """extract_features, computed once per (base model, layers, block of examples) and kept as
    safetensors (`mtp.training.feature_cache`: resumable, and a grown data set recomputes only its new
    examples). Returns the features and the cache's index file; a whole-set file of the earlier layout
    is still read. The streams ("aux") stay in the memory-mapped block files (`BlockRows`), read per
    batch: the trainer's memory does not grow with the data set."""
    depends_on = f"{base_hash(model)}:{list(aux_layers)}:{max_len}:{dtype}"
    whole = Path(cache_dir) / "eagle3-features" / f"{feature_cache.block_key(depends_on, examples)}.safetensors"
    if whole.exists():
        return load_safetensors(whole), whole

    def extract(part, progress):
        return extract_features(model, part, aux_layers, max_len, getattr(torch, dtype), progress=progress)

    index = feature_cache.cached_blocks(
        Path(cache_dir) / "eagle3-features" / "blocks",
        depends_on,
        examples,
        extract,
        progress=progress,
        metadata={"base_hash": base_hash(model)},
    )
    return feature_cache.join_blocks(index, offset_fields=("offsets",), on_disk=("aux",)), index


# ---- configuration -----------------------------------------------------------------------------


@dataclass
class TrainEagle3Config:
    aux_layers: tuple = ()  # () = the model's low/middle/high default
    draft_vocab: int = 4096
    ttt_steps: int = 3  # training-time test: steps unrolled (= drafts it learns to make per pass)
    steps: int = 400
    batch_size: int = 8  # examples per step
    max_len: int = 512
    lr: float = 5e-4
    warmup: int = 20
    save_every: int = 100
    val_fraction: float = 0.1
    seed: int = 0
    step_decay: float = 0.8  # loss weight of TTT step j: decay ** j (EAGLE-3's weighting)
    group_by_length: bool = True  # batches of similar lengths (`batch_examples`)
    amp: bool = False  # forward under bf16 autocast (`trainer.use_bf16`); weights and AdamW stay fp32

    def __post_init__(self):
        self.aux_layers = tuple(self.aux_layers)
        if len(set(self.aux_layers)) != len(self.aux_layers):
            raise ValueError(
                f"--aux-layers {','.join(map(str, self.aux_layers))} names a layer twice; give "
                "distinct layer ids (e.g. 2,15,27 of 30 layers)"
            )
        if not 1 <= self.ttt_steps <= 8:
            raise ValueError(f"--ttt-steps must be in 1..8, got {self.ttt_steps}")
        for name in ("steps", "batch_size", "save_every", "draft_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_len < 4:
            raise ValueError(f"--max-len must be >= 4, got {self.max_len}")
        check_lr(self.lr)
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")


# ---- data --------------------------------------------------------------------------------------


def split_examples(feats: dict, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Example indices (train, val), the same split rule as the heads trainer's."""
    n = len(feats["prompt_len"])
    return split_rows({"example": torch.arange(n)}, val_fraction, seed)


LENGTH_WINDOW = 32  # batches whose examples are sorted by length together (group_by_length)


def batch_examples(
    train: torch.Tensor, step: int, batch_size: int, seed: int, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """The examples of optimizer step `step`: epochs of seeded permutations (resume sees the same).

    With `lengths` (tokens per example, indexed like the features), each window of LENGTH_WINDOW
    batches of the permutation is sorted by length and cut into batches, whose order is then shuffled:
    batches of similar lengths pad less (random batches of this data set are ~35 % padding). Such an
    epoch holds the n // batch_size full batches; the few examples left over differ per epoch."""
    n = len(train)
    if lengths is not None and n >= batch_size:
        per_epoch = n // batch_size
        epoch, i = divmod(step, per_epoch)
        g = torch.Generator().manual_seed(seed * 100003 + epoch)
        order = train[torch.randperm(n, generator=g)]
        span = LENGTH_WINDOW * batch_size
        order = torch.cat([w[torch.argsort(lengths[w], descending=True, stable=True)] for w in order.split(span)])
        batches = order[: per_epoch * batch_size].view(per_epoch, batch_size)
        return batches[torch.randperm(per_epoch, generator=g)[i]]
    out, start = [], step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        take = perm[offset : offset + batch_size - len(out)]
        out.extend(take.tolist())
        start += len(take)
    return train[torch.tensor(out, dtype=torch.long)]


def draft_vocab_from(feats: dict, examples: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens of these examples (ties: lower id first), sorted by id."""
    toks = [
        feats["tokens"][int(feats["offsets"][e]) + int(feats["prompt_len"][e]) : int(feats["offsets"][e + 1])]
        for e in examples.tolist()
    ]
    toks = torch.cat(toks) if toks else torch.zeros(0, dtype=torch.long)
    if not len(toks):
        raise ValueError("no answer tokens to build a draft vocabulary from")
    counts = torch.bincount(toks)
    ids = torch.arange(len(counts))[counts > 0].tolist()
    ids.sort(key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(ids[:size]), dtype=torch.long)


# Batch lengths are padded up to a multiple of this. Every distinct [B, T] makes the bf16 CPU kernels
# (oneDNN) build and keep new primitives: with ~500 distinct T the trainer grew ~2 MB a step; with
# buckets of 32 there are at most max_len / 32 shapes (benchmarks/results/eagle3/shape_buckets/).
SHAPE_BUCKET = 32


def make_batch(feats: dict, examples: torch.Tensor, device, bucket: int = SHAPE_BUCKET) -> dict:
    """Right-padded tensors of these examples: tokens [B, T], aux [B, T, A*dim], length, prompt_len [B].
    T is the longest example rounded up to a multiple of `bucket`; the padding (token 0, aux 0) lies
    past every example's length, so causal attention and the loss never see it."""
    spans = [(int(feats["offsets"][e]), int(feats["offsets"][e + 1])) for e in examples.tolist()]
    T = -(-max(b - a for a, b in spans) // bucket) * bucket
    A = feats["aux"].shape[1]
    tokens = torch.zeros(len(spans), T, dtype=torch.long)
    aux = torch.zeros(len(spans), T, A, dtype=torch.float32)
    for i, (a, b) in enumerate(spans):
        tokens[i, : b - a] = feats["tokens"][a:b]
        aux[i, : b - a] = feats["aux"][a:b].float()
    return {
        "tokens": tokens.to(device),
        "aux": aux.to(device),
        "length": torch.tensor([b - a for a, b in spans], device=device),
        "prompt_len": feats["prompt_len"][examples].to(device),
    }


# ---- the training-time test --------------------------------------------------------------------


def ttt_logits(drafter: Eagle3Drafter, embed, batch: dict, steps: int) -> list[torch.Tensor]:
    """Unroll the drafter `steps` steps over every anchor p = 0..T-2 of the batch.
    Returns one tensor [B, T-1, draft_vocab] per step: step j's guess for token p+j+2."""
    tokens, aux = batch["tokens"], batch["aux"]  # [B, T], [B, T, A*dim]
    B, T = tokens.shape
    n = T - 1
    cfg = drafter.config
    rep = cfg.n_heads // cfg.n_kv_heads
    scale = cfg.head_dim**-0.5
    anchor = torch.arange(n, device=tokens.device)
    causal = anchor.view(n, 1) >= anchor.view(1, n)  # [n, n]: anchor p sees step-0 keys 0..p

    def tok(j):  # [B, n]: the token after anchor p + j (index clamped; rows past the end are masked in the loss)
        return tokens.gather(1, (anchor + j + 1).clamp(max=T - 1).expand(B, n))

    g = drafter.fc(aux[:, :n])  # [B, n, dim]
    q, k0, v0 = drafter.qkv(embed(tok(0)), g, anchor.expand(B, n))
    k0r, v0r = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)  # [B, H, n, hd]
    h = drafter.finish(g, F.scaled_dot_product_attention(q, k0r, v0r, attn_mask=causal))
    out = [drafter.logits(h)]
    chain_k, chain_v = [], []
    for j in range(1, steps):
        q, k, v = drafter.qkv(embed(tok(j)), h, (anchor + j).expand(B, n))
        chain_k.append(k.repeat_interleave(rep, 1))
        chain_v.append(v.repeat_interleave(rep, 1))
        s0 = (q @ k0r.transpose(-1, -2)) * scale  # [B, H, n, n]
        s0 = s0.masked_fill(~causal, float("-inf"))
        sd = torch.stack([(q * ck).sum(-1) for ck in chain_k], -1) * scale  # [B, H, n, j]: own chain
        p = torch.softmax(torch.cat([s0, sd], -1), -1)
        y = p[..., :n] @ v0r + sum(p[..., n + i : n + i + 1] * cv for i, cv in enumerate(chain_v))
        h = drafter.finish(h, y)
        out.append(drafter.logits(h))
    return out


def ttt_targets(drafter: Eagle3Drafter, batch: dict, steps: int) -> list[torch.Tensor]:
    """Per step j, [B, T-1] draft ids of token p+j+2, or -1 where no loss applies (past the end, a
    prompt token, or a token outside the draft vocabulary)."""
    tokens, length, plen = batch["tokens"], batch["length"], batch["prompt_len"]
    B, T = tokens.shape
    n = T - 1
    to_draft = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long, device=tokens.device)
    ids = drafter.draft_ids()
    to_draft[ids] = torch.arange(len(ids), device=tokens.device)
    anchor = torch.arange(n, device=tokens.device).view(1, n)
    out = []
    for j in range(steps):
        at = anchor + j + 2  # [1, n] index of the target token
        ok = (at < length.view(B, 1)) & (at >= plen.view(B, 1))
        t = to_draft[tokens.gather(1, at.clamp(max=T - 1).expand(B, n))]
        out.append(torch.where(ok, t, torch.full_like(t, -1)))
    return out


def ttt_loss(drafter, embed, batch, steps: int, decay: float = 0.8) -> tuple[torch.Tensor, list]:
    """Weighted cross-entropy over the unrolled steps; per-step accuracy (earlier tokens right)."""
    logits = ttt_logits(drafter, embed, batch, steps)
    targets = ttt_targets(drafter, batch, steps)
    losses, weights, accs = [], [], []
    for j, (lg, t) in enumerate(zip(logits, targets)):
        valid = t >= 0
        if bool(valid.any()):
            losses.append(F.cross_entropy(lg[valid].float(), t[valid]))
            weights.append(decay**j)
            accs.append(float((lg[valid].argmax(-1) == t[valid]).float().mean()))
        else:
            accs.append(float("nan"))
    if not losses:
        return logits[0].sum() * 0, accs
    w = torch.tensor(weights, device=losses[0].device)
    return (torch.stack(losses) * w).sum() / w.sum(), accs


def evaluate(drafter, embed, feats: dict, examples: torch.Tensor, steps: int, batch_size: int = 8) -> dict:
    """Held-out: per-step accuracy, and 1 + the mean leading run of correct steps over anchors that
    have all `steps` targets (= tokens per pass `verify:steps+1` would reach on this greedy text)."""
    correct, counted = torch.zeros(steps), torch.zeros(steps)
    lead_sum, lead_n = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(examples), batch_size):
            batch = make_batch(feats, examples[b : b + batch_size], drafter.d2t.device)
            logits = ttt_logits(drafter, embed, batch, steps)
            targets = ttt_targets(drafter, batch, steps)
            ok = torch.stack([lg.argmax(-1) == t for lg, t in zip(logits, targets)], -1)  # [B, n, steps]
            valid = torch.stack([t >= 0 for t in targets], -1)
            # a target outside the draft vocabulary is a miss for acceptance, not "no target"
            tokens, length, plen = batch["tokens"], batch["length"], batch["prompt_len"]
            n = tokens.shape[1] - 1
            anchor = torch.arange(n, device=tokens.device).view(1, n, 1)
            at = anchor + torch.arange(steps, device=tokens.device).view(1, 1, steps) + 2
            exists = (at < length.view(-1, 1, 1)) & (at >= plen.view(-1, 1, 1))
            correct += (ok & valid).sum((0, 1)).cpu().float()
            counted += exists.sum((0, 1)).cpu().float()
            full = exists.all(-1)
            lead = torch.cumprod((ok & valid).long(), -1).sum(-1)
            lead_sum += float(lead[full].sum())
            lead_n += int(full.sum())
    acc = (correct / counted.clamp(min=1)).tolist()
    return {
        "val_acc_by_step": [round(a, 4) for a in acc],
        "val_tokens_per_pass": round(1 + lead_sum / max(lead_n, 1), 4),
        "val_examples": len(examples),
    }


# ---- training ----------------------------------------------------------------------------------


def init_drafter(model: Transformer, cfg: Eagle3Config, vocab: torch.Tensor, seed: int) -> Eagle3Drafter:
    """A new drafter: projections ~ N(0, 0.02), its head and final norm copied from the trunk's rows of
    the draft vocabulary, fc starting as "the highest aux layer" (the trunk's own late features)."""
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for _name, p in d.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
        dim = cfg.target_dim
        d.fc.weight[:, (len(cfg.aux_layers) - 1) * dim :].add_(torch.eye(dim)[: cfg.dim])
        d.lm_head.weight.copy_(model.lm_head.weight[vocab.to(model.device)].float().cpu())
        d.norm.weight.copy_(model.norm.weight.float().cpu())
    d.set_vocab(vocab)
    return d


def train_eagle3(
    model: Transformer,
    feats: dict,
    cfg: TrainEagle3Config,
    out,
    resume: bool = False,
    meta: dict | None = None,
    log=print,
    on_step=None,
    progress: bool = False,
) -> dict:
    """Train a drafter on cached features; write `out` (config.json + model.safetensors) at the end
    and a resumable `out/checkpoint` every `save_every` steps and on Ctrl-C. Returns held-out metrics."""
    out = Path(out)
    recover_run_out(out)  # what a kill inside a save left (a checkpoint's or the final write's)
    replaceable(out, is_drafter_dir)
    if not resume and (out / CONFIG).exists():
        raise ValueError(f"{out} already holds a drafter; pass --resume to continue or choose another --out")
    model.requires_grad_(False)
    ecfg = Eagle3Config.for_model(model.config, cfg.draft_vocab, cfg.aux_layers or None)
    A = feats["aux"].shape[1]
    if A != len(ecfg.aux_layers) * model.config.dim:
        raise ValueError(f"the feature cache holds {A} values per position, not {len(ecfg.aux_layers)} layers")
    train, val = split_examples(feats, cfg.val_fraction, cfg.seed)
    if len(train) == 0:
        raise ValueError("no training examples after the validation split; use more --limit")
    vocab = draft_vocab_from(feats, train, cfg.draft_vocab)
    ecfg.draft_vocab = len(vocab)
    drafter = init_drafter(model, ecfg, vocab, cfg.seed).to(model.device)
    embed = model.embed_tokens
    params = [p for p in drafter.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    settings = {**asdict(cfg), "aux_layers": list(ecfg.aux_layers), "draft_vocab": cfg.draft_vocab}

    lengths = (feats["offsets"][1:] - feats["offsets"][:-1]) if cfg.group_by_length else None

    def step_fn(step: int):
        batch = make_batch(feats, batch_examples(train, step, cfg.batch_size, cfg.seed, lengths), model.device)
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=cfg.amp):
            loss, accs = ttt_loss(drafter, embed, batch, cfg.ttt_steps, cfg.step_decay)
        return loss, {"acc": [round(a, 4) for a in accs], "tokens": int(batch["length"].sum())}

    def load_fn(path: Path):
        drafter.load_state_dict(load_safetensors(path / WEIGHTS))

    trainer = Trainer(
        TrainerConfig(cfg.steps, cfg.lr, cfg.warmup, cfg.save_every, log_every=10, clip_norm=1.0, what="training run"),
        params,
        opt,
        out / CHECKPOINT,
        step_fn,
        lambda: {WEIGHTS: dict(drafter.state_dict())},
        load_fn,
        settings,
        RESUME_KEYS,
        is_drafter_checkpoint,
        describe=accuracy_line("tokens"),
        log=log,
        progress=progress,
    )
    n_params = sum(p.numel() for p in params)
    if not exportable_layers(ecfg.aux_layers, model.config.n_layers):
        log(
            f"note: layers {list(ecfg.aux_layers)} serve --proposer eagle3, but `mtp export --format vllm-eagle3` "
            f"needs three ascending layers below {model.config.n_layers}"
        )
    log(
        f"eagle3: layers {list(ecfg.aux_layers)}, draft vocabulary {len(vocab)}, {n_params:,} parameters; "
        f"{len(train)} train / {len(val)} val examples; {cfg.steps} steps of {cfg.batch_size}, TTT {cfg.ttt_steps}"
    )
    metrics = trainer.train_module(
        drafter,
        resume,
        on_step,
        lambda: evaluate(drafter, embed, feats, val, cfg.ttt_steps) if len(val) else {},
        {"steps": cfg.steps, "train_examples": len(train), "n_params": n_params},
    )
    write_dir_atomic(
        out, drafter_files(drafter, model, {**(meta or {}), "train": settings, "metrics": metrics}), kind=is_drafter_dir
    )
    return metrics


is_drafter_dir, is_drafter_checkpoint = run_dir_kinds(FORMAT, WEIGHTS)
