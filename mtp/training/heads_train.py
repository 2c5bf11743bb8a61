"""DeepSeek-style MTP heads: small modules that guess the tokens after the next one from the trunk's
last hidden state, as a second source of proposals beside the mask token (mtp.core.proposers).

Depth d (DeepSeek-V3, PAPER.md part A) takes the previous depth's hidden state h_{d-1} (h_0 = the
trunk's last-layer hidden state, before the final norm) and the embedding of the token that follows
it, and returns h_d, read out through the base model's *shared* final norm and output head:

    h_d = Out(Blocks(Proj([RMSNorm(h_{d-1}) ; RMSNorm(embed(t_d))])))   # Proj: 2*dim -> width
    p_d = softmax(lm_head(norm(h_d)))                                    # guess for t_{d+1}

Size knobs: `blocks` (L; 0 = the projection alone), `width` (< dim: the blocks run narrower and
`Out` projects back to dim) and `depths` (D, each chained on the previous one's hidden state and
token, so the causal chain is kept). The blocks are `mtp.core.model.Block`s at `width`.

Choice: a head block attends only to its own position (each position is a length-1 sequence), so
the heads need no KV cache of their own and decoding runs them on the one hidden state the
verifying pass already produced. The trunk's hidden state carries the context. With one key the
attention weights are 1, so q/k are inert: a block acts as v/o projections plus an MLP.

Training (`mtp train-heads`): the trunk is frozen, so its hidden states over the self-generated
answers are computed once and cached (one safetensors file per data set); the heads then train on
that cache with cross-entropy against the model's own greedy continuation (the "hard teacher").
No trunk pass per step: this is far cheaper per example than mask-token training.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mtp.core.adapter import base_hash, check_trained_on, write_dir_atomic
from mtp.core.model import Block, Linear, ModelConfig, RMSNorm, Transformer
from mtp.core.proposers import Guesses, PassView, Proposer
from mtp.core.sampling import pick

FORMAT = "mtp-heads"
WEIGHTS = "heads.safetensors"
CONFIG = "config.json"
CHECKPOINT = "checkpoint"  # sub-directory of --out holding the resumable trainer state
MAX_AHEAD = 8  # the feature cache stores this many tokens ahead of each row (so depths <= 8)


@dataclass
class HeadsConfig:
    dim: int  # the base model's width
    depths: int = 1  # D: guesses per pass
    blocks: int = 0  # L: transformer blocks per depth (0 = projection only)
    width: int = 0  # block width (0 = dim)
    n_heads: int = 0  # attention heads of a block (0 = width // the base model's head_dim)
    intermediate_size: int = 0  # MLP width of a block (0 = base's, scaled by width / dim)
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.depths < 1 or self.depths > MAX_AHEAD:
            raise ValueError(f"--depths must be in 1..{MAX_AHEAD}, got {self.depths}")
        if self.blocks < 0:
            raise ValueError(f"--blocks must be >= 0, got {self.blocks}")
        if self.width < 0 or self.width > self.dim:
            raise ValueError(f"--width must be in 1..{self.dim} (the model width), got {self.width}")
        if self.blocks == 0 or self.width == 0:  # projection only: straight to the model width
            self.width = self.dim
        if self.blocks and (self.n_heads < 1 or self.width % self.n_heads or (self.width // self.n_heads) % 2):
            raise ValueError(f"width {self.width} does not split into {self.n_heads} attention heads "
                             "of even size")

    @classmethod
    def for_model(cls, model_cfg: ModelConfig, depths=1, blocks=0, width=0) -> "HeadsConfig":
        """Derive block shapes from the base model: head size kept, MLP scaled with the width."""
        w = width or model_cfg.dim
        n_heads = max(1, w // model_cfg.head_dim)
        while n_heads > 1 and (w % n_heads or (w // n_heads) % 2):
            n_heads -= 1
        inter = max(1, round(model_cfg.intermediate_size * w / model_cfg.dim))
        return cls(dim=model_cfg.dim, depths=depths, blocks=blocks, width=width, n_heads=n_heads,
                   intermediate_size=inter, norm_eps=model_cfg.norm_eps)

    def block_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=1, dim=self.width, n_layers=0, n_heads=self.n_heads, n_kv_heads=self.n_heads,
                           intermediate_size=self.intermediate_size, norm_eps=self.norm_eps)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadsConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def label(self) -> str:
        if self.blocks == 0:
            return f"linear x{self.depths}"
        w = "" if self.width == self.dim else f" @{self.width}"
        return f"{self.blocks} block{'s' if self.blocks > 1 else ''}{w} x{self.depths}"


class MTPHead(nn.Module):
    """One depth: (h_{d-1} [N, dim], embed(t_d) [N, dim]) -> h_d [N, dim]."""

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        self.norm_h = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm_e = RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = Linear(2 * cfg.dim, cfg.width, bias=False)
        bcfg = cfg.block_config()
        self.blocks = nn.ModuleList(Block(bcfg) for _ in range(cfg.blocks))
        self.out = Linear(cfg.width, cfg.dim, bias=False) if cfg.width != cfg.dim else None
        self.head_dim = bcfg.head_dim
        if cfg.width == cfg.dim:  # start from "h_d = h_{d-1}": the trunk's own readout, not noise
            with torch.no_grad():
                self.proj.weight[:, :cfg.dim].copy_(torch.eye(cfg.dim))
                self.proj.weight[:, cfg.dim:].mul_(0.1)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        x = self.proj(torch.cat([self.norm_h(h), self.norm_e(emb.to(h.dtype))], dim=-1))  # [N, width]
        if self.blocks:
            x = x.unsqueeze(1)  # [N, 1, width]: every position is its own length-1 sequence
            one = x.new_ones(1, 1, 1, self.head_dim)  # RoPE at position 0: cos 1, sin 0
            for block in self.blocks:
                x = block(x, one, one * 0, None)
            x = x.squeeze(1)
        return self.out(x) if self.out is not None else x  # [N, dim]


class MTPHeads(nn.Module):
    """D chained depths. Holds no reference to the base model: embedding and readout are passed in."""

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        self.config = cfg
        self.depths = nn.ModuleList(MTPHead(cfg) for _ in range(cfg.depths))
        self.draft_vocab: torch.Tensor | None = None  # [Vd] token ids drafts are drawn from (None = all)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, model: Transformer, hidden: torch.Tensor, tokens: torch.Tensor, readout=None) -> list:
        """Teacher-forced chain (training). hidden: [N, dim] trunk states h_0; tokens: [N, D] where
        tokens[:, d-1] is the token after the row's position for depth d (-1 = none, any id works).
        Returns D logits tensors [N, V]: depth d's guess for the token after tokens[:, d-1]."""
        readout = readout or (lambda h: model.lm_head(model.norm(h)))
        out, h = [], hidden
        for d, head in enumerate(self.depths):
            h = head(h, model.embed_tokens(tokens[:, d].clamp(min=0)))
            out.append(readout(h))
        return out


