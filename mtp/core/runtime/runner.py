"""The fast path of a pass, in one file: which arithmetic runs a model's inference rows, and why.

`model.py` is the torch reference (training, parity, `--weights torch`). `weights.attach` puts a model
on the batch-invariant kernels (mtp.core.runtime.kernels) in two moves, both made here:

* **Module swap.** Every `Linear` becomes a `KernelLinear` (its weight held as kernel parts: a GGUF's
  blocks as stored, or float32) and every `RMSNorm` a `KernelRMSNorm`. They are the same modules (same
  parameters, names and ties; the class changes in place, so adapters and proposers that hold them keep
  working) whose forward runs the kernel for float32 CPU rows without autograd (`kernel_rows`) while
  their weight is the one bound (its version counter), and torch's arithmetic otherwise.
* **A `Runner`** on `model.runner`, which runs the decoder layers of such passes. Per layer, in order:
  1. the whole layer as one C++ call (`mtp::decoder_layer`, kernels/layer.cpp) for a pass over a float32
     KV cache without an adapter gate, while the layer's weights are the bound ones;
  2. else the same ops one by one (`_layer_ops`): q/k/v (and gate/up) stacked into one kernel call
     each where no adapter gate acts, RMSNorm, RoPE, the cache write, attention over exactly the
     visible keys and the SiLU product on the layer ops. This path serves what the one call lacks:
     q/k norms (Qwen3), passes with mask tokens under an adapter (the gated LoRA through the
     adapter's own modules), passes without a cache.
  Both give a row the same bits whatever else shares its pass (tests/test_weights.py).

`Transformer.forward_layers` hands a layer to the runner when `kernel_rows(x)`; every other pass
(training, autocast, GPU) is the reference's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from mtp.core.runtime.model import MLP, Attention, Block, Linear, RMSNorm, reference_step, rotate_half


def kernel_rows(x: torch.Tensor) -> bool:
    """Whether the batch-invariant kernels serve this call: float32 CPU rows without autograd (training
    and autocast take the torch path)."""
    return x.dtype == torch.float32 and not torch.is_grad_enabled() and x.device.type == "cpu"


def current(linears: tuple) -> bool:
    """Whether kernel copies of these KernelLinears' weights are still theirs (no weight changed since)."""
    for m in linears:  # `_parameters` directly: nn.Module's attribute lookup costs ~1 us a call, 7 a layer
        if m.bound_version != m._parameters["weight"]._version:
            return False
    return True


class KernelLinear(Linear):
    """A `Linear` whose weight the kernels hold as `parts` (`KernelWeight`s along the output dimension,
    e.g. a GGUF's blocks, then float32 rows the file lacks); `call` runs them (bias included) on rows
    `kernel_rows` accepts while the weight is unchanged since binding, else torch's `F.linear`."""

    parts: list
    call: Callable
    bound_version: int

    @staticmethod
    def bind(mod: Linear, parts: list, int8: bool) -> None:
        """Turn `mod` (a Linear or a KernelLinear) into a KernelLinear on these parts, in place."""
        mod.__class__ = KernelLinear
        mod.parts, mod.bound_version = parts, mod.weight._version
        mod.call = kernel_call(parts, mod.bias, int8)
        mod.packed = mod.packed_bias = None

    @staticmethod
    def unbind(mod: KernelLinear) -> None:
        mod.__class__ = Linear
        del mod.parts, mod.call, mod.bound_version

    def forward(self, x, gate=None):
        if self.bound_version == self._parameters["weight"]._version and kernel_rows(x):
            return self.call(x)
        return F.linear(x, self.weight, self.bias)


class KernelRMSNorm(RMSNorm):
    """An `RMSNorm` on the layer op (`mtp::rmsnorm`) for rows `kernel_rows` accepts, else torch's."""

    @staticmethod
    def bind(mod: RMSNorm) -> None:
        mod.__class__ = KernelRMSNorm

    @staticmethod
    def unbind(mod: KernelRMSNorm) -> None:
        mod.__class__ = RMSNorm

    def forward(self, x):
        if kernel_rows(x):
            return torch.ops.mtp.rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return super().forward(x)


def kernel_call(parts: list, bias: torch.Tensor | None, int8: bool):
    """x [..., K] -> x @ the weight held as kernel parts (`KernelWeight`s along the output dimension)
    (+ bias); `int8`: quantised parts take int8 activations (`qlinear.linear_int8`, packed here, not in
    the first pass), float32 parts the float32 kernel. Ops and ISA bound once (`qlinear.bind`)."""
    from mtp.core.runtime.kernels.qlinear import bind

    calls = [bind(p, int8) for p in parts]
    b = None if bias is None else bias.detach()
    if len(calls) == 1:
        one = calls[0]
        return one if b is None else (lambda x: one(x) + b)

    def call(x):
        y = torch.cat([c(x) for c in calls], dim=-1)
        return y if b is None else y + b

    return call


