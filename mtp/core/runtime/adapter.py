"""The trainable part of an MTP model: the `<mtp_mask>` embedding row plus (gated) LoRA adapters.

Why gated LoRA by default: the adapters' output is added only at mask-token positions, so every
ordinary position computes exactly the base model's numbers (passes without masks skip the LoRA
math altogether). `verify` decoding is then lossless with respect to the original model, and the
frozen teacher needed for self-distillation is the same weights under `model.base_only()`.

Modes: `gated` (LoRA at mask positions only), `plain` (LoRA everywhere), `full` (every base weight
trainable; the trainer keeps a frozen copy as teacher). The mask token's input embedding row is
trainable, unless the LoRA sits on upper layers only (`layers` = (FROM, TO), FROM > 0): then the
row stays as initialised, so nothing below layer FROM needs a gradient and the backward pass stops
there (the cheaper step `mtp train --lora-layers` buys). Its output row is never trained: the mask is
never a prediction (decoding and the training loss set its logit to -inf), so that row would
receive no gradient.

An adapter directory holds `adapter.safetensors` (trainable tensors by parameter name) and
`config.json` (mode, rank, alpha, targets, layers [FROM, TO) with LoRA, mask_token_id, the base
weights' hash, training meta). A config without `layers` (adapters before it existed) has LoRA on
every layer.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mtp.core.runtime.artifacts import (
    base_hash,
    cast_checked,
    check_finite,
    check_trained_on,
    has_format,
    load_safetensors,
    read_config,
    write_dir_atomic,
)
from mtp.core.runtime.model import Linear, Transformer, add_mask_token, packed_matmul, use_packed

FORMAT = "mtp-adapter"
MODES = ("gated", "plain", "full")
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
_PROJ = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
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
        nn.init.kaiming_uniform_(self.lora_a, a=5**0.5)

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
        (base matmul, A matmul, gate scaling, fused add). Mask-free passes keep the base's own packed
        weight."""
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
        return torch.addmm(
            y.reshape(-1, out), h.reshape(-1, h.shape[-1]).to(y.dtype), self.lora_b.t().to(y.dtype)
        ).view(y.shape)  # y + scale * gate * B(A(x))


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


def check_layers(layers, n_layers: int | None) -> tuple[int, int] | None:
    """(FROM, TO) with 0 <= FROM < TO <= n_layers (n_layers None: not known yet, TO unchecked)."""
    if layers is None:
        return None
    lo, hi = layers
    if not (type(lo) is int and type(hi) is int and 0 <= lo < hi and (n_layers is None or hi <= n_layers)):
        have = f" (the model has {n_layers} layers)" if n_layers is not None else ""
        raise ValueError(f"--lora-layers {lo}:{hi} must satisfy 0 <= FROM < TO <= the layer count{have}")
    return lo, hi


def add_adapters(
    model: Transformer,
    rank: int = 16,
    alpha: float = 32,
    targets=TARGETS,
    mode: str = "gated",
    n_used_tokens: int | None = None,
    layers: tuple[int, int] | None = None,
) -> list[nn.Parameter]:
    """Add the mask token and the adapters in place; return the trainable parameters.

    n_used_tokens: how many vocabulary rows the tokenizer uses (an unused padded row becomes the
    mask token; SmolLM2's vocabulary is full, so its embedding grows to 49153 rows).
    layers: (FROM, TO): LoRA on layers FROM..TO-1 only (default all); with FROM > 0 the mask row is
    frozen, so no tensor below layer FROM requires a gradient (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown adapter mode {mode!r}; choose from {', '.join(MODES)}")
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"unknown adapter target {bad[0]!r}; choose from {', '.join(TARGETS)}")
    if rank < 1:
        raise ValueError("--rank must be >= 1")
    if getattr(model, "has_adapters", False):
        raise ValueError("the model already has adapters")
    if layers is not None and mode == "full":
        raise ValueError("--lora-layers needs --mode gated or plain (full mode trains every weight)")
    lo, hi = check_layers(layers, len(model.layers)) or (0, len(model.layers))
    model.base_weights_hash = base_hash(model)  # before anything changes
    mid = add_mask_token(model, n_used_tokens)
    model.requires_grad_(False)
    model.embed_tokens = MaskEmbedding(model.embed_tokens, mid)
    params: list[nn.Parameter] = [model.embed_tokens.mask_row]
    if lo > 0:  # the row feeds layer 0: training it would need the backward through every layer
        model.embed_tokens.mask_row.requires_grad_(False)
        params = []
    if mode == "full":
        model.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        for layer in model.layers[lo:hi]:
            for t in targets:
                parent_name, attr = _PROJ[t].split(".")
                parent = getattr(layer, parent_name)
                lora = LoRALinear(getattr(parent, attr), rank, alpha)
                setattr(parent, attr, lora)
                params += [lora.lora_a, lora.lora_b]
    model.has_adapters = mode != "full"  # full fine-tunes are no adapters: the gate stays None
    model.gated_adapters = mode == "gated"
    model.adapter_meta = {"mode": mode, "rank": rank, "alpha": alpha, "targets": list(targets)}
    if mode != "full":
        model.adapter_meta["layers"] = [lo, hi]
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


def adapter_files(model: Transformer, extra_meta: dict | None = None, dtype=None) -> dict:
    """{file name: content} of an adapter directory (what save_adapter writes); `dtype` (e.g. float16
    for a shipped copy) refuses a value it cannot hold rather than writing inf."""
    tensors = trainable_state(model)
    if dtype is not None:
        tensors = cast_checked(tensors, dtype)
    config = {
        "format": FORMAT,
        "version": 1,
        **model.adapter_meta,
        "mask_token_id": model.config.mask_token_id,
        "vocab_size": model.config.vocab_size,
        "base_hash": base_hash(model),
        "meta": extra_meta or {},
    }
    return {WEIGHTS: tensors, CONFIG: config}


ALLOWED = {CONFIG, WEIGHTS, "optimizer.safetensors", "trainer_state.json"}  # what an adapter/run dir holds
is_adapter_dir = has_format(FORMAT, ALLOWED)


def save_adapter(model: Transformer, path, extra_meta: dict | None = None, dtype=None) -> None:
    write_dir_atomic(Path(path), adapter_files(model, extra_meta, dtype), kind=is_adapter_dir)


_FIELDS = {
    "rank": int,
    "alpha": (int, float),
    "targets": list,
    "mode": str,
    "mask_token_id": int,
    "vocab_size": int,
    "base_hash": str,
}


def read_adapter_config(path) -> dict:
    """The adapter's config.json, every field it needs present and of the right type."""
    cfg_path = Path(path) / CONFIG
    cfg = read_config(path, FORMAT, "adapter")
    for name, typ in _FIELDS.items():
        if name not in cfg:
            raise ValueError(f"{cfg_path}: missing field {name!r}")
        if not isinstance(cfg[name], typ) or isinstance(cfg[name], bool):
            raise ValueError(f"{cfg_path}: field {name!r} has the wrong type ({type(cfg[name]).__name__})")
    if cfg["mode"] not in MODES or cfg["rank"] < 1 or not all(x in TARGETS for x in cfg["targets"]):
        raise ValueError(f"{cfg_path}: bad mode, rank or targets")
    layers = cfg.get("layers")
    if layers is not None and not (
        isinstance(layers, list)
        and len(layers) == 2
        and all(type(x) is int and x >= 0 for x in layers)
        and layers[0] < layers[1]
    ):
        raise ValueError(f"{cfg_path}: field 'layers' must be [FROM, TO] with 0 <= FROM < TO, got {layers!r}")
    return cfg


