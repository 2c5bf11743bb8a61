"""The trainable part of an MTP model: the `<mtp_mask>` embedding row plus (gated) LoRA adapters.

Why gated LoRA by default: the adapters' output is added only at mask-token positions, so every
ordinary position computes exactly the base model's numbers (passes without masks skip the LoRA
math altogether). `verify` decoding is then lossless with respect to the original model, and the
frozen teacher needed for self-distillation is the same weights under `model.base_only()`.

Modes: `gated` (LoRA at mask positions only), `plain` (LoRA everywhere), `full` (every base weight
trainable; the trainer keeps a frozen copy as teacher). The mask token's input embedding row is
always trainable. Its output row is not: the mask is never a prediction (decoding and the training
loss set its logit to -inf), so that row would receive no gradient.

An adapter directory holds `adapter.safetensors` (trainable tensors by parameter name) and
`config.json` (mode, rank, alpha, targets, mask_token_id, the base weights' hash, training meta).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F

from mtp.core.loading import atomic_dir
from mtp.core.model import Linear, Transformer, add_mask_token, packed_matmul, use_packed

FORMAT = "mtp-adapter"
MODES = ("gated", "plain", "full")
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
_PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
WEIGHTS = "adapter.safetensors"
CONFIG = "config.json"


class LoRALinear(nn.Module):
    """base(x) + gate * (alpha/rank) * B(A(x)); the base projection stays frozen.

    B starts at zero, so a fresh adapter changes nothing. With gate None (a pass without mask
    tokens, or the teacher) the low-rank path is not computed at all."""

    def __init__(self, base: Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_a, a=5 ** 0.5)

    fused: torch.Tensor | None = None  # oneDNN-packed [W; A]: base output and rank-r input in one matmul
    fused_b: torch.Tensor | None = None  # (scale * B)^T: [r, out]
    fused_version: tuple = ()

    @property
    def weight(self):
        return self.base.weight

    def versions(self) -> tuple:
        return self.base.weight._version, self.lora_a._version, self.lora_b._version

    def pack(self) -> None:
        """CPU inference (`model.pack_weights`): a pass with masks then makes 2 calls here instead of 4
        (base matmul, A matmul, gate scaling, fused add); with 7 projections x 30 layers of small
        calls, that takes ~7 ms of adapter overhead off a 32-45 ms pass (SmolLM2, 2 cores). Mask-free
        passes keep the base's own packed weight."""
        w = self.base.weight
        if self.base.bias is not None or w.device.type != "cpu" or w.dtype != torch.float32:
            return
        with torch.no_grad():
            self.fused = torch.cat([w, self.lora_a.to(w.dtype)]).contiguous().to_mkldnn()
            self.fused_b = (self.lora_b.to(w.dtype) * self.scale).t().contiguous()
        self.fused_version = self.versions()

    def unpack(self) -> None:
        self.fused = self.fused_b = None

    def forward(self, x, gate=None):
        # x: [B, T, in]; gate: [B, T, 1] or None
        if gate is not None and self.fused is not None and self.fused_version == self.versions() and use_packed(x):
            out = self.base.out_features
            yh = packed_matmul(x, self.fused)  # [rows, out + r]: base output, then A x
            y = torch.addmm(yh[:, :out], yh[:, out:] * gate.reshape(-1, 1).to(yh.dtype), self.fused_b)
            return y.view(*x.shape[:-1], out)
        y = self.base(x)
        if gate is None:
            return y
        # the gate scales the rank-r activations, then one fused y + h B^T: a decoding pass makes
        # 7 x layers of these calls, so fewer, fused ops save ~5% of a pass on CPU
        h = F.linear(x.to(self.lora_a.dtype), self.lora_a) * (gate.to(self.lora_a.dtype) * self.scale)  # [B, T, r]
        out = y.shape[-1]
        return torch.addmm(y.reshape(-1, out), h.reshape(-1, h.shape[-1]).to(y.dtype),
                           self.lora_b.t().to(y.dtype)).view(y.shape)  # y + scale * gate * B(A(x))


class MaskEmbedding(nn.Module):
    """The base embedding with a trainable row for the mask token (the big matrix stays frozen)."""

    def __init__(self, base: nn.Embedding, mask_id: int):
        super().__init__()
        self.base = base
        self.mask_id = mask_id
        self.mask_row = nn.Parameter(base.weight[mask_id].detach().clone())

    @property
    def weight(self):
        return self.base.weight

    def forward(self, tokens):  # tokens: [B, T] -> [B, T, dim]
        x = self.base(tokens)
        is_mask = (tokens == self.mask_id).unsqueeze(-1)
        if not bool(is_mask.any()):
            return x
        return torch.where(is_mask, self.mask_row.to(x.dtype), x)


def base_hash(model: Transformer) -> str:
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