@dataclass
class LayerCalls:
    """One decoder layer's bound kernel calls (any may be None: that step runs op by op)."""

    whole: Callable | None = None  # (x, cos, sin, mask, kc, vc, rows, positions) -> x: the layer in one call
    whole_from: tuple = ()  # the KernelLinears whose weights it holds
    qkv: Callable | None = None  # x -> [..., (H + 2 Hkv) hd]: q, k, v stacked
    qkv_from: tuple = ()
    gate_up: Callable | None = None  # x -> [..., 2 I]: gate and up stacked
    gate_up_from: tuple = ()


class Runner:
    """Runs the decoder layers of a kernel pass (see the module docstring). `layers`: Block -> its
    LayerCalls (keyed by module, so a pipeline stage that keeps a slice of the layers keeps theirs)."""

    def __init__(self, layers: dict):
        self.layers = layers

    def serves(self, x: torch.Tensor) -> bool:
        """Whether this pass's layers run here (float32 CPU rows without autograd), not in the reference."""
        return kernel_rows(x)

    def layer_step(self, x, cos, sin, mask, cache, writes, slots, gate):
        """The function (i, block, x) -> x that runs layer i of this pass (x [B, T, dim]; cos/sin
        [B, 1, T, hd]; mask [B, 1, T, S] bool, True = attend; writes [B, T] the cache slots this block
        goes to; slots [B] the batch's cache rows; gate [B, T, 1] or None)."""
        whole = _whole_layer_inputs(x, cos, mask, cache, writes, slots, gate)  # (mask, rows) or None

        def step(i: int, block: Block, x: torch.Tensor) -> torch.Tensor:
            calls = self.layers.get(block)
            if calls is None:  # a layer added after attach: the reference's arithmetic
                return reference_step(cos, sin, mask, cache, writes, slots, gate, i, block, x)
            if whole is not None and calls.whole is not None and current(calls.whole_from):
                return calls.whole(x, cos, sin, whole[0], cache.k[i], cache.v[i], whole[1], writes)
            kv = cache.writer(i, writes, slots) if cache is not None else None
            x = x + _attention_ops(block.self_attn, calls, block.input_layernorm(x), cos, sin, mask, kv, gate)
            return x + _mlp_ops(block.mlp, calls, block.post_attention_layernorm(x), gate)

        return step


def _attention_ops(attn: Attention, calls: LayerCalls, x, cos, sin, mask, kv, gate):
    """Attention.forward on the kernel ops: the same steps, each row's bits independent of the others."""
    B, T, _ = x.shape
    hd = attn.cfg.head_dim
    if calls.qkv is not None and gate is None and current(calls.qkv_from):
        qkv = calls.qkv(x)  # [B, T, (H + 2 Hkv) hd]: the three outputs side by side
        q, k, v = qkv.split([m.out_features for m in calls.qkv_from], -1)
        q, k, v = q.view(B, T, -1, hd), k.view(B, T, -1, hd), v.view(B, T, -1, hd)
    else:  # through the modules: an adapter's gated LoRA acts here
        q = attn.q_proj(x, gate).view(B, T, -1, hd)
        k = attn.k_proj(x, gate).view(B, T, -1, hd)
        v = attn.v_proj(x, gate).view(B, T, -1, hd)
    if attn.cfg.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    # an adapter under autocast may hand back bf16 projections: those rows take torch's ops
    ops = kernel_rows(q) and kernel_rows(k) and mask.dtype == torch.bool and cos.dtype == torch.float32
    if ops:
        q, k = torch.ops.mtp.rope(q, cos, sin), torch.ops.mtp.rope(k, cos, sin)  # [B, H, T, hd]
        v = v.transpose(1, 2)
    else:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, hd]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
    if gate is not None:  # a mask row's non-finite keys must not reach other rows (see Attention.forward)
        k, v = torch.nan_to_num(k, 0.0, 0.0, 0.0), torch.nan_to_num(v, 0.0, 0.0, 0.0)
    if kv is not None:  # write this block into the cache, then attend over the cache prefix
        k, v = kv(k, v)
    if ops:  # one query row at a time over exactly the keys it sees: [B, T, H, hd] (kernels/layer_ops.h)
        y = torch.ops.mtp.attention(q, k, v, mask.expand(B, -1, T, k.shape[2]), 1.0 / math.sqrt(hd))
        return attn.o_proj(y.view(B, T, -1), gate)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=attn.cfg.n_heads != attn.cfg.n_kv_heads)
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, -1), gate)


def _mlp_ops(mlp: MLP, calls: LayerCalls, x, gate):
    """MLP.forward on the kernel ops (gate and up stacked where no adapter gate acts)."""
    if calls.gate_up is not None and gate is None and current(calls.gate_up_from):
        gu = calls.gate_up(x)  # [B, T, 2 I]: gate's outputs, then up's
        n = calls.gate_up_from[0].out_features
        g, u = gu.reshape(-1, 2 * n).split([n, n], -1)
        return mlp.down_proj(torch.ops.mtp.silu_mul(g, u).view(*x.shape[:-1], n), gate)
    g, u = mlp.gate_proj(x, gate), mlp.up_proj(x, gate)
    if not (kernel_rows(g) and kernel_rows(u)):  # bf16 from an adapter under autocast
        return mlp.down_proj(F.silu(g) * u, gate)
    n = g.shape[-1]
    return mlp.down_proj(torch.ops.mtp.silu_mul(g.reshape(-1, n), u.reshape(-1, n)).view(g.shape), gate)