def adapter_layers(cfg: dict, n_layers: int) -> tuple[int, int]:
    """The layers [FROM, TO) an adapter config puts LoRA on (no `layers` field: all of them)."""
    return tuple(cfg["layers"]) if cfg.get("layers") is not None else (0, n_layers)


def check_mask_id(cfg: dict, model: Transformer, n_tokenizer: int | None, path) -> None:
    """The mask token must be the row the adapter added: past every token the tokenizer uses (an
    unused padded row of the embedding) or the one appended row, and the vocabulary size must
    be the one that results. Anything else would overwrite a real token's embedding."""
    vocab = model.config.vocab_size  # before the adapter adds anything
    mid, n_used = cfg["mask_token_id"], n_tokenizer if n_tokenizer is not None else vocab
    want = vocab if n_used >= vocab else n_used
    if mid != want or cfg["vocab_size"] != max(vocab, mid + 1):
        raise ValueError(
            f"adapter {path}: mask_token_id {mid} (vocab_size {cfg['vocab_size']}) is not the row an "
            f"adapter adds to this model (expected {want}, vocab_size {max(vocab, want + 1)}); "
            "refusing to load a tampered or foreign adapter"
        )


def read_adapter(model: Transformer, path, n_tokenizer: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The saved adapter's config and tensors, checked against `model` (the base model, no adapter
    yet) without changing it: refuses an adapter trained on other base weights (hash of the base
    weights differs), a config with missing or mistyped fields, a layer range the model lacks, a
    mask token id that is not the row an adapter adds (`check_mask_id`; n_tokenizer: tokens the
    tokenizer uses), and weights holding NaN or inf."""
    path = Path(path)
    cfg = read_adapter_config(path)
    check_trained_on(model, cfg, path, "adapter", WEIGHTS)
    check_mask_id(cfg, model, n_tokenizer, path)
    if cfg.get("layers") is not None and cfg["layers"][1] > len(model.layers):
        raise ValueError(f"adapter {path}: layers {cfg['layers']} beyond the model's {len(model.layers)} layers")
    tensors = load_safetensors(path / WEIGHTS)
    check_finite(tensors, path / WEIGHTS)  # one NaN would make every mask guess garbage
    return cfg, tensors


def load_adapter(model: Transformer, path, n_tokenizer: int | None = None) -> dict:
    """Add the saved adapter to a freshly loaded base model (inference mode); return its config.
    What it refuses: `read_adapter`."""
    cfg, tensors = read_adapter(model, path, n_tokenizer)
    add_adapters(
        model,
        cfg["rank"],
        cfg["alpha"],
        tuple(cfg["targets"]),
        cfg["mode"],
        n_used_tokens=cfg["mask_token_id"],
        layers=cfg.get("layers"),
    )
    if model.config.mask_token_id != cfg["mask_token_id"]:
        raise ValueError(
            f"adapter expects mask token id {cfg['mask_token_id']}, model gave {model.config.mask_token_id}"
        )
    load_trainable(model, tensors)
    model.requires_grad_(False)
    return cfg


def load_trainable(model: Transformer, tensors: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable tensors into the model (cast to its dtype); names must match exactly."""
    want = trainable_state(model)
    missing, unexpected = set(want) - set(tensors), set(tensors) - set(want)
    if missing or unexpected:
        raise ValueError(
            f"adapter tensors do not match the model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    with torch.no_grad():
        for k, t in want.items():
            if tensors[k].shape != t.shape:
                raise ValueError(
                    f"adapter tensor {k} has shape {tuple(tensors[k].shape)}, model expects {tuple(t.shape)}"
                )
            t.copy_(tensors[k].to(t.dtype))
        emb = model.embed_tokens
        if isinstance(emb, MaskEmbedding):  # keep the big matrix's row in step with the trained row
            emb.base.weight[emb.mask_id] = emb.mask_row.to(emb.base.weight.dtype)