def bf16_readout(model: Transformer, rows: torch.Tensor | None = None):
    """The shared final norm + output head with the head matrix in bfloat16: on CPUs with bf16
    matrix units this is ~4x faster than float32, and drafting is dominated by this one matmul.
    rows: only these output rows (the draft vocabulary) -> logits [N, len(rows)]."""
    w = model.lm_head.weight.detach()
    w = (w if rows is None else w[rows.to(w.device)]).to(torch.bfloat16)  # [V or Vd, dim]

    def readout(h):  # h: [N, dim] -> [N, V] float32
        return F.linear(model.norm(h).to(torch.bfloat16), w).float()

    return readout


class HeadsProposer(Proposer):
    """Guesses from MTP heads on the hidden state the verifying pass already produced (no trunk pass).

    `propose` chains up to k-1 depths from view.hidden (the last accepted position's state, whose
    prediction is view.context[-1]): depth 1 sees that token, depth d the guess of depth d-1.
    With a draft vocabulary (`--draft-vocab N`, the N most frequent target tokens; FR-Spec's idea)
    the readout scores only those rows of the output head: drafting gets ~V/N times cheaper, and
    `verify` stays lossless (a draft outside it is simply never proposed; under sampling the
    proposal distribution is zero there, which rejection sampling handles exactly).
    `draft_s` / `draft_calls` accumulate the drafting time, for the benchmarks."""
    name = "heads"
    needs_hidden = True
    has_confidence = True

    def __init__(self, model: Transformer, heads: MTPHeads, readout_dtype: str = "bfloat16"):
        self.model, self.heads = model, heads.eval().requires_grad_(False)
        if readout_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"readout_dtype must be bfloat16 or float32, got {readout_dtype!r}")
        vocab = heads.draft_vocab
        mid = model.config.mask_token_id
        if vocab is not None and mid is not None:
            vocab = vocab[vocab != mid]
        self.vocab = vocab  # [Vd] or None
        if readout_dtype == "bfloat16":
            self.readout = bf16_readout(model, vocab)
        else:
            w = model.lm_head.weight if vocab is None else model.lm_head.weight[vocab.to(model.device)]
            self.readout = lambda h: F.linear(model.norm(h), w).float()
        self.draft_s, self.draft_calls = 0.0, 0

    @property
    def depths(self) -> int:
        return self.heads.config.depths

    def propose(self, view: PassView, k: int, params, gen) -> Guesses:
        n = min(k - 1, self.depths)
        if n <= 0 or view.hidden is None:
            return Guesses.none()
        t0 = time.perf_counter()
        dev = self.model.device
        mid = self.model.config.mask_token_id
        h = view.hidden.to(dev, self.model.embed_tokens.weight.dtype).view(1, -1)  # [1, dim]
        tok = torch.tensor([view.context[-1]], device=dev)  # [1]
        tokens, confs, dists = [], [], []
        with torch.inference_mode():
            for head in self.heads.depths[:n]:
                h = head(h, self.model.embed_tokens(tok))
                logits = self.readout(h).cpu()  # [1, V], or [1, Vd] over the draft vocabulary
                if self.vocab is None and mid is not None and mid < logits.shape[-1]:
                    logits[:, mid] = float("-inf")
                t, probs = pick(logits, params, gen)
                if self.vocab is not None:  # back to token ids / full-vocabulary distributions
                    t = self.vocab[t]
                    if probs is not None:
                        full = probs.new_zeros(1, self.model.lm_head.weight.shape[0])
                        probs = full.index_copy_(1, self.vocab, probs)
                tokens.append(int(t[0]))
                confs.append(float(torch.softmax(logits, -1).max()))
                if probs is not None:
                    dists.append(probs)
                tok = t.to(dev)
        self.draft_s += time.perf_counter() - t0
        self.draft_calls += 1
        return Guesses(tokens, confs, torch.cat(dists) if dists else None)


