"""EAGLE-3 drafter (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of LLMs via
Training-Time Test") and the proposer that drafts with it.

The drafter is one decoder layer that runs beside the trunk with a KV cache of its own. At trunk
position p it reads the trunk's residual streams after a low, a middle and a high layer (`aux_layers`,
vLLM's `eagle_aux_hidden_state_layer_ids`; for 30 layers 2, 15, 27) fused by `fc`, together with the
embedding of the token that follows p, and guesses the token after that one:

    g_p      = fc(cat[aux_p(l1), aux_p(l2), aux_p(l3)])                # [3*dim] -> [dim]
    x        = cat[input_layernorm(embed(t_{p+1})), hidden_norm(g_p)]  # [2*dim]: the embedding first
    r        = g_p + o_proj(attention(q/k/v_proj(x)))                   # causal over the drafter's cache
    h_p      = r + mlp(post_attention_layernorm(r))                     # "prenorm": the next step's g
    logits_p = lm_head(norm(h_p))                                       # [draft_vocab] -> t_{p+2}

Drafting more tokens repeats the layer at p+1, p+2, ... with g = the previous step's h and the token it
drafted. This is what vLLM's `llama_eagle3.py` computes (attention scaled by head_dim^-1/2, RoPE at
the trunk's positions, the residual taken before `hidden_norm`), so a drafter `mtp export --format
vllm-eagle3` writes drafts the same tokens there. The output head covers a reduced draft vocabulary
(the N most frequent tokens of the training answers): draft id d is target id d + d2t[d]; t2d marks
the target ids that have a draft id. The embedding is the trunk's (shared, not stored).

Cache rule: the drafter's KV at positions the trunk committed (computed from the trunk's real
features) is kept; the KV of drafted positions is scratch, dropped after the pass (rollback = length).
Under `tree:N` the committed positions of a pass are its accepted path (the loop gathers their features).
A drafter directory holds `config.json` (vLLM's EAGLE-3 Llama config plus `format: mtp-eagle3`
and the base weights' hash) and `model.safetensors` under vLLM's names; training lives in
`mtp.training.eagle3_train`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mtp.core.decoding.proposers.base import DraftRequest, Guesses, PassView, Proposer
from mtp.core.decoding.sampling import pick
from mtp.core.runtime.artifacts import (
    ArtifactError,
    base_hash,
    check_finite,
    check_trained_on,
    load_safetensors,
    read_config,
)
from mtp.core.runtime.model import Linear, ModelConfig, RMSNorm, Transformer, rope_inv_freq, rotate_half

FORMAT = "mtp-eagle3"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # what vLLM's registry maps to its EAGLE-3 Llama drafter
TOP_K = 4  # a tree's candidates under each expanded node (Eagle3Proposer._tree)


def default_aux_layers(n_layers: int) -> list[int]:
    """Low, middle, high; id k = the residual stream after k layers. vLLM's default (2, n // 2, n - 3)
    where those are distinct, else 0, n // 2, n - 1: from 3 layers up, three distinct layers below the
    last (what vLLM can feed). A trunk of fewer layers gets 0..n (--proposer eagle3 only)."""
    low, mid, high = 2, n_layers // 2, n_layers - 3
    if low < mid < high:
        return [low, mid, high]
    if n_layers >= 3:
        return [0, n_layers // 2, n_layers - 1]
    return list(range(n_layers + 1))


def exportable_layers(aux_layers, n_layers: int) -> bool:
    """Whether vLLM's EAGLE-3 drafter can be fed these layers: three, ascending, below the last."""
    aux = list(aux_layers)
    return len(aux) == 3 and all(a < b for a, b in zip(aux, aux[1:])) and aux[0] >= 0 and aux[-1] < n_layers


