"""DeepSeek-style MTP heads: small modules that guess the tokens after the next one from the trunk's
last hidden state, and the proposer that drafts with them (no extra trunk pass).

Depth d (DeepSeek-V3) takes the previous depth's hidden state h_{d-1} (h_0 = the trunk's
last-layer hidden state, before the final norm) and the embedding of the token that follows it,
and returns h_d, read out through the base model's *shared* final norm and output head:

    h_d = Out(Blocks(Proj([RMSNorm(h_{d-1}) ; RMSNorm(embed(t_d))])))   # Proj: 2*dim -> width
    p_d = softmax(lm_head(norm(h_d)))                                    # guess for t_{d+1}

Size knobs: `blocks` (L; 0 = the projection alone), `width` (< dim: the blocks run narrower and
`Out` projects back to dim) and `depths` (D, each chained on the previous one's hidden state and
token, so the causal chain is kept). The blocks are `mtp.core.runtime.model.Block`s at `width`.

A head block attends only to its own position (each position is a length-1 sequence), so the
heads need no KV cache of their own and decoding runs them on the one hidden state the verifying
pass already produced. With one key the attention weights are 1, so q/k are inert: a block acts
as v/o projections plus an MLP. A heads directory holds `config.json` (format `mtp-heads`, sizes,
the base weights' hash) and `heads.safetensors`; training lives in `mtp.training.heads_train`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mtp.core.decoding import tree
from mtp.core.decoding.proposers.base import DraftRequest, Guesses, Proposer
from mtp.core.decoding.sampling import pick
from mtp.core.runtime.artifacts import base_hash, check_finite, check_trained_on, load_safetensors, read_config
from mtp.core.runtime.model import Block, Linear, ModelConfig, RMSNorm, Transformer

FORMAT = "mtp-heads"
WEIGHTS = "heads.safetensors"
CONFIG = "config.json"
MAX_AHEAD = 8  # the feature cache stores this many tokens ahead of each row (so depths <= 8)
TOP_K = 4  # a tree's candidates under each frontier node (HeadsProposer.propose)


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
            raise ValueError(f"width {self.width} does not split into {self.n_heads} attention heads of even size")

    @classmethod
    def for_model(cls, model_cfg: ModelConfig, depths=1, blocks=0, width=0) -> "HeadsConfig":
        """Derive block shapes from the base model: head size kept, MLP scaled with the width."""
        w = width or model_cfg.dim
        n_heads = max(1, w // model_cfg.head_dim)
        while n_heads > 1 and (w % n_heads or (w // n_heads) % 2):
            n_heads -= 1
        inter = max(1, round(model_cfg.intermediate_size * w / model_cfg.dim))
        return cls(
            dim=model_cfg.dim,
            depths=depths,
            blocks=blocks,
            width=width,
            n_heads=n_heads,
            intermediate_size=inter,
            norm_eps=model_cfg.norm_eps,
        )

    def block_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=1,
            dim=self.width,
            n_layers=0,
            n_heads=self.n_heads,
            n_kv_heads=self.n_heads,
            intermediate_size=self.intermediate_size,
            norm_eps=self.norm_eps,
        )

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
                self.proj.weight[:, : cfg.dim].copy_(torch.eye(cfg.dim))
                self.proj.weight[:, cfg.dim :].mul_(0.1)

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
    """The shared final norm + output head with the head matrix in bfloat16 (drafting is dominated by
    this one matmul, and CPUs with bf16 matrix units run it much faster than in float32).
    rows: only these output rows (the draft vocabulary) -> logits [N, len(rows)]."""
    w = model.lm_head.weight.detach()
    w = (w if rows is None else w[rows.to(w.device)]).to(torch.bfloat16)  # [V or Vd, dim]

    def readout(h):  # h: [N, dim] -> [N, V] float32
        return F.linear(model.norm(h).to(torch.bfloat16), w).float()

    return readout


class HeadsProposer(Proposer):
    """Guesses from MTP heads on the hidden state the verifying pass already produced (no trunk pass).

    A chain request of n chains up to n depths from view.hidden (the last accepted position's state,
    whose prediction is view.context[-1]): depth 1 sees that token, depth d the guess of depth d-1.
    A tree request of n nodes grows them depth by depth (`mtp.core.decoding.tree.grow`, EAGLE-2's idea): depth
    d's head runs on every frontier node (its parent's head state and its own token) and gives its
    TOP_K next tokens; the candidates with the highest path probability are kept, ceil(n / depths) per
    depth. Deterministic (top-k, never sampled), so `tree:N` stays exact under sampling too.
    With a draft vocabulary (`--draft-vocab N`, the N most frequent target tokens; FR-Spec's idea)
    the readout scores only those rows of the output head: drafting gets ~V/N times cheaper, and
    `verify` stays lossless (a draft outside it is simply never proposed; under sampling the
    proposal distribution is zero there, which rejection sampling handles exactly).
    Rows of a pass that share this proposer draft together (`prepare` / `draft_prepared`): one head
    and readout call per depth for all of them, instead of one per row.
    `draft_s` / `draft_calls` accumulate the drafting time and the rows drafted, for the benchmarks."""

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
        self._pending: list[DraftRequest] = []  # taken by `prepare`, drafted by `draft_prepared`
        self._ready: dict[tuple, tuple[DraftRequest, Guesses]] = {}  # (id(view), tree, n) -> its answer

    @property
    def depths(self) -> int:
        return self.heads.config.depths

    def modules(self) -> list:
        return [self.heads]

    def set_readout(self, readout) -> None:
        """Read drafts out with `readout` (h [N, dim] -> logits [N, V or Vd] float32, the final norm
        included; rows `self.vocab` of the output head when there is a draft vocabulary):
        `mtp.core.runtime.weights.attach_proposer` hands the trunk's own head kernel here."""
        self.readout = readout

    def _nodes(self, request: DraftRequest) -> int:
        """Guesses `request` can get: its n (a chain: at most the depths)."""
        return request.n if request.tree else min(request.n, self.depths)

    def prepare(self, request: DraftRequest) -> list[Proposer]:
        """Take the row's request for the next `draft_prepared` (not: nothing to draft, or sampling
        whose random draws a batch could reorder: no generator of its own, or one already taken)."""
        if request.view.hidden is None or self._nodes(request) <= 0:
            return []
        if (
            not request.tree
            and not request.params.greedy
            and (request.gen is None or any(r.gen is request.gen for r in self._pending))
        ):
            return []
        self._pending.append(request)
        return [self]

    def draft_prepared(self) -> None:
        """Draft every taken request in one `_draft` (each depth's head and readout once over all the
        rows' frontiers)."""
        requests, self._pending = self._pending, []
        self._ready = {}
        if not requests:
            return
        t0 = time.perf_counter()
        out = self._draft(requests)
        self.draft_s += time.perf_counter() - t0
        self.draft_calls += len(requests)
        for r, g in zip(requests, out):
            self._ready[(id(r.view), r.tree, r.n)] = (r, g)

    def _prepared(self, request: DraftRequest) -> Guesses | None:
        """The answer `draft_prepared` drafted for this request, if it did (each handed out once)."""
        r = request
        hit = self._ready.pop((id(r.view), r.tree, r.n), None)
        if (
            hit is None
            or hit[0].view is not r.view
            or (not r.tree and (hit[0].params != r.params or hit[0].gen is not r.gen))
        ):
            return None
        return hit[1]

    def propose(self, request: DraftRequest) -> Guesses:
        """The request's guesses (`_draft`), or what `draft_prepared` drafted for it."""
        if self._nodes(request) <= 0 or request.view.hidden is None:
            return Guesses.none()
        hit = self._prepared(request)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        out = self._draft([request])[0]
        self.draft_s += time.perf_counter() - t0
        self.draft_calls += 1
        return out

    def _draft(self, requests: list[DraftRequest]) -> list[Guesses]:
        """Every request's guesses (trees by `tree.Grower`, chains by `pick`), each depth's head and
        readout run once over the frontier nodes of all requests still growing, concatenated in request
        order. E.g. a tree whose frontier holds 3 nodes and a chain (1 node): depth d runs on 4 rows,
        rows 0-2 the tree's, row 3 the chain's. Per request the result is what drafting it alone gives,
        up to the rounding of a matmul over more rows (CPU GEMM kernels may sum a [1, dim] row in
        another order than a [4, dim] block; tests/test_draft_batching.py)."""
        dev = self.model.device
        mid = self.model.config.mask_token_id
        R = len(requests)
        growers = [
            tree.Grower(r.n, self.depths, r.view.context[-1], TOP_K, self.vocab) if r.tree else None for r in requests
        ]
        depth = [self.depths if r.tree else min(r.n, self.depths) for r in requests]  # chains: n at most
        chain_tok = [r.view.context[-1] for r in requests]  # a chain's last token (its next depth's input)
        chains: list[tuple[list, list, list]] = [([], [], []) for _ in requests]  # tokens, confidences, dists
        h = torch.stack([r.view.hidden for r in requests]).to(dev, self.model.embed_tokens.weight.dtype)  # [R, dim]
        first = list(range(R))  # where each request's rows start in h
        with torch.inference_mode():
            for d, head in enumerate(self.heads.depths):
                live = [i for i in range(R) if (not growers[i].done if growers[i] else d < depth[i])]
                if not live:
                    break
                index, toks, spans = [], [], []  # spans: (request, first row, rows) in this depth's h
                for i in live:
                    rows, tk = (growers[i].rows, growers[i].toks) if growers[i] else ([0], [chain_tok[i]])
                    spans.append((i, len(index), len(rows)))
                    index += [first[i] + r for r in rows]
                    toks += tk
                h = head(h[index], self.model.embed_tokens(torch.tensor(toks, device=dev)))  # [F, dim]
                logits = self.readout(h).cpu()  # [F, V], or [F, Vd] over the draft vocabulary
                if self.vocab is None and mid is not None and mid < logits.shape[-1]:
                    logits[:, mid] = float("-inf")
                for i, start, rows in spans:
                    first[i] = start
                    lg = logits[start : start + rows]  # [rows, V]
                    if growers[i] is not None:
                        growers[i].step(torch.log_softmax(lg.float(), -1))
                        continue
                    r = requests[i]
                    t, probs = pick(lg, r.params, r.gen)
                    if self.vocab is not None:  # back to token ids / full-vocabulary distributions
                        t = self.vocab[t]
                        if probs is not None:
                            full = probs.new_zeros(1, self.model.lm_head.weight.shape[0])
                            probs = full.index_copy_(1, self.vocab, probs)
                    chains[i][0].append(int(t[0]))
                    chains[i][1].append(float(torch.softmax(lg, -1).max()))
                    if probs is not None:
                        chains[i][2].append(probs)
                    chain_tok[i] = int(t[0])
        return [
            Guesses(g.tokens, g.confs, None, g.parents)
            if g is not None
            else Guesses(c[0], c[1], torch.cat(c[2]) if c[2] else None)
            for g, c in zip(growers, chains)
        ]


def heads_files(heads: MTPHeads, model: Transformer, meta: dict | None = None) -> dict:
    tensors = dict(heads.state_dict())
    if heads.draft_vocab is not None:
        tensors["draft_vocab"] = heads.draft_vocab.cpu()
    cfg = {
        "format": FORMAT,
        "version": 1,
        **asdict(heads.config),
        "n_params": heads.n_params(),
        "draft_vocab": 0 if heads.draft_vocab is None else len(heads.draft_vocab),
        "vocab_size": model.config.vocab_size,
        "base_hash": base_hash(model),
        "meta": meta or {},
    }
    return {WEIGHTS: tensors, CONFIG: cfg}


def read_heads_config(path) -> dict:
    return read_config(path, FORMAT, "heads")


def load_heads(model: Transformer, path) -> MTPHeads:
    """Heads saved in `path`, checked against the base model (same weights hash), on its device."""
    path = Path(path)
    cfg = read_heads_config(path)
    check_trained_on(model, cfg, path, "heads", WEIGHTS)
    try:
        heads = MTPHeads(HeadsConfig.from_dict(cfg))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / CONFIG}: bad heads sizes ({str(e).splitlines()[0]})") from None
    state = load_safetensors(path / WEIGHTS)
    check_finite(state, path / WEIGHTS)
    vocab = state.pop("draft_vocab", None)
    if vocab is not None:
        if (
            vocab.dtype != torch.int64
            or vocab.dim() != 1
            or not len(vocab)
            or int(vocab.max()) >= model.lm_head.weight.shape[0]
        ):
            raise ValueError(f"draft_vocab in {path} is not a list of this model's token ids")
        heads.draft_vocab = vocab
    try:
        heads.load_state_dict({k: v.float() for k, v in state.items()})
    except RuntimeError as e:
        raise ValueError(f"heads tensors in {path} do not match their config: {str(e).splitlines()[0]}") from e
    w = model.embed_tokens.weight
    return heads.to(w.device, w.dtype).eval().requires_grad_(False)


def load_heads_proposer(model: Transformer, path, readout_dtype: str = "bfloat16") -> HeadsProposer:
    """What `Engine.load` calls for `--proposer heads`; the base model is not modified."""
    return HeadsProposer(model, load_heads(model, path), readout_dtype)
