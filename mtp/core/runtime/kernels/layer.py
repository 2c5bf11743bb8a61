"""The Python face of `mtp::decoder_layer` (layer.cpp): one decoder layer of a llama-style model in one
kernel call, the same arithmetic (and bits) as running its projections, norms, RoPE, cache write and
attention as separate kernel ops, without the dispatcher and Python between them.

    run = bind_layer(ln1, qkv, qkv_bias, o, ln2, gate_up, down, n_heads=9, n_kv_heads=3, eps=1e-5)
    x = run(x, cos, sin, mask, kc, vc, rows, positions)   # x [B, T, D] -> [B, T, D]; writes kc, vc

With `ln_hidden` it binds `mtp::eagle3_layer`, the EAGLE-3 drafter's layer on the same steps, called
`run(emb, cos, ..., positions, g)`: its attention reads two normed inputs, its residual is g.

ln1, ln2: the RMSNorm weights [D] (read at each call: in-place updates count); qkv: q, k and v stacked
along the output dimension; gate_up: gate and up stacked; all four projections `KernelWeight`s of one
part each. cos, sin: [B, 1, T, head_dim]; mask: [B, 1, T, S] bool over the cache slots 0..S-1; kc, vc:
the layer's cache buffers [rows, kv_heads, capacity, head_dim]; rows: [B] int64 cache rows of the batch;
positions: [B, T] int64 slots the block's keys and values go to. Float32 CPU rows without autograd only
(the caller checks: `mtp.core.runtime.runner.kernel_rows`).
"""

from __future__ import annotations

import math

import torch

from mtp.core.runtime import kernels
from mtp.core.runtime.kernels.qlinear import KernelWeight

FORMAT_CODES = {"f32": 0, "q8_0": 1, "q4_0": 2, "q4_1": 3}  # + 4: the i8 packing with int8 activations


def bind_layer(
    ln1: torch.Tensor,
    qkv: KernelWeight,
    qkv_bias: torch.Tensor | None,
    o: KernelWeight,
    ln2: torch.Tensor,
    gate_up: KernelWeight,
    down: KernelWeight,
    n_heads: int,
    n_kv_heads: int,
    eps: float,
    int8: bool = False,
    isa: str | int | None = None,
    ln_hidden: torch.Tensor | None = None,
):
    """The layer's call with its weights, formats and ISA paths bound once (`MTP_KERNEL_ISA` read now);
    `int8`: quantised weights take int8 activations (as `qlinear.bind(..., int8=True)`).

    `ln_hidden` given: the EAGLE-3 drafter's layer (`mtp::eagle3_layer`), called with a second input g
    [B, T, D]: its attention reads [rmsnorm(x, ln1), rmsnorm(g, ln_hidden)] (qkv over 2 D columns, no
    bias) and its residual is g."""
    dim = ln1.shape[0]
    if ln_hidden is not None and (qkv.shape[1] != 2 * dim or ln_hidden.shape != ln1.shape or qkv_bias is not None):
        raise ValueError(f"bind_layer: qkv reads {qkv.shape[1]} columns, the two norms give 2 x {dim} (no bias)")
    data, formats, sizes, scale, isa_f, isa_i8 = _bound(qkv, o, gate_up, down, dim, n_heads, n_kv_heads, int8, isa)
    bias = None if qkv_bias is None else qkv_bias.detach()
    if ln_hidden is None:
        op, weights = torch.ops.mtp.decoder_layer.default, [ln1, data[0], data[1], ln2, data[2], data[3]]

        def call(x, cos, sin, mask, kc, vc, rows, positions):
            return op(
                x, cos, sin, mask, kc, vc, rows, positions, weights, bias, formats, sizes,
                n_heads, n_kv_heads, eps, scale, isa_f, isa_i8,
            )  # fmt: skip

        return call
    op, weights = torch.ops.mtp.eagle3_layer.default, [ln1, ln_hidden, data[0], data[1], ln2, data[2], data[3]]

    def call_eagle3(x, cos, sin, mask, kc, vc, rows, positions, g):
        return op(
            x, g, cos, sin, mask, kc, vc, rows, positions, weights, formats, sizes,
            n_heads, n_kv_heads, eps, scale, isa_f, isa_i8,
        )  # fmt: skip

    return call_eagle3


def _bound(qkv, o, gate_up, down, dim: int, n_heads: int, n_kv_heads: int, int8: bool, isa):
    """The projections checked and packed for the layer ops: (data, formats, sizes, scale, isa, isa_i8)."""
    if not kernels.available():
        raise ValueError(f"bind_layer: the kernels are not available ({kernels.why_unavailable()})")
    projections = (qkv, o, gate_up, down)
    for w in projections:
        if not isinstance(w, KernelWeight):
            raise ValueError(f"bind_layer: projections must be KernelWeights, got {type(w).__name__}")
    hd, rem = divmod(qkv.shape[0], n_heads + 2 * n_kv_heads)
    if rem or n_heads % n_kv_heads:
        raise ValueError(
            f"bind_layer: {n_heads} query and {n_kv_heads} key heads do not fit a qkv of {qkv.shape[0]} outputs"
        )
    if o.shape != (dim, n_heads * hd) or down.shape[0] != dim or gate_up.shape != (2 * down.shape[1], dim):
        raise ValueError(
            f"bind_layer: shapes disagree: qkv {list(qkv.shape)}, o {list(o.shape)}, "
            f"gate_up {list(gate_up.shape)}, down {list(down.shape)}, dim {dim}"
        )
    quant = [int8 and w.fmt != "f32" for w in projections]
    data = [w.packed_int8() if q else w.data for w, q in zip(projections, quant)]
    formats = [FORMAT_CODES[w.fmt] + 4 * q for w, q in zip(projections, quant)]
    sizes = [w.shape[0] for w in projections]
    isa_f, isa_i8 = kernels.resolve_isa(isa), kernels.resolve_isa(isa, int8=True) if any(quant) else -1
    return data, formats, sizes, 1.0 / math.sqrt(hd), isa_f, isa_i8