@dataclass
class Eagle3Config:
    dim: int  # the drafter's width (= the trunk's hidden size)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the trunk's vocabulary
    draft_vocab: int  # rows of the drafter's output head
    aux_layers: list[int] = field(default_factory=list)
    target_dim: int = 0  # the trunk's hidden size (0 = dim)
    target_layers: int = 0  # the trunk's number of layers (0 = unknown)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_seq_len: int = 2048

    def __post_init__(self):
        self.target_dim = self.target_dim or self.dim
        if not self.aux_layers:
            raise ValueError("aux_layers must name at least one trunk layer")
        if not 1 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(f"draft vocabulary must be in 1..{self.vocab_size}, got {self.draft_vocab}")
        if self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ValueError(f"{self.n_heads} heads do not share {self.n_kv_heads} kv heads of even size")

    @classmethod
    def for_model(cls, cfg: ModelConfig, draft_vocab: int, aux_layers=None) -> "Eagle3Config":
        aux = sorted(aux_layers) if aux_layers else default_aux_layers(cfg.n_layers)  # vLLM fuses them ascending
        bad = [k for k in aux if not 0 <= k <= cfg.n_layers]
        if bad:
            raise ValueError(f"--aux-layers {bad} outside 0..{cfg.n_layers} (the model's layers)")
        return cls(
            dim=cfg.dim,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            draft_vocab=min(draft_vocab, cfg.vocab_size),
            aux_layers=aux,
            target_layers=cfg.n_layers,
            norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            max_seq_len=cfg.max_seq_len,
        )

    def rope_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=1,
            dim=self.n_heads * self.head_dim,
            n_layers=0,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            intermediate_size=1,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
        )

    def to_hf(self) -> dict:
        """The Hugging Face / vLLM config.json fields of this drafter (a one-layer Llama)."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.dim,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_seq_len,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab,
            "target_hidden_size": self.target_dim,
            "target_num_hidden_layers": self.target_layers,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers), "use_aux_hidden_state": True},
        }

    @classmethod
    def from_hf(cls, hf: dict) -> "Eagle3Config":
        eagle = hf.get("eagle_config") or {}
        n_heads = hf["num_attention_heads"]
        return cls(
            dim=hf["hidden_size"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            draft_vocab=hf.get("draft_vocab_size") or hf["vocab_size"],
            aux_layers=list(eagle.get("eagle_aux_hidden_state_layer_ids") or []),
            target_dim=hf.get("target_hidden_size") or hf["hidden_size"],
            target_layers=int(hf.get("target_num_hidden_layers") or 0),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=hf.get("rope_scaling"),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        )


class Eagle3Drafter(nn.Module):
    """The one-layer drafter. Parameter names are vLLM's checkpoint names (`midlayer.` = its layers.0)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        H, hd = cfg.dim, cfg.head_dim
        self.fc = Linear(len(cfg.aux_layers) * cfg.target_dim, H, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm = RMSNorm(H, cfg.norm_eps)  # on the token embedding
        m.hidden_norm = RMSNorm(H, cfg.norm_eps)  # on the fused (or previous step's) hidden state
        m.post_attention_layernorm = RMSNorm(H, cfg.norm_eps)
        m.self_attn = nn.Module()
        m.self_attn.q_proj = Linear(2 * H, cfg.n_heads * hd, bias=False)
        m.self_attn.k_proj = Linear(2 * H, cfg.n_kv_heads * hd, bias=False)
        m.self_attn.v_proj = Linear(2 * H, cfg.n_kv_heads * hd, bias=False)
        m.self_attn.o_proj = Linear(cfg.n_heads * hd, H, bias=False)
        m.mlp = nn.Module()
        m.mlp.gate_proj = Linear(H, cfg.intermediate_size, bias=False)
        m.mlp.up_proj = Linear(H, cfg.intermediate_size, bias=False)
        m.mlp.down_proj = Linear(cfg.intermediate_size, H, bias=False)
        self.norm = RMSNorm(H, cfg.norm_eps)
        self.lm_head = Linear(H, cfg.draft_vocab, bias=False)
        # draft id d <-> target id d + d2t[d]; t2d[target id] = whether it has a draft id
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self._inv_freq = rope_inv_freq(cfg.rope_config())
        # the layer as one kernel call (core.runtime.weights.attach_proposer: `mtp::eagle3_layer`), or None: torch ops
        self.layer_kernel = None

    # ---- vocabulary ---------------------------------------------------------------------------
    def set_vocab(self, ids: torch.Tensor) -> None:
        """ids: [draft_vocab] target ids, ascending (draft id d = ids[d])."""
        ids = ids.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of every draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    # ---- the layer ----------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> cos, sin [B, 1, T, head_dim]
        freqs = positions.to(torch.float32).unsqueeze(-1) * self._inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().unsqueeze(1).to(dtype), emb.sin().unsqueeze(1).to(dtype)

    def qkv(self, emb: torch.Tensor, g: torch.Tensor, positions: torch.Tensor):
        """emb, g: [B, T, dim]; positions [B, T] -> q [B, H, T, hd], k/v [B, kv, T, hd] (RoPE applied)."""
        m = self.midlayer
        x = torch.cat([m.input_layernorm(emb.to(g.dtype)), m.hidden_norm(g)], dim=-1)  # [B, T, 2*dim]
        B, T, _ = x.shape
        hd = self.config.head_dim
        q = m.self_attn.q_proj(x).view(B, T, -1, hd).transpose(1, 2)
        k = m.self_attn.k_proj(x).view(B, T, -1, hd).transpose(1, 2)
        v = m.self_attn.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
        cos, sin = self.rope(positions, x.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """g [B, T, dim] (the residual), attn [B, H, T, hd] -> the new hidden state h [B, T, dim] (prenorm)."""
        m = self.midlayer
        B, _, T, _ = attn.shape
        r = g + m.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        x = m.post_attention_layernorm(r)
        return r + m.mlp.down_proj(F.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))  # [..., draft_vocab]

    def step(self, emb, g, positions, past_k=None, past_v=None, mask=None):
        """One pass of the layer over T new positions that follow `past_k/v` [B, kv, S-T, hd].
        mask: [T, S] bool (True = attend) over past + new keys; None = causal (all past visible,
        new row j sees new rows 0..j). Returns (h [B, T, dim], k, v of the new positions)."""
        q, k, v = self.qkv(emb, g, positions)
        K = k if past_k is None else torch.cat([past_k, k], 2)
        V = v if past_v is None else torch.cat([past_v, v], 2)
        S, T = K.shape[2], q.shape[2]
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # new row j sees S-T+j
        y = F.scaled_dot_product_attention(
            q, K, V, attn_mask=mask, enable_gqa=self.config.n_heads != self.config.n_kv_heads
        )
        return self.finish(g, y), k, v

    def step_cached(self, emb, g, positions, kc, vc, slots, mask):
        """One pass of the layer over T new positions (inference, batch 1) on a KV buffer: their keys and
        values go to `slots` [1, T] of kc, vc [1, kv, capacity, hd], and row j attends to the slots
        0..S-1 that mask [T, S] bool shows (its own slot included). emb, g [1, T, dim]; positions [1, T]
        the RoPE positions. Returns h [1, T, dim]. On the kernels (`layer_kernel`) one call, else the
        torch ops of `step`: the same computation (other rounding)."""
        T, S = mask.shape
        if self.layer_kernel is not None:
            cos, sin = self.rope(positions, torch.float32)
            rows = torch.zeros(1, dtype=torch.long)
            return self.layer_kernel(emb.float(), cos, sin, mask.view(1, 1, T, S), kc, vc, rows, slots, g.float())
        q, k, v = self.qkv(emb, g, positions)
        kc[0, :, slots[0]] = k[0].to(kc.dtype)
        vc[0, :, slots[0]] = v[0].to(vc.dtype)
        y = F.scaled_dot_product_attention(
            q,
            kc[:, :, :S].to(q.dtype),
            vc[:, :, :S].to(q.dtype),
            attn_mask=mask,
            enable_gqa=self.config.n_heads != self.config.n_kv_heads,
        )
        return self.finish(g, y)


class Eagle3Proposer(Proposer):
    """Drafts a chain of n tokens per pass, or a tree of n nodes (`_tree`, `tree:N`), with an EAGLE-3
    drafter; see the module docstring.

    Each pass: (1) run the drafter over the positions the trunk just committed (their features are
    `view.aux`, the token after each is in `view.context`) and keep their KV in the sequence's
    state; (2) draft token 1 from the last of them, then tokens 2..n one decoder-layer step each
    from its own hidden state, on scratch KV that the next pass drops. Drafts come from the draft
    vocabulary only, so `verify` stays lossless (under sampling the proposal is zero elsewhere,
    which rejection sampling handles exactly)."""

    name = "eagle3"
    has_confidence = True

    def __init__(self, model: Transformer, drafter: Eagle3Drafter):
        self.model, self.drafter = model, drafter.eval().requires_grad_(False)
        self.aux_layers = tuple(drafter.config.aux_layers)
        self.ids = drafter.draft_ids().cpu()  # [Vd] target ids
        self.id_list = self.ids.tolist()
        self.draft_s, self.draft_calls = 0.0, 0

    def modules(self) -> list:
        return [self.drafter]

    def ingest(self, view: PassView) -> torch.Tensor | None:
        """Step (1): extend the sequence's drafter cache by the committed positions; return the
        drafter's hidden state at the last one ([1, 1, dim]), or None if nothing was committed.

        The state (`view.state`): "len" committed entries, their KV in slots 0..len-1 of the buffers
        "kc", "vc" [1, kv, capacity, hd], "h". Drafted positions write scratch slots from len on, which
        the next ingest overwrites (rollback = length)."""
        st = view.state if view.state is not None else {}
        if view.start == 0 or st.get("len") != view.start:  # a new sequence (or a reset row)
            st.clear()
            if view.start != 0:  # positions were committed without us: no features to rebuild from
                raise RuntimeError("EAGLE-3 drafter state lost track of its sequence")
            st["len"], st["kc"], st["vc"] = 0, None, None
        n = 0 if view.aux is None else view.aux.shape[0]
        if n == 0:
            return st.get("h")
        dev = self.drafter.d2t.device
        d = self.drafter
        S = view.start + n
        self._reserve(st, S)
        aux = view.aux.to(dev, d.fc.weight.dtype).unsqueeze(0)  # [1, n, A*dim]
        nxt = torch.tensor(view.context[view.start + 1 : S + 1], device=dev).view(1, n)
        pos = torch.arange(view.start, S, device=dev).view(1, n)
        mask = torch.ones(n, S, dtype=torch.bool, device=dev).tril(view.start)  # new row j sees start + j
        h = d.step_cached(self.model.embed_tokens(nxt), d.fc(aux), pos, st["kc"], st["vc"], pos, mask)
        st["len"] = S
        st["h"] = h[:, -1:]
        return st["h"]

    def _reserve(self, st: dict, need: int) -> None:
        """Grow the state's KV buffers to hold `need` slots (doubling; the committed slots are kept)."""
        kc = st["kc"]
        if kc is not None and kc.shape[2] >= need:
            return
        cfg, dev = self.drafter.config, self.drafter.d2t.device
        cap = max(256, 2 * (0 if kc is None else kc.shape[2]), need)
        new_k = torch.zeros(1, cfg.n_kv_heads, cap, cfg.head_dim, device=dev, dtype=self.drafter.fc.weight.dtype)
        new_v = torch.zeros_like(new_k)
        if kc is not None:
            new_k[:, :, : st["len"]] = kc[:, :, : st["len"]]
            new_v[:, :, : st["len"]] = st["vc"][:, :, : st["len"]]
        st["kc"], st["vc"] = new_k, new_v

    def propose(self, request: DraftRequest) -> Guesses:
        """Step (1) (`ingest`, every pass, whatever is asked), then step (2): a chain (`_chain`) or a
        tree (`_tree`) of at most request.n guesses."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            h = self.ingest(request.view)  # [1, 1, dim]
            if request.n <= 0 or h is None:
                return Guesses.none()
            if request.tree:
                out = self._tree(request.view, h, request.n)
            else:
                out = self._chain(request.view, h, request.n, request.params, request.gen)
        self.draft_s += time.perf_counter() - t0
        self.draft_calls += 1
        return out

    def _chain(self, view: PassView, h: torch.Tensor, n: int, params, gen) -> Guesses:
        """n tokens from the last committed state h [1, 1, dim], each picked under `params` with `gen`;
        step j's KV goes to scratch slot len + j - 1."""
        st, d = view.state, self.drafter
        dev = d.d2t.device
        S0 = st["len"]
        self._reserve(st, S0 + n)
        tokens, confs, dists = [], [], []
        for j in range(n):
            if j > 0:  # step 2..: the drafted token and the previous step's hidden state
                pos = torch.tensor([[S0 - 1 + j]], device=dev)
                emb = self.model.embed_tokens(torch.tensor([[tokens[-1]]], device=dev))
                mask = torch.ones(1, S0 + j, dtype=torch.bool, device=dev)
                h = d.step_cached(emb, h, pos, st["kc"], st["vc"], pos, mask)
            logits = d.logits(h).view(1, -1).float().cpu()  # [1, Vd]
            t, probs = pick(logits, params, gen)
            tokens.append(int(self.ids[t[0]]))
            confs.append(float(torch.softmax(logits, -1).max()))
            if probs is not None:
                full = probs.new_zeros(1, self.model.lm_head.weight.shape[0])
                dists.append(full.index_copy_(1, self.ids, probs))
        return Guesses(tokens, confs, torch.cat(dists) if dists else None)

    def _tree(self, view: PassView, h: torch.Tensor, n: int) -> Guesses:
        """At most n nodes: the candidates of highest cumulative probability (the product of the
        drafter's probabilities along the path; each node's confidence), grown depth by depth as
        EAGLE-2/3 do. Deterministic (top-k, never sampled), so `tree:N` stays exact under sampling.

        From the last committed state h [1, 1, dim] (step (1)), a candidate is a child among the TOP_K
        of its parent's distribution. Depth d expands the TOP_K candidates of depth d that can still
        enter the n best with one batched drafter step at RoPE position len - 1 + d, each row reading
        its token and its parent's hidden state (depth 1: the last committed one) and attending, by a
        tree mask, to the committed KV, its ancestors' scratch KV and its own entry: what the chain
        would compute along that path, with no per-path recomputation. A child's cumulative
        probability never exceeds its parent's, so the growth stops once the n best are at least as
        likely as any unexpanded node, and the n best (ties: shallower first) always include their
        ancestors.

        The scratch KV lives in this call only: `view.state` keeps the committed entries alone (slots
        0..len-1), and the expanded candidates write scratch slots after them, which the next pass's
        `ingest` overwrites with the accepted path's from the trunk's features (decode gathers them)."""
        st, d = view.state, self.drafter
        dev = d.d2t.device
        S0 = st["len"]  # committed drafter entries
        self._reserve(st, S0 + TOP_K * n)  # at most TOP_K expanded per depth, depth at most n
        # every candidate c: its draft id, parent candidate (-1 = root), cumulative log-probability, depth
        tok: list[int] = []
        par: list[int] = []
        cum: list[float] = []
        depth: list[int] = []
        hid: dict[int, torch.Tensor] = {-1: h[0, 0]}  # candidate -> drafter state after its step [dim]
        seen: dict[int, list[int]] = {-1: []}  # expanded candidate -> the scratch slots of its path (after S0)
        M = 0  # scratch slots written
        frontier, logits = [-1], d.logits(h).view(1, -1)  # logits [F, Vd]: row f gives frontier[f]'s children
        level = 0
        while True:
            logp = torch.log_softmax(logits.float().cpu(), -1)  # [F, Vd]
            val, idx = logp.topk(min(TOP_K, logp.shape[-1]), -1)  # [F, TOP_K]
            level += 1
            for p, vals, ids in zip(frontier, val.tolist(), idx.tolist()):
                base = cum[p] if p >= 0 else 0.0
                for t, lp in zip(ids, vals):
                    tok.append(t)
                    par.append(p)
                    cum.append(base + lp)
                    depth.append(level)
            nth = sorted(cum, reverse=True)[n - 1] if len(cum) >= n else float("-inf")
            new = sorted((c for c in range(len(cum)) if depth[c] == level and cum[c] > nth), key=lambda c: -cum[c])[
                :TOP_K
            ]
            if not new:
                break
            # one drafter step for the F = w candidates in `new`, tree-masked, into scratch slots S0 + M + i
            w = len(new)
            scratch = [[False] * (M + w) for _ in new]  # [F, scratch|new]: its ancestors' slots and its own
            for i, c in enumerate(new):
                for j in seen[par[c]]:
                    scratch[i][j] = True
                scratch[i][M + i] = True
            mask = torch.cat([torch.ones(w, S0, dtype=torch.bool), torch.tensor(scratch)], 1)  # [F, S0 + M + w]
            ids = self.ids[[tok[c] for c in new]].to(dev).view(1, w)
            g = torch.stack([hid[par[c]] for c in new]).unsqueeze(0)  # [1, F, dim]
            pos = torch.full((1, w), S0 - 1 + level, device=dev)
            slots = torch.arange(S0 + M, S0 + M + w, device=dev).view(1, w)
            hh = d.step_cached(self.model.embed_tokens(ids), g, pos, st["kc"], st["vc"], slots, mask.to(dev))[0]
            for i, (c, row) in enumerate(zip(new, hh.unbind(0))):
                hid[c], seen[c] = row, seen[par[c]] + [M + i]
            M += w
            frontier, logits = new, d.logits(hh)  # [F, Vd]
        best = sorted(range(len(cum)), key=lambda c: (-cum[c], depth[c], c))[:n]
        keep = sorted(best)  # candidates are numbered after their parents: parents first
        index = {c: i for i, c in enumerate(keep)}
        return Guesses(
            [self.id_list[tok[c]] for c in keep],
            [math.exp(cum[c]) for c in keep],
            None,
            [index[par[c]] if par[c] >= 0 else -1 for c in keep],
        )


# ---- files -----------------------------------------------------------------------------------


def drafter_files(drafter: Eagle3Drafter, model: Transformer, meta: dict | None = None) -> dict:
    """config.json (vLLM's fields + ours) and model.safetensors (vLLM's names) of a drafter."""
    cfg = {
        **drafter.config.to_hf(),
        "format": FORMAT,
        "version": 1,
        "base_hash": base_hash(model),
        "n_params": sum(p.numel() for p in drafter.parameters()),
        "meta": meta or {},
    }
    return {WEIGHTS: dict(drafter.state_dict()), CONFIG: cfg}


def read_drafter_config(path) -> dict:
    path = Path(path)
    cfg = read_config(path, FORMAT, "EAGLE-3 drafter")
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ArtifactError(f"{path / CONFIG}: architectures must name {ARCHITECTURE}")
    return cfg


def load_drafter(model: Transformer, path) -> Eagle3Drafter:
    """The drafter saved in `path` (ours or its vLLM export), checked against the base model."""
    path = Path(path)
    cfg = read_drafter_config(path)
    check_trained_on(model, cfg, path, "EAGLE-3 drafter", WEIGHTS)
    try:
        ecfg = Eagle3Config.from_hf(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{path / CONFIG}: bad EAGLE-3 config ({str(e).splitlines()[0]})") from None
    mc = model.config
    # an MTP adapter appends its <mtp_mask> token to the vocabulary; the drafter never proposes it
    vocab = mc.vocab_size - 1 if mc.mask_token_id == mc.vocab_size - 1 else mc.vocab_size
    if ecfg.vocab_size != vocab or ecfg.target_dim != mc.dim:
        raise ArtifactError(
            f"EAGLE-3 drafter {path} is for a vocabulary of {ecfg.vocab_size} and width "
            f"{ecfg.target_dim}; this model has {vocab} and {mc.dim}"
        )
    bad = [k for k in ecfg.aux_layers if not 0 <= k <= mc.n_layers]
    if bad:
        raise ArtifactError(f"EAGLE-3 drafter {path} reads trunk layers {bad}; the model has {mc.n_layers}")
    drafter = Eagle3Drafter(ecfg)
    state = load_safetensors(path / WEIGHTS)
    check_finite(state, path / WEIGHTS)
    d2t = state.get("d2t")
    if d2t is None or d2t.dtype != torch.int64 or tuple(d2t.shape) != (ecfg.draft_vocab,):
        raise ArtifactError(f"{path / WEIGHTS}: d2t must be int64 [{ecfg.draft_vocab}]")
    ids = torch.arange(ecfg.draft_vocab) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(ids.unique()) != len(ids):
        raise ArtifactError(f"{path / WEIGHTS}: d2t does not map onto distinct token ids of this model")
    state.pop("t2d", None)  # derived from d2t
    try:
        missing, unexpected = drafter.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False
        )
    except RuntimeError as e:
        raise ArtifactError(f"EAGLE-3 tensors in {path} do not match their config: {str(e).splitlines()[-1]}") from None
    missing = [m for m in missing if m != "t2d"]
    if missing or unexpected:
        raise ArtifactError(f"EAGLE-3 tensors in {path}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    drafter.set_vocab(ids)
    w = model.embed_tokens.weight
    return drafter.to(w.device, w.dtype).eval().requires_grad_(False)


def load_eagle3_proposer(model: Transformer, path) -> Eagle3Proposer:
    """What `Engine.load` calls for `--proposer eagle3`; the base model is not modified."""
    return Eagle3Proposer(model, load_drafter(model, path))
