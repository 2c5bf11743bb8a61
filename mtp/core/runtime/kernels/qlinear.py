"""The Python face of the small-row kernels (`mtp.core.runtime.kernels`): a weight as the kernels hold it
(`KernelWeight`: float32 data, or GGUF blocks exactly as stored) and `linear(x, weight)`.

    w = KernelWeight.from_gguf(reader_tensor)          # Q8_0 / Q4_0 / Q4_1 blocks kept as stored
    y = linear(x, w)                                   # x [..., K] float32 -> y [..., N]
    w.dequantize()                                     # float32 [N, K], equal to the loader's values
    y = linear_int8(x, w)                              # int8 activations: faster, not float32's bits

Errors are one line: a ValueError for bad input (dtype, shape, a grad-requiring input), for a block
whose scale is NaN or infinite (naming the tensor, row and block). A GGUF type the kernels lack
(Q5_K, IQ4_NL, ...) is dequantised to float32 by the `gguf` package and served by the float32 kernel,
with one line on stderr naming the tensor, its type and that fallback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mtp.core.runtime import kernels

FORMATS = {"f32": None, "q8_0": (34, 2), "q4_0": (18, 2), "q4_1": (20, 4)}  # block bytes, scale bytes
GGUF_FORMATS = {"F32": "f32", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
_OPS = {"f32": "linear_f32", "q8_0": "linear_q8_0", "q4_0": "linear_q4_0", "q4_1": "linear_q4_1"}


_op_cache: dict = {}


def _op(name: str):
    op = _op_cache.get(name)
    if op is None:
        op = _op_cache[name] = getattr(torch.ops.mtp, name).default
    return op


class KernelWeight:
    """A weight [N, K] for the kernels: `fmt` 'f32' (data: float32 [N, K]) or 'q8_0' / 'q4_0' / 'q4_1'
    (data: uint8 [N, K/32 * block bytes], GGUF blocks as stored: ggml's layout, row n = output n)."""

    __slots__ = ("_float", "_packed", "data", "fmt", "name", "shape")

    def __init__(self, fmt: str, data: torch.Tensor, name: str = ""):
        if fmt not in FORMATS:
            raise ValueError(f"unknown kernel weight format {fmt!r}: expected one of {', '.join(FORMATS)}")
        label = f"{name}: " if name else ""
        if not isinstance(data, torch.Tensor) or data.dim() != 2 or data.device.type != "cpu":
            raise ValueError(
                f"{label}a {fmt} weight must be a 2-D CPU tensor, got "
                f"{type(data).__name__ if not isinstance(data, torch.Tensor) else list(data.shape)}"
            )
        if fmt == "f32":
            if data.dtype != torch.float32:
                raise ValueError(f"{label}a f32 weight must be float32, got {data.dtype}")
            shape = tuple(data.shape)
        else:
            size = FORMATS[fmt][0]
            if data.dtype != torch.uint8 or data.shape[1] % size:
                raise ValueError(
                    f"{label}{fmt} blocks must be uint8 [N, K/32*{size}], got {data.dtype} {list(data.shape)}"
                )
            shape = (data.shape[0], data.shape[1] // size * 32)
        self.fmt, self.shape, self.name = fmt, shape, name
        self.data = data.detach().contiguous()
        self._float = self._packed = None
        if fmt != "f32":
            check_scales(self.data, fmt, name)

    def __repr__(self):
        return f"KernelWeight({self.fmt}, {list(self.shape)}{', ' + self.name if self.name else ''})"

    @classmethod
    def from_float(cls, w: torch.Tensor, name: str = "") -> KernelWeight:
        return cls("f32", w, name)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor | np.ndarray, fmt: str, name: str = "") -> KernelWeight:
        if isinstance(blocks, np.ndarray):
            blocks = torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True))
        return cls(fmt, blocks, name)

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: str, name: str = "") -> KernelWeight:
        """Quantise float32 [N, K] with the `gguf` package's reference quantiser (tests, benchmarks)."""
        import gguf

        if fmt == "f32":
            return cls.from_float(w.float().contiguous(), name)
        qtype = gguf.GGMLQuantizationType[fmt.upper()]
        blocks = gguf.quants.quantize(w.detach().float().contiguous().numpy(), qtype)
        return cls.from_blocks(blocks, fmt, name)

    @classmethod
    def from_gguf(cls, tensor, unpermute_heads: int | None = None) -> KernelWeight:
        """A 2-D tensor as stored in a GGUF file (`mtp.core.runtime.gguf.GGUFTensor`, or a `gguf.GGUFReader`'s:
        name, tensor_type, shape, data; its blocks are copied out of the file's memory map).
        `unpermute_heads`: llama.cpp's rotary row order of a Q/K projection, undone as the loader
        does (`mtp.core.runtime.gguf.unpermute` with that many heads): whole rows move, blocks stay intact."""
        import gguf

        name, kind = tensor.name, gguf.GGMLQuantizationType(tensor.tensor_type)
        dims = [int(d) for d in tensor.shape]
        if len(dims) != 2:
            raise ValueError(f"{name}: the kernels take 2-D weights, this tensor has shape {dims}")
        k, n = dims  # GGUF order: fastest dimension first
        fmt = GGUF_FORMATS.get(kind.name)
        if fmt is None:
            try:
                arr = gguf.quants.dequantize(tensor.data, kind)
            except (NotImplementedError, ValueError, TypeError) as e:
                raise ValueError(f"{name}: GGUF type {kind.name} cannot be dequantised ({e})") from None
            data = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(n, k)
            if kind.name not in ("F16", "BF16"):  # exact in float32: no message
                kernels._say(
                    f"tensor {name} is {kind.name}, which the kernels lack; dequantised to float32 "
                    "(the float32 kernel serves it)"
                )
            fmt = "f32"
        elif fmt == "f32":
            data = torch.from_numpy(np.array(tensor.data, dtype=np.float32)).reshape(n, k)
        else:
            data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(n, -1))
        if unpermute_heads:
            data = data[unpermute_rows(n, unpermute_heads)]
        return cls(fmt, data, name)

    def dequantize(self, isa: str | int | None = None) -> torch.Tensor:
        """float32 [N, K]: the values the loader (`gguf.quants.dequantize`) gives for these blocks."""
        if self.fmt == "f32":
            return self.data
        if kernels.available():
            return getattr(torch.ops.mtp, f"dequantize_{self.fmt}")(self.data, kernels.resolve_isa(isa))
        import gguf

        arr = gguf.quants.dequantize(self.data.numpy(), gguf.GGMLQuantizationType[self.fmt.upper()])
        return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(self.shape)

    def packed_int8(self) -> torch.Tensor:
        """The i8 packing of the blocks (`pack_int8`), made on first use and kept."""
        if self._packed is None:
            self._packed = pack_int8(self.data, self.fmt)
        return self._packed

    def float_weight(self) -> torch.Tensor:
        """The float32 weight, kept after the first call (the pure-torch path's)."""
        if self._float is None:
            self._float = self.dequantize()
        return self._float