def add_adapters(model: Transformer, rank: int = 16, alpha: float = 32, targets=TARGETS, mode: str = "gated",
                 n_used_tokens: int | None = None) -> list[nn.Parameter]:
    """Add the mask token and the adapters in place; return the trainable parameters.

    n_used_tokens: how many vocabulary rows the tokenizer uses (an unused padded row becomes the
    mask token; SmolLM2's vocabulary is full, so its embedding grows to 49153 rows)."""
    if mode not in MODES:
        raise ValueError(f"unknown adapter mode {mode!r}; choose from {', '.join(MODES)}")
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"unknown adapter target {bad[0]!r}; choose from {', '.join(TARGETS)}")
    if rank < 1:
        raise ValueError("--rank must be >= 1")
    if getattr(model, "has_adapters", False):
        raise ValueError("the model already has adapters")
    model.base_weights_hash = base_hash(model)  # before anything changes
    mid = add_mask_token(model, n_used_tokens)
    model.requires_grad_(False)
    model.embed_tokens = MaskEmbedding(model.embed_tokens, mid)
    params: list[nn.Parameter] = [model.embed_tokens.mask_row]
    if mode == "full":
        model.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        for layer in model.layers:
            for t in targets:
                parent_name, attr = _PROJ[t].split(".")
                parent = getattr(layer, parent_name)
                lora = LoRALinear(getattr(parent, attr), rank, alpha)
                setattr(parent, attr, lora)
                params += [lora.lora_a, lora.lora_b]
    model.has_adapters = mode != "full"  # full fine-tunes are no adapters: the gate stays None
    model.gated_adapters = mode == "gated"
    model.adapter_meta = {"mode": mode, "rank": rank, "alpha": alpha, "targets": list(targets)}
    return params


def trainable_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors an adapter file holds: LoRA factors and the mask row (full mode: all weights)."""
    meta = getattr(model, "adapter_meta", None)
    if meta is None:
        raise ValueError("the model has no adapters")
    state = model.state_dict()
    if meta["mode"] == "full":
        keep = {k for k in state if not (model.config.tie_embeddings and k == "lm_head.weight")}
    else:
        keep = {k for k in state if k.endswith((".lora_a", ".lora_b", "embed_tokens.mask_row"))}
    return {k: state[k].detach() for k in sorted(keep)}


def write_dir_atomic(path: Path, files: dict[str, dict | bytes | dict[str, torch.Tensor]]) -> None:
    """Write a directory all at once (`loading.atomic_dir`): `files` maps a file name to a dict of
    tensors (-> safetensors) or a JSON-able dict (-> JSON)."""
    from safetensors.torch import save_file
    with atomic_dir(path) as tmp:
        for name, content in files.items():
            if name.endswith(".safetensors"):
                save_file({k: v.detach().contiguous().cpu() for k, v in content.items()}, str(tmp / name))
            else:
                (tmp / name).write_text(json.dumps(content, indent=1))


def adapter_files(model: Transformer, extra_meta: dict | None = None, dtype=None) -> dict:
    """{file name: content} of an adapter directory (what save_adapter writes)."""
    tensors = trainable_state(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    config = {"format": FORMAT, "version": 1, **model.adapter_meta,
              "mask_token_id": model.config.mask_token_id, "vocab_size": model.config.vocab_size,
              "base_hash": base_hash(model), "meta": extra_meta or {}}
    return {WEIGHTS: tensors, CONFIG: config}


def save_adapter(model: Transformer, path, extra_meta: dict | None = None, dtype=None) -> None:
    write_dir_atomic(Path(path), adapter_files(model, extra_meta, dtype))


def read_adapter_config(path) -> dict:
    path = Path(path)
    cfg_path = path / CONFIG
    if not cfg_path.exists():
        raise ValueError(f"no {CONFIG} in adapter directory {path}")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("format") != FORMAT:
        raise ValueError(f"{cfg_path} is not an mtp adapter config")
    return cfg


def check_trained_on(model: Transformer, cfg: dict, path: Path, kind: str, weights: str) -> None:
    """Refuse a saved adapter/heads directory made for other base weights, or missing its weights."""
    have = base_hash(model)
    if cfg["base_hash"] != have:
        raise ValueError(f"{kind} {path} was trained on another base model (base weights hash "
                         f"{cfg['base_hash']}, this model {have})")
    if not (path / weights).exists():
        raise ValueError(f"no {weights} in {kind} directory {path}")


def load_adapter(model: Transformer, path) -> dict:
    """Add the saved adapter to a freshly loaded base model (inference mode); return its config.

    Refuses an adapter trained on other base weights (hash of the base weights differs)."""
    from safetensors.torch import load_file
    path = Path(path)
    cfg = read_adapter_config(path)
    check_trained_on(model, cfg, path, "adapter", WEIGHTS)
    add_adapters(model, cfg["rank"], cfg["alpha"], tuple(cfg["targets"]), cfg["mode"],
                 n_used_tokens=cfg["mask_token_id"])
    if model.config.mask_token_id != cfg["mask_token_id"]:
        raise ValueError(f"adapter expects mask token id {cfg['mask_token_id']}, model gave "
                         f"{model.config.mask_token_id}")
    load_trainable(model, load_file(str(path / WEIGHTS)))
    model.requires_grad_(False)
    return cfg


def load_trainable(model: Transformer, tensors: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable tensors into the model (cast to its dtype); names must match exactly."""
    want = trainable_state(model)
    missing, unexpected = set(want) - set(tensors), set(tensors) - set(want)
    if missing or unexpected:
        raise ValueError(f"adapter tensors do not match the model: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")
    with torch.no_grad():
        for k, t in want.items():
            if tensors[k].shape != t.shape:
                raise ValueError(f"adapter tensor {k} has shape {tuple(tensors[k].shape)}, "
                                 f"model expects {tuple(t.shape)}")
            t.copy_(tensors[k].to(t.dtype))
        emb = model.embed_tokens
        if isinstance(emb, MaskEmbedding):  # keep the big matrix's row in step with the trained row
            emb.base.weight[emb.mask_id] = emb.mask_row.to(emb.base.weight.dtype)