# ---- saving and loading ------------------------------------------------------------------------

def heads_files(heads: MTPHeads, model: Transformer, meta: dict | None = None) -> dict:
    tensors = dict(heads.state_dict())
    if heads.draft_vocab is not None:
        tensors["draft_vocab"] = heads.draft_vocab.cpu()
    cfg = {"format": FORMAT, "version": 1, **asdict(heads.config), "n_params": heads.n_params(),
           "draft_vocab": 0 if heads.draft_vocab is None else len(heads.draft_vocab),
           "vocab_size": model.config.vocab_size, "base_hash": base_hash(model), "meta": meta or {}}
    return {WEIGHTS: tensors, CONFIG: cfg}


def read_heads_config(path) -> dict:
    path = Path(path)
    if not (path / CONFIG).exists():
        raise ValueError(f"no {CONFIG} in heads directory {path}")
    cfg = json.loads((path / CONFIG).read_text())
    if cfg.get("format") != FORMAT:
        raise ValueError(f"{path / CONFIG} is not an mtp heads config")
    return cfg


def load_heads(model: Transformer, path) -> MTPHeads:
    """Heads saved in `path`, checked against the base model (same weights hash), on its device."""
    from safetensors.torch import load_file
    path = Path(path)
    cfg = read_heads_config(path)
    check_trained_on(model, cfg, path, "heads", WEIGHTS)
    heads = MTPHeads(HeadsConfig.from_dict(cfg))
    state = load_file(str(path / WEIGHTS))
    vocab = state.pop("draft_vocab", None)
    if vocab is not None:
        if vocab.dtype != torch.int64 or vocab.dim() != 1 or not len(vocab) \
                or int(vocab.max()) >= model.lm_head.weight.shape[0]:
            raise ValueError(f"draft_vocab in {path} is not a list of this model's token ids")
        heads.draft_vocab = vocab
    try:
        heads.load_state_dict({k: v.float() for k, v in state.items()})
    except RuntimeError as e:
        raise ValueError(f"heads tensors in {path} do not match their config: {str(e).splitlines()[0]}")
    w = model.embed_tokens.weight
    return heads.to(w.device, w.dtype).eval().requires_grad_(False)


