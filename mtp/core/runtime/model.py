"""The lean Llama-family transformer every part of mtp runs on.

Why our own model code instead of wrapping `transformers` modules: decoding needs a preallocated KV
cache whose rollback is moving a position pointer (mtp.core.runtime.cache), training needs arbitrary attention
masks with explicit RoPE position ids, and the mask-token adapters must act on mask positions only.
Logits match `transformers` for every supported architecture (tests/test_model.py).

Supported: Llama 2/3 (incl. llama3 RoPE scaling), SmolLM/SmolLM2, Mistral, Qwen2/2.5 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MASK_TOKEN = "<mtp_mask>"


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0 -> dim // n_heads
    arch: str = "llama"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_seq_len: int = 2048
    mask_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads

    @staticmethod
    def arch_of(hf: dict) -> str:
        """Our architecture name for a Hugging Face config dict; unsupported scope fails loudly."""
        archs = hf.get("architectures") or []
        archs = archs if isinstance(archs, list) else [archs]
        arch = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in SUPPORTED_ARCHITECTURES), None
        )
        if arch is None:
            arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
                str(hf.get("model_type", ""))
            )
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; supported: "
                + ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            )
        return arch

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Map a Hugging Face `config.json` dict onto our config; unsupported scope fails loudly."""
        arch = cls.arch_of(hf)
        n_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})  # transformers 5 / 4 names
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        if rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = {}
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            intermediate_size=hf["intermediate_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            arch=arch,
            rope_theta=theta,
            rope_scaling=rope or None,
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            mask_token_id=hf.get("mtp_mask_token_id"),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


PACKED_MIN_ROWS_OFF_MAIN = 4


class Linear(nn.Linear):
    """nn.Linear that accepts (and ignores) the adapter gate, so adapters can replace it in place.

    For CPU inference it can also hold a oneDNN-packed copy of its weight (`pack_weights`), faster
    for matmuls over a few rows (a decoding block): `--weights torch`; the default runs on mtp.core.runtime.kernels.
    The packed copy is used only without autograd and only while the weight is unchanged (its
    version counter), and off the main thread only for calls of at least PACKED_MIN_ROWS_OFF_MAIN
    rows (oneDNN's per-call cost off the main thread outweighs the gain on smaller ones)."""

    packed: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None
    packed_version: int = -1

    def forward(self, x, gate=None):
        if self.packed is not None and self.packed_version == self.weight._version and use_packed(x):
            y = packed_matmul(x, self.packed, self.packed_bias)
            return y.view(*x.shape[:-1], y.shape[-1])
        return super().forward(x)


def use_packed(x: torch.Tensor) -> bool:
    """Whether a packed oneDNN weight should serve this call (see `Linear`).

    Only float32 rows: the packed weights are float32, and a bf16 row (under `--amp` autocast) would
    take oneDNN's bf16 path, which exists only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on an
    AVX2-only CPU it raises. Such rows take the plain `F.linear`, which autocast serves on every CPU."""
    return (
        x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and (
            x.numel() >= PACKED_MIN_ROWS_OFF_MAIN * x.shape[-1] or threading.current_thread() is threading.main_thread()
        )
    )


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ packed^T -> [rows, out] (oneDNN wants 2-D, dense input)."""
    return torch._C._nn.mkldnn_linear(x.reshape(-1, x.shape[-1]).contiguous().to_mkldnn(), packed, bias).to_dense()


def can_pack(model: nn.Module) -> bool:
    w = next(model.parameters())
    return w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_weights(model: nn.Module) -> int:
    """Give every `Linear` (projections and LM head) a oneDNN-packed weight for CPU inference.

    Call after all weights are final (adapter loaded, mask token added); a later in-place change to
    a weight makes that layer fall back to the plain path. Costs one extra copy of the weights in
    memory. Returns the number of layers packed (0 where packing does not apply: GPU, not float32)."""
    if not can_pack(model):
        return 0
    n = 0
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Linear):
                mod.packed = mod.weight.detach().contiguous().to_mkldnn()
                mod.packed_bias = None if mod.bias is None else mod.bias.detach().contiguous().to_mkldnn()
                mod.packed_version = mod.weight._version
                n += 1
            elif hasattr(mod, "pack"):  # e.g. an adapter's LoRA projection
                mod.pack()
    return n


def unpack_weights(model: nn.Module) -> None:
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.packed = mod.packed_bias = None
        elif hasattr(mod, "unpack"):
            mod.unpack()


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":  # Llama 3.1 frequency-dependent scaling
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in (None, "default"):
        raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r}")
    return inv.float()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = Linear(cfg.dim, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps)
            self.k_norm = RMSNorm(hd, cfg.norm_eps)

    def forward(self, x, cos, sin, mask, kv, gate):
        # x: [B, T, dim]; cos/sin: [B, 1, T, hd]; mask: [B, 1, T, S] bool (True = attend)
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x, gate).view(B, T, -1, hd)
        k = self.k_proj(x, gate).view(B, T, -1, hd)
        v = self.v_proj(x, gate).view(B, T, -1, hd)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, hd]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if gate is not None:  # a pass with mask rows: a non-finite mask row must not reach other rows
            # (a masked-out NaN key still poisons the softmax: NaN + -inf = NaN), so its keys and values
            # are zeroed; ordinary rows are then computed exactly as without it
            k, v = torch.nan_to_num(k, 0.0, 0.0, 0.0), torch.nan_to_num(v, 0.0, 0.0, 0.0)
        if kv is not None:  # write this block into the cache, then attend over the cache prefix
            k, v = kv(k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.cfg.n_heads != self.cfg.n_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1), gate)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x, gate):
        return self.down_proj(F.silu(self.gate_proj(x, gate)) * self.up_proj(x, gate), gate)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, kv=None, gate=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, gate)
        return x + self.mlp(self.post_attention_layernorm(x), gate)


class Transformer(nn.Module):
    """Decoder-only LM. One `forward` serves decoding (with a KV cache) and training (with a mask)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # nn.Embedding's own init, skipped on the meta device (the loader builds there, then loads real
        # weights): a normal_ on a meta tensor imports torch._dynamo, ~5 s of every start
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        if self.embed_tokens.weight.device.type != "meta":
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.adapters_enabled = True  # False = the frozen base model (the teacher)
        self.gated_adapters = True  # adapters act on mask positions only (see mtp.core.runtime.adapter)
        self._rope_cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    # the kernels' runner of the decoder layers (mtp.core.runtime.runner), set by mtp.core.runtime.weights.attach
    runner = None

    @property
    def device(self):
        return self.embed_tokens.weight.device

    def rope(self, positions: torch.Tensor, dtype: torch.dtype | None = None):
        # positions: [B, T] -> cos, sin: [B, 1, T, head_dim] (in `dtype`, default the embeddings')
        need = int(positions.max()) + 1
        if self._rope_cache is None or self._rope_cache[0] < need or self._rope_cache[1].device != positions.device:
            n = max(need, self.config.max_seq_len, 64)
            inv = rope_inv_freq(self.config).to(positions.device)
            freqs = torch.outer(torch.arange(n, device=positions.device, dtype=torch.float32), inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope_cache = (n, emb.cos(), emb.sin())
        _, cos, sin = self._rope_cache
        dtype = dtype or self.embed_tokens.weight.dtype
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)

    @contextlib.contextmanager
    def base_only(self):
        """Run as the original model: adapters switched off (the teacher, without a second copy)."""
        prev = self.adapters_enabled
        self.adapters_enabled = False
        try:
            yield self
        finally:
            self.adapters_enabled = prev

    def adapter_gate(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """[B, T] float gate for adapters: 1 at mask-token positions (gated) or everywhere (plain)."""
        if not self.adapters_enabled or not getattr(self, "has_adapters", False):
            return None
        if not self.gated_adapters:
            return torch.ones(tokens.shape, dtype=self.embed_tokens.weight.dtype, device=tokens.device)
        mid = self.config.mask_token_id
        is_mask = tokens == mid if mid is not None else torch.zeros_like(tokens, dtype=torch.bool)
        if not bool(is_mask.any()):
            return None  # plain passes skip adapter work entirely
        return is_mask.to(self.embed_tokens.weight.dtype)

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor | None = None,  # [B, T] RoPE positions (and cache slots)
        cache=None,  # mtp.core.runtime.cache.KVCache; writes this block at `positions`
        slots: torch.Tensor | None = None,  # [B] cache rows used by this batch (default: 0..B-1)
        attn_mask: torch.Tensor | None = None,  # [B, T, T] bool (True = attend; [B, T, S] with a cache)
        out_index: torch.Tensor | None = None,  # [B, N] positions in the block whose logits we need
        return_hidden: bool = False,
        cache_positions: torch.Tensor | None = None,  # [B, T] cache slots to write (default: positions)
        aux_layers: tuple[int, ...] = (),  # residual streams to return as well (see forward_layers)
    ):
        """Returns logits [B, N or T, vocab] (and the last layer's hidden states at the same rows).
        With `aux_layers` it returns (logits, hidden or None, aux [B, T, len(aux_layers) * dim]): the
        residual stream after k layers for each k, at every block position (EAGLE-3 drafters read them)."""
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        x = self.embed_tokens(tokens)
        gate = self.adapter_gate(tokens)
        if gate is not None:
            gate = gate.unsqueeze(-1)  # [B, T, 1]
        if aux_layers:
            x, aux = self.forward_layers(x, positions, cache, slots, attn_mask, gate, cache_positions, aux_layers)
            out = self.forward_head(x, out_index, return_hidden)
            logits, hidden = out if return_hidden else (out, None)
            return logits, hidden, aux
        x = self.forward_layers(x, positions, cache, slots, attn_mask, gate, cache_positions)
        return self.forward_head(x, out_index, return_hidden)

    def forward_layers(
        self,
        x,
        positions,
        cache=None,
        slots=None,
        attn_mask=None,
        gate=None,
        cache_positions=None,
        aux_layers: tuple[int, ...] = (),
    ):
        """Run every block of `self.layers` over hidden states x [B, T, dim] -> [B, T, dim].

        Split out of `forward` so a pipeline stage (mtp.pipeline.stages), whose `layers` is its slice of the
        model, runs the same code on hidden states it received; its `cache` holds just those layers.
        gate: [B, T, 1] adapter gate or None. cache_positions: [B, T] where the block's keys and values
        go in the cache when that differs from the RoPE positions (branched mask groups, mtp.core.decoding.decode);
        attn_mask then says which slots each row sees. aux_layers: also return the residual stream after
        k layers for each k in it (0 = the embeddings, len(layers) = the last layer's output before the
        final norm), concatenated: (x, aux [B, T, len(aux_layers) * dim])."""
        B, T = x.shape[:2]
        cos, sin = self.rope(positions, x.dtype)
        if attn_mask is not None:  # explicit layout (training); with a cache: [B, T, S] over its keys
            mask = attn_mask.unsqueeze(1)
        elif cache is not None:
            S = int(positions.max()) + 1
            # query at position p sees cache slots 0..p: committed prefix + this block, causally.
            # Stale slots beyond p (rejected drafts, old masks) are never visible.
            mask = torch.arange(S, device=x.device).view(1, 1, S) <= positions.unsqueeze(-1)
            mask = mask.unsqueeze(1)  # [B, 1, T, S]
        else:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().expand(B, 1, T, T)
        taken = {}
        writes = positions if cache_positions is None else cache_positions
        if self.runner is not None and self.runner.serves(x):  # the kernels' pass (mtp.core.runtime.runner)
            step = self.runner.layer_step(x, cos, sin, mask, cache, writes, slots, gate)
        else:
            step = functools.partial(reference_step, cos, sin, mask, cache, writes, slots, gate)
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                taken[i] = x
            x = step(i, layer, x)
        if not aux_layers:
            return x
        taken[len(self.layers)] = x
        bad = [k for k in aux_layers if k not in taken]
        if bad:
            raise ValueError(f"aux layer ids {bad} outside 0..{len(self.layers)}")
        return x, torch.cat([taken[k] for k in aux_layers], dim=-1)

    def forward_head(self, x, out_index=None, return_hidden: bool = False):
        """Hidden states [B, T, dim] -> logits [B, N or T, vocab] at rows `out_index` [B, N] (and the
        hidden states at those rows when `return_hidden`)."""
        if out_index is not None:
            x = x.gather(1, out_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self.norm(x))
        return (logits, x) if return_hidden else logits


def reference_step(cos, sin, mask, cache, writes, slots, gate, i: int, layer: Block, x: torch.Tensor):
    """Layer i of a pass in torch's arithmetic (the reference; the runner's too for a layer it lacks)."""
    kv = cache.writer(i, writes, slots) if cache is not None else None
    return layer(x, cos, sin, mask, kv, gate)


def add_mask_token(model: Transformer, n_used_tokens: int | None = None, seed: int = 0) -> int:
    """Give the model the special `<mtp_mask>` token; return its id.

    Reuses an unused padded vocabulary row when the embedding matrix has one (rows beyond the
    tokenizer's `n_used_tokens`), else grows input and output embeddings by one row. The row is
    initialised from the mean and standard deviation of the existing rows (per dimension).
    """
    cfg = model.config
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    emb = model.embed_tokens.weight
    gen = torch.Generator().manual_seed(seed)
    n_used = n_used_tokens if n_used_tokens is not None else cfg.vocab_size
    with torch.no_grad():

        def init_row(w):
            ref = w[:n_used].float()
            return (ref.mean(0) + ref.std(0) * torch.randn(w.shape[1], generator=gen)).to(w.dtype)

        if n_used < cfg.vocab_size:
            mid = n_used
            emb[mid] = init_row(emb)
            if not cfg.tie_embeddings:
                model.lm_head.weight[mid] = init_row(model.lm_head.weight)
        else:
            mid = cfg.vocab_size
            # every row is written below: no init of the new matrices (a random init of 28 M values costs ~0.3 s)
            grown = torch.empty(cfg.vocab_size + 1, cfg.dim, dtype=emb.dtype, device=emb.device)
            new_emb = nn.Embedding(cfg.vocab_size + 1, cfg.dim, _weight=grown)
            new_emb.weight[:-1] = emb
            new_emb.weight[-1] = init_row(emb)
            old_head = model.lm_head.weight
            model.embed_tokens = new_emb
            model.lm_head = Linear(cfg.dim, cfg.vocab_size + 1, bias=False, dtype=emb.dtype, device="meta")
            if cfg.tie_embeddings:
                model.lm_head.weight = model.embed_tokens.weight
            else:
                model.lm_head.weight = nn.Parameter(torch.empty_like(grown), requires_grad=old_head.requires_grad)
                model.lm_head.weight[:-1] = old_head
                model.lm_head.weight[-1] = init_row(old_head)
            cfg.vocab_size += 1
    cfg.mask_token_id = mid
    return mid