I8_TILE = 16


def pack_int8(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """GGUF blocks [N, K/32 * block bytes] -> the int8-activation ops' packing: uint8
    [ceil(N/16), K/32, record bytes], a byte permutation (16 columns interleaved per block; layout in
    matmul_i8.h). Rows past N are zero blocks (scale 0), never written to the output."""
    size, scale_bytes = FORMATS[fmt]
    n, nb = blocks.shape[0], blocks.shape[1] // size
    tiles = -(-n // I8_TILE)
    padded = torch.zeros(tiles * I8_TILE, nb * size, dtype=torch.uint8)
    padded[:n] = blocks
    b = padded.view(tiles, I8_TILE, nb, size)
    qs = b[..., scale_bytes:]  # [T, 16, nb, 32 or 16]
    qs = qs.reshape(tiles, I8_TILE, nb, -1, 4).permute(0, 2, 3, 1, 4).reshape(tiles, nb, -1)  # [T, nb, g, 16, 4]
    scales = [b[..., i : i + 2].permute(0, 2, 1, 3).reshape(tiles, nb, 2 * I8_TILE) for i in range(0, scale_bytes, 2)]
    return torch.cat([qs, *scales], dim=-1).contiguous()


def check_scales(blocks: torch.Tensor, fmt: str, name: str = "") -> None:
    """Refuse blocks whose fp16 scale (d, and m for Q4_1) is NaN or infinite, naming the tensor."""
    size, scale_bytes = FORMATS[fmt]
    n = blocks.shape[0]
    if n == 0 or blocks.shape[1] == 0:
        return
    scales = blocks.view(n, -1, size)[:, :, :scale_bytes].contiguous().view(torch.float16)
    bad = ~torch.isfinite(scales)
    if bad.any():
        row, blk, which = (int(i) for i in bad.nonzero()[0])
        value = float(scales[row, blk, which])
        raise ValueError(
            f"{name or 'weight'}: corrupt {fmt} block (row {row}, block {blk}): scale {'dm'[which]} is {value}"
        )


def unpermute_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """The row order `mtp.core.runtime.gguf.unpermute` gives a [n_rows, ...] tensor of that many heads."""
    from mtp.core.runtime.gguf import unpermute

    return unpermute(torch.arange(n_rows).view(n_rows, 1), n_heads).view(n_rows)


def _check_x(x: torch.Tensor, k: int, what: str) -> None:
    if (
        type(x) is torch.Tensor
        and x.dtype == torch.float32
        and x.is_cpu
        and x.dim() >= 1
        and x.shape[-1] == k
        and not (x.requires_grad and torch.is_grad_enabled())
    ):
        return  # the hot path
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: x must be a tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"{what}: x must be a float32 CPU tensor, got {x.dtype} on {x.device}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{what}: x has shape {list(x.shape)}, its last dimension must be {k}")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{what}: the kernels are inference-only (x requires grad; use torch.no_grad())")


def linear(
    x: torch.Tensor, weight: KernelWeight, bias: torch.Tensor | None = None, isa: str | int | None = None
) -> torch.Tensor:
    """x [..., K] float32 @ weight.T (+ bias) -> [..., N], batch-invariant (see `mtp.core.runtime.kernels`).
    `isa`: 'scalar' / 'avx2' / 'avx512' forces a path (default: `MTP_KERNEL_ISA`, else the best)."""
    if not isinstance(weight, KernelWeight):
        raise ValueError(f"linear: weight must be a KernelWeight, got {type(weight).__name__}")
    n, k = weight.shape
    _check_x(x, k, f"linear({weight.name or weight.fmt})")
    rows = x.reshape(-1, k)
    if kernels.available():
        y = _op(_OPS[weight.fmt])(rows, weight.data, kernels.resolve_isa(isa))
    else:  # the pure-torch path: each row alone (batch-invariant), other bits than the kernels
        w = weight.float_weight()
        y = (
            torch.cat([F.linear(rows[i : i + 1], w) for i in range(rows.shape[0])])
            if rows.shape[0]
            else rows.new_empty(0, n)
        )
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


def linear_int8(
    x: torch.Tensor, weight: KernelWeight, bias: torch.Tensor | None = None, isa: str | int | None = None
) -> torch.Tensor:
    """Like `linear`, with the activations quantised to int8 per row per 32-block (ggml's Q8 activation
    blocks, with a float32 scale) and integer dot products: faster, batch-invariant too, but not the
    float32 result (the activation rounding moves it). Q8_0 / Q4_0 / Q4_1 weights only."""
    if not isinstance(weight, KernelWeight):
        raise ValueError(f"linear_int8: weight must be a KernelWeight, got {type(weight).__name__}")
    if weight.fmt == "f32":
        raise ValueError(f"linear_int8({weight.name or 'f32'}): int8 activations need a Q8_0/Q4_0/Q4_1 weight")
    n, k = weight.shape
    _check_x(x, k, f"linear_int8({weight.name or weight.fmt})")
    if not kernels.available():
        raise ValueError(
            f"linear_int8: the kernels are not available ({kernels.why_unavailable()}); "
            "use linear (float32 activations)"
        )
    rows = x.reshape(-1, k)
    y = _op(_OPS[weight.fmt] + "_i8")(rows, weight.packed_int8(), n, kernels.resolve_isa(isa, int8=True))
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


def bind(weight: KernelWeight, int8: bool = False, isa: str | int | None = None):
    """x [..., K] -> `linear(x, weight)` (or `linear_int8` with `int8` on a quantised weight) with the op,
    its weight data and the ISA path resolved once, here (`MTP_KERNEL_ISA` is read now): what a model
    calls every pass. x must be float32 CPU rows without autograd (the caller checks:
    `mtp.core.runtime.runner.kernel_rows`); a wrong last dimension is a ValueError."""
    if not kernels.available():
        return lambda x: linear(x, weight)
    n, k = weight.shape
    if int8 and weight.fmt != "f32":
        op, data, i = _op(_OPS[weight.fmt] + "_i8"), weight.packed_int8(), kernels.resolve_isa(isa, int8=True)

        def call(x):
            if x.shape[-1] != k:
                raise ValueError(
                    f"linear_int8({weight.name}): x has shape {list(x.shape)}, its last dimension must be {k}"
                )
            return op(x.reshape(-1, k), data, n, i).view(*x.shape[:-1], n)

        return call
    op, data, i = _op(_OPS[weight.fmt]), weight.data, kernels.resolve_isa(isa)

    def call(x):
        if x.shape[-1] != k:
            raise ValueError(f"linear({weight.name}): x has shape {list(x.shape)}, its last dimension must be {k}")
        return op(x.reshape(-1, k), data, i).view(*x.shape[:-1], n)

    return call


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., K] -> the float32 values the int8-activation ops multiply (q * d per 32-block,
    d = amax / 127, round half to even): a reference for tests and for measuring the rounding."""
    b = x.reshape(-1, x.shape[-1] // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv).clamp(-127, 127)
    bad = ~torch.isfinite(b).all(-1, keepdim=True)
    q, d = q.masked_fill(bad, 0), d.masked_fill(bad, float("nan"))
    return (q * d).reshape(x.shape)


def _typed(fmt: str):
    def op(x: torch.Tensor, w: torch.Tensor, isa: str | int | None = None) -> torch.Tensor:
        return linear(x, KernelWeight(fmt, w) if not isinstance(w, KernelWeight) else w, isa=isa)

    op.__name__ = op.__qualname__ = f"linear_{fmt}"
    op.__doc__ = f"x [..., K] @ W.T for W given as {fmt} data (a tensor as `KernelWeight` takes it)."
    return op


linear_f32, linear_q8_0, linear_q4_0, linear_q4_1 = (_typed(f) for f in ("f32", "q8_0", "q4_0", "q4_1"))


def gguf_weights(path: str | Path, only_linear: bool = True) -> dict[str, KernelWeight]:
    """Every 2-D weight of a GGUF file as a KernelWeight under mtp's parameter names (the names
    `mtp.core.runtime.gguf.read_gguf` gives), blocks kept as stored, Q/K rows of llama/mistral unpermuted as
    the loader does: what a model needs to run its `Linear`s on the kernels. `only_linear` leaves out
    the token embedding (it is also the tied LM head: `lm_head.weight` is added for it when the file
    has no `output.weight`). The file is read by the loader's one reader (`mtp.core.runtime.gguf.read_tensors`);
    the rules for the row order and the tied head are the loader's too."""
    from mtp.core.runtime.gguf import our_name, read_tensors, tied_head, unpermuted_heads

    meta, tensors = read_tensors(Path(path))
    arch = meta.get("general.architecture")
    n_heads = meta.get(f"{arch}.attention.head_count")
    n_kv = meta.get(f"{arch}.attention.head_count_kv", n_heads)
    tied = tied_head(t.name for t in tensors)
    out = {}
    for t in tensors:
        ours = our_name(t.name)
        if not ours or len(t.shape) != 2:
            continue
        w = KernelWeight.from_gguf(t, unpermute_heads=unpermuted_heads(arch, ours, n_heads, n_kv))
        if ours == "embed_tokens.weight":
            if tied:
                out["lm_head.weight"] = w
            if only_linear:
                continue
        out[ours] = w
    return out


def describe() -> str:
    """One line: which path `linear` runs here."""
    if not kernels.available():
        return f"pure-torch path ({kernels.why_unavailable()})"
    return f"C++ kernels, {kernels.ISA_NAMES[kernels.resolve_isa()]} path"


if __name__ == "__main__":
    print(describe(), file=sys.stdout)