def load_heads_proposer(model: Transformer, path, readout_dtype: str = "bfloat16") -> HeadsProposer:
    """What `Engine.load` calls for `--proposer heads`; the base model is not modified."""
    return HeadsProposer(model, load_heads(model, path), readout_dtype)


# ---- the hidden-state cache --------------------------------------------------------------------

def features_key(model: Transformer, examples) -> str:
    h = hashlib.sha256(f"{base_hash(model)}:{MAX_AHEAD}:".encode())
    for ex in examples:
        h.update(json.dumps([list(ex.prompt_ids), list(ex.response_ids)]).encode())
    return h.hexdigest()[:16]


def extract_features(model: Transformer, examples, batch_size: int = 8, progress=None) -> dict:
    """Run the frozen trunk once over prompt + response of every example.

    Returns {"hidden": [N, dim] float32, "ahead": [N, MAX_AHEAD + 1] int64, "example": [N] int64,
    "agree": [N] bool}: one row per response position i - 1 (the last prompt token up to the last
    but one response token). ahead[r, j] = the token at i + j (-1 past the end): ahead[r, 0] is what
    the trunk predicts from hidden[r], ahead[r, d] what depth d must guess. `agree` says whether the
    trunk's greedy token at that row equals ahead[r, 0] (1.0 on self-generated answers, up to ties)."""
    hid, ahead, owner, agree = [], [], [], []
    order = sorted(range(len(examples)), key=lambda i: -(len(examples[i].prompt_ids) + len(examples[i].response_ids)))
    rows_of: dict[int, tuple] = {}
    dev = model.device
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            seqs = [list(examples[i].prompt_ids) + list(examples[i].response_ids) for i in idx]
            firsts = [len(examples[i].prompt_ids) - 1 for i in idx]
            T = max(len(s) for s in seqs)
            N = max(len(s) - 1 - f for s, f in zip(seqs, firsts))
            if N <= 0:
                continue
            tokens = torch.zeros(len(seqs), T, dtype=torch.long)
            for j, s in enumerate(seqs):
                tokens[j, :len(s)] = torch.tensor(s)
            # rows f .. len-2 of each sequence (right padding never affects earlier positions)
            out_index = torch.tensor([[min(f + r, max(len(s) - 2, f)) for r in range(N)] for s, f in zip(seqs, firsts)])
            logits, h = model(tokens.to(dev), out_index=out_index.to(dev), return_hidden=True)
            pred = logits.argmax(-1).cpu()  # [B, N]
            h = h.float().cpu()
            for j, (i, s, f) in enumerate(zip(idx, seqs, firsts)):
                n = len(s) - 1 - f
                if n <= 0:
                    continue
                a = torch.full((n, MAX_AHEAD + 1), -1, dtype=torch.long)
                for r in range(n):
                    nxt = s[f + 1 + r: f + 2 + r + MAX_AHEAD]
                    a[r, :len(nxt)] = torch.tensor(nxt)
                rows_of[i] = (h[j, :n].clone(), a, pred[j, :n] == a[:, 0])
            if progress:
                progress(min(b + batch_size, len(order)), len(order))
    for i in range(len(examples)):
        if i in rows_of:
            hh, a, ag = rows_of[i]
            hid.append(hh)
            ahead.append(a)
            agree.append(ag)
            owner.append(torch.full((len(a),), i, dtype=torch.long))
    if not hid:
        raise ValueError("no training rows: every example has an empty response")
    return {"hidden": torch.cat(hid), "ahead": torch.cat(ahead), "example": torch.cat(owner),
            "agree": torch.cat(agree)}