def _whole_layer_inputs(x, cos, mask, cache, writes, slots, gate):
    """(mask [B, 1, T, S], rows [B]) when this pass can run layers as one kernel call each (no adapter
    gate, a float32 CPU KV cache, a bool mask over exactly the slots the cache writer would show:
    S = max(writes) + 1); else None (the per-op path)."""
    if gate is not None or cache is None or cos.dtype != torch.float32:
        return None
    k = getattr(cache, "k", None)
    if not isinstance(k, torch.Tensor) or k.dtype != torch.float32 or not k.is_cpu or mask.dtype != torch.bool:
        return None
    B, T = x.shape[:2]
    S = cache.prefix_length(writes)  # checks the capacity, as the writer does
    if mask.shape[-1] != S:
        return None
    rows = torch.arange(B) if slots is None else slots
    return mask.expand(B, 1, T, S), rows


def build(model: torch.nn.Module, weights: str) -> Runner:
    """The Runner of `model` for `--weights` `weights` (`native-int8`: quantised parts take int8
    activations), its Linears KernelLinears by now: per Block, its q/k/v and gate/up stacked into one
    call each, and the whole layer as one call where it has nothing the call lacks."""
    int8, layers = weights == "native-int8", {}
    for block in model.modules():
        if isinstance(block, Block):
            attn, mlp = block.self_attn, block.mlp
            qkv_from = (_plain(attn.q_proj), _plain(attn.k_proj), _plain(attn.v_proj))
            gu_from = (_plain(mlp.gate_proj), _plain(mlp.up_proj))
            qkv, gu = stacked(list(qkv_from)), stacked(list(gu_from))
            calls = LayerCalls(
                qkv=None if qkv is None else kernel_call([qkv[0]], qkv[1], int8),
                qkv_from=qkv_from if qkv is not None else (),
                gate_up=None if gu is None else kernel_call([gu[0]], gu[1], int8),
                gate_up_from=gu_from if gu is not None else (),
            )
            calls.whole, calls.whole_from = _whole_layer(block, qkv, gu, qkv_from + gu_from, int8)
            layers[block] = calls
    return Runner(layers)


def _plain(m: torch.nn.Module) -> torch.nn.Module:
    """The Linear a projection computes in passes without an adapter gate: itself, or the base Linear an
    adapter wraps (mtp.core.runtime.adapter.LoRALinear adds nothing without a gate), which the stacked
    calls serve."""
    base = getattr(m, "base", None)
    return base if not isinstance(m, Linear) and isinstance(base, Linear) else m


def stacked(linears: list):
    """(KernelWeight, bias or None): the KernelLinears' weights stacked along the output dimension (and
    their biases), when they are all KernelLinears of one single-part format; else None (an adapter
    wraps one, or a part was split). Each output column keeps its own bits: the kernels compute columns
    independently."""
    from mtp.core.runtime.kernels.qlinear import KernelWeight

    if not all(type(m) is KernelLinear and len(m.parts) == 1 for m in linears):
        return None
    parts = [m.parts[0] for m in linears]
    if len({p.fmt for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
        return None
    if len({m.bias is None for m in linears}) != 1:
        return None
    part = KernelWeight(parts[0].fmt, torch.cat([p.data for p in parts]), "+".join(p.name for p in parts))
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    return part, bias


def _whole_layer(block: Block, qkv, gu, stacked_from: tuple, int8: bool) -> tuple:
    """(the layer's one-call kernel, the KernelLinears it holds), or (None, ()) where the layer has what
    the call lacks: q/k norms, a projection wrapped by an adapter or split into parts, biases beyond
    q/k/v's, norms with different eps."""
    from mtp.core.runtime.kernels.layer import bind_layer

    attn, mlp = block.self_attn, block.mlp
    o, down = _plain(attn.o_proj), _plain(mlp.down_proj)
    if qkv is None or gu is None or gu[1] is not None or attn.cfg.qk_norm:
        return None, ()
    if any(type(m) is not KernelLinear or len(m.parts) != 1 or m.bias is not None for m in (o, down)):
        return None, ()
    if block.input_layernorm.eps != block.post_attention_layernorm.eps:
        return None, ()
    run = bind_layer(
        block.input_layernorm.weight, qkv[0], qkv[1], o.parts[0], block.post_attention_layernorm.weight, gu[0],
        down.parts[0], attn.cfg.n_heads, attn.cfg.n_kv_heads, block.input_layernorm.eps, int8,
    )  # fmt: skip
    return run, (*stacked_from[:3], o, *stacked_from[3:], down)