def cached_features(model: Transformer, examples, cache_dir, batch_size: int = 8, progress=None) -> tuple[dict, Path]:
    """extract_features, computed once per (base model, examples) and kept as safetensors."""
    from safetensors.torch import load_file, save_file
    path = Path(cache_dir) / "heads-features" / f"{features_key(model, examples)}.safetensors"
    if path.exists():
        feats = load_file(str(path))
        feats["agree"] = feats["agree"].bool()
        return feats, path
    feats = extract_features(model, examples, batch_size, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{id(feats)}")
    save_file({k: v.contiguous() for k, v in feats.items()}, str(tmp),
              metadata={"examples": str(len(examples)), "base_hash": base_hash(model)})
    tmp.replace(path)
    return feats, path


# ---- training ----------------------------------------------------------------------------------

@dataclass
class TrainHeadsConfig:
    depths: int = 2
    blocks: int = 0
    width: int = 0
    steps: int = 400
    batch_size: int = 256  # rows (token positions) per step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 20
    save_every: int = 100
    val_fraction: float = 0.1  # share of examples held out for the acceptance estimate
    seed: int = 0
    draft_vocab: int = 0  # > 0: draft only from the N most frequent target tokens (0 = whole vocabulary)

    def __post_init__(self):
        if not 1 <= self.depths <= MAX_AHEAD:
            raise ValueError(f"--depths must be in 1..{MAX_AHEAD}, got {self.depths}")
        if self.blocks < 0 or self.width < 0:
            raise ValueError("--blocks and --width must be >= 0")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.save_every < 1:
            raise ValueError(f"--save-every must be >= 1, got {self.save_every}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.draft_vocab < 0:
            raise ValueError(f"--draft-vocab must be >= 0, got {self.draft_vocab}")


def split_rows(feats: dict, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices (train, val), split by example so held-out answers are never trained on."""
    n_ex = int(feats["example"].max()) + 1
    perm = torch.randperm(n_ex, generator=torch.Generator().manual_seed(seed))
    n_val = int(round(n_ex * val_fraction)) if n_ex > 1 else 0
    is_val = torch.zeros(n_ex, dtype=torch.bool)
    is_val[perm[:n_val]] = True
    row_val = is_val[feats["example"]]
    return (~row_val).nonzero().squeeze(1), row_val.nonzero().squeeze(1)


def batch_rows(train_rows: torch.Tensor, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The rows of optimizer step `step`: epochs of seeded permutations, so a resumed run sees
    exactly the batches an uninterrupted one would."""
    n = len(train_rows)
    start = step * batch_size
    out: list[int] = []
    while len(out) < batch_size:
        epoch, offset = divmod(start, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        take = perm[offset:offset + batch_size - len(out)]
        out.extend(take.tolist())
        start += len(take)
    return train_rows[torch.tensor(out, dtype=torch.long)]


def draft_vocab_from(feats: dict, rows: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target tokens of these rows (ties: lower id first), sorted by id.
    Every response token is ahead[r, 0] of exactly one row, so this counts the training answers."""
    tokens = feats["ahead"][rows, 0]
    tokens = tokens[tokens >= 0]
    counts = torch.bincount(tokens)
    ids = torch.arange(len(counts))
    order = sorted(ids[counts > 0].tolist(), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


def heads_loss(heads: MTPHeads, model, feats: dict, rows: torch.Tensor, readout) -> tuple[torch.Tensor, list]:
    """Mean cross-entropy over depths against the trunk's own continuation; per-depth accuracy."""
    D = heads.config.depths
    dev = model.device
    h = feats["hidden"][rows].to(dev)  # [B, dim]
    ahead = feats["ahead"][rows].to(dev)  # [B, MAX_AHEAD + 1]
    logits = heads(model, h, ahead[:, :D], readout)
    mid = model.config.mask_token_id
    losses, accs = [], []
    for d, lg in enumerate(logits, start=1):
        target = ahead[:, d]  # [B]
        valid = target >= 0
        if mid is not None and mid < lg.shape[-1]:
            lg = lg.clone()
            lg[:, mid] = float("-inf")
        if bool(valid.any()):
            losses.append(F.cross_entropy(lg[valid].float(), target[valid]))
            accs.append((lg[valid].argmax(-1) == target[valid]).float().mean().item())
        else:
            accs.append(float("nan"))
    loss = torch.stack(losses).mean() if losses else logits[0].sum() * 0
    return loss, accs


def evaluate(heads: MTPHeads, model, feats: dict, rows: torch.Tensor, readout, batch_size: int = 512) -> dict:
    """Held-out acceptance: per-depth accuracy given the earlier tokens right, and the leading
    run of correct depths (= drafts `verify:D+1` would accept, on greedy self-generated text)."""
    D = heads.config.depths
    if heads.draft_vocab is not None:  # score as the proposer will: only draft-vocabulary tokens
        base_readout = readout or (lambda h: model.lm_head(model.norm(h)))

        def readout(h, _r=base_readout):
            lg = _r(h)
            allowed = torch.zeros(lg.shape[-1], dtype=torch.bool, device=lg.device)
            allowed[heads.draft_vocab.to(lg.device)] = True
            return lg.masked_fill(~allowed, float("-inf"))
    correct = torch.zeros(D)
    counted = torch.zeros(D)
    lead_sum, lead_n = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(rows), batch_size):
            r = rows[b:b + batch_size]
            ahead = feats["ahead"][r].to(model.device)
            logits = heads(model, feats["hidden"][r].to(model.device), ahead[:, :D], readout)
            ok = torch.stack([lg.argmax(-1) == ahead[:, d + 1] for d, lg in enumerate(logits)], 1)  # [B, D]
            valid = ahead[:, 1:D + 1] >= 0
            correct += (ok & valid).sum(0).cpu().float()
            counted += valid.sum(0).cpu().float()
            full = valid.all(1)  # rows where every depth has a target
            lead = torch.cumprod((ok & valid).long(), 1).sum(1)
            lead_sum += float(lead[full].sum())
            lead_n += int(full.sum())
    acc = (correct / counted.clamp(min=1)).tolist()
    return {"val_acc_by_depth": [round(a, 4) for a in acc],
            "val_tokens_per_pass": round(1 + lead_sum / max(lead_n, 1), 4), "val_rows": len(rows)}


def _opt_tensors(opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    sd = opt.state_dict()
    tensors = {f"opt.{i}.{name}": t for i, st in sd["state"].items() for name, t in st.items()}
    return tensors, {"param_groups": sd["param_groups"]}


def _load_opt(opt: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    state: dict = {}
    for key, t in tensors.items():
        if key.startswith("opt."):
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = t
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def lr_at(step: int, cfg: TrainHeadsConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of --lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train_heads(model: Transformer, feats: dict, cfg: TrainHeadsConfig, out, resume: bool = False,
                meta: dict | None = None, log=print, on_step=None) -> dict:
    """Train heads on cached trunk features; write `out` (config.json + heads.safetensors) at the end
    and a resumable `out/checkpoint` every `save_every` steps and on Ctrl-C. Returns the final metrics.

    on_step(step) is called after every optimizer step (tests use it to interrupt a run)."""
    from safetensors.torch import load_file
    out = Path(out)
    ckpt = out / CHECKPOINT
    model.requires_grad_(False)
    hcfg = HeadsConfig.for_model(model.config, cfg.depths, cfg.blocks, cfg.width)
    torch.manual_seed(cfg.seed)
    heads = MTPHeads(hcfg).to(model.device)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    start = 0
    if resume:
        if not (ckpt / "trainer.json").exists():
            raise ValueError(f"--resume: no checkpoint in {ckpt}")
        state = json.loads((ckpt / "trainer.json").read_text())
        if state["heads"] != asdict(hcfg) or state["train"]["seed"] != cfg.seed \
                or state["train"]["batch_size"] != cfg.batch_size:
            raise ValueError(f"--resume: checkpoint in {ckpt} was made with other --depths/--blocks/--width/"
                             "--batch-size/--seed")
        tensors = load_file(str(ckpt / "state.safetensors"))
        heads.load_state_dict({k[len("heads."):]: v for k, v in tensors.items() if k.startswith("heads.")})
        _load_opt(opt, tensors, state)
        start = state["step"]
        log(f"resuming at step {start}")
    elif (out / CONFIG).exists() or ckpt.exists():
        raise ValueError(f"{out} already holds heads; pass --resume to continue or choose another --out")
    train_rows, val_rows = split_rows(feats, cfg.val_fraction, cfg.seed)
    if len(train_rows) == 0:
        raise ValueError("no training rows after the validation split; use more --limit or less --val-fraction")
    readout = bf16_readout(model) if model.device.type == "cpu" else None
    log(f"heads: {hcfg.label()}, {heads.n_params():,} parameters; {len(train_rows):,} train rows, "
        f"{len(val_rows):,} val rows; {cfg.steps} steps of {cfg.batch_size}")

    def save_checkpoint(step: int) -> None:
        tensors, opt_meta = _opt_tensors(opt)
        tensors.update({f"heads.{k}": v for k, v in heads.state_dict().items()})
        write_dir_atomic(ckpt, {"state.safetensors": tensors,
                                "trainer.json": {"step": step, "heads": asdict(hcfg), "train": asdict(cfg),
                                                 **opt_meta}})

    heads.train()
    t0, done, ema, stepping = time.perf_counter(), start, None, False
    try:
        for step in range(start, cfg.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            rows = batch_rows(train_rows, step, cfg.batch_size, cfg.seed)
            loss, accs = heads_loss(heads, model, feats, rows, readout)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            stepping = True
            opt.step()
            stepping = False
            ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
            done = step + 1
            if done % 10 == 0 or done == cfg.steps:
                rate = (done - start) / (time.perf_counter() - t0)
                log(f"step {done}/{cfg.steps} loss {ema:.3f} acc {' '.join(f'{a:.2f}' for a in accs)} "
                    f"lr {lr_at(step, cfg):.2e} {rate:.2f} steps/s eta {(cfg.steps - done) / rate:.0f}s")
            if done % cfg.save_every == 0 and done < cfg.steps:
                save_checkpoint(done)
            if on_step is not None:
                on_step(done)
    except KeyboardInterrupt:
        if not stepping:  # weights are consistent after `done` steps (else keep the last checkpoint)
            save_checkpoint(done)
        log(f"interrupted after step {done}: checkpoint in {ckpt}; rerun with --resume")
        raise
    heads.eval()
    if cfg.draft_vocab:
        heads.draft_vocab = draft_vocab_from(feats, train_rows, cfg.draft_vocab)
        log(f"draft vocabulary: {len(heads.draft_vocab)} tokens")
    metrics = evaluate(heads, model, feats, val_rows, readout) if len(val_rows) else {}
    metrics.update({"steps": cfg.steps, "train_rows": len(train_rows), "n_params": heads.n_params(),
                    "train_s": round(time.perf_counter() - t0, 1)})
    log("held-out: " + json.dumps(metrics))
    # the finished directory replaces `out` whole: the resumable checkpoint goes with it
    write_dir_atomic(out, heads_files(heads, model, {**(meta or {}), "train": asdict(cfg), "metrics": metrics}))
    return metrics


# ---- CLI ---------------------------------------------------------------------------------------

def add_cli(sub) -> None:
    p = sub.add_parser("train-heads", help="train DeepSeek-style MTP heads on the frozen model's hidden states",
                       description="Self-distil MTP heads: the targets are the base model's own greedy answers; "
                                   "its hidden states are computed once and cached, then the heads train on them.")
    p.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file, or smollm2-135m (default)")
    p.add_argument("--data", required=True, help="JSONL file of prompts (e.g. $MTP_DATA_DIR/gsm8k/train.jsonl)")
    p.add_argument("--prompt-field", default="question")
    p.add_argument("--response-field", default="answer", help="used when not --self-generate")
    p.add_argument("--self-generate", action="store_true",
                   help="targets = the model's own greedy answers (cached on disk); default: the data's responses")
    p.add_argument("--limit", type=int, default=200, help="number of prompts to use")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length of self-generated answers")
    p.add_argument("--gen-batch-size", type=int, default=16, help="prompts per batch when self-generating")
    p.add_argument("--depths", type=int, default=2, help="D: tokens guessed per pass (1..8)")
    p.add_argument("--blocks", type=int, default=0, help="L: transformer blocks per depth (0 = projection only)")
    p.add_argument("--width", type=int, default=0, help="block width (0 = the model's width)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=256, help="token positions per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of answers held out for evaluation")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="draft only from the N most frequent target tokens: cheaper drafting (0 = all)")
    p.add_argument("--out", required=True, help="output directory (config.json + heads.safetensors)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help="answers and hidden-state cache (default $MTP_CACHE_DIR or "
                                                     "~/.cache/mtp)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run_train_heads)


def run_train_heads(args) -> int:
    from mtp.training import data
    from mtp.core import loading
    from mtp.core.engine import Engine, EngineConfig
    cfg = TrainHeadsConfig(depths=args.depths, blocks=args.blocks, width=args.width, steps=args.steps,
                           batch_size=args.batch_size, lr=args.lr, save_every=args.save_every,
                           val_fraction=args.val_fraction, seed=args.seed, draft_vocab=args.draft_vocab)
    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    out = Path(args.out)
    if not args.resume and ((out / CONFIG).exists() or (out / CHECKPOINT).exists()):
        raise ValueError(f"{out} already holds heads; pass --resume to continue or choose another --out")
    prompts = data.load_prompts(args.data, args.prompt_field, None if args.self_generate else args.response_field,
                                args.limit)
    engine = Engine.load(EngineConfig(model=args.model, adapter="none", threads=args.threads, device=args.device))
    HeadsConfig.for_model(engine.model.config, cfg.depths, cfg.blocks, cfg.width)  # bad sizes fail before work
    t0 = time.perf_counter()
    # the same call as `mtp train` makes, so both share the self-generated answers on disk
    examples = data.build_examples(engine, prompts, args.self_generate, args.max_new_tokens, args.gen_batch_size,
                                   Path(args.cache_dir) / "selfgen" if args.cache_dir else None)
    cache_dir = Path(args.cache_dir) if args.cache_dir else loading.cache_root()
    print(f"{len(examples)} examples ready in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    t0 = time.perf_counter()

    def progress(i, n):
        print(f"\rhidden states {i}/{n}", end="" if i < n else "\n", file=sys.stderr, flush=True)

    feats, path = cached_features(engine.model, examples, cache_dir, progress=progress)
    agree = feats["agree"].float().mean().item()
    print(f"{len(feats['hidden']):,} rows of hidden states in {time.perf_counter() - t0:.0f}s ({path}); "
          f"trunk agrees with the targets on {agree:.1%} of rows", file=sys.stderr)
    meta = {"model": args.model, "data": Path(args.data).name, "self_generate": args.self_generate,
            "limit": args.limit, "max_new_tokens": args.max_new_tokens}
    train_heads(engine.model, feats, cfg, out, resume=args.resume, meta=meta,
                log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"heads written to {out}")
    return 0
