"""Which arithmetic runs a loaded model for inference: `--weights native | native-int8 | float32 | torch`.

* `native` (default): every `Linear` whose weight a GGUF file holds runs on the batch-invariant kernels
  (mtp.core.runtime.kernels) in the file's own format, its blocks as stored (SmolLM2's shipped file: Q4_1
  projections, a Q8_0 embedding tied to the output head); weights the file lacks (a mask-token row
  added to the head) and models from safetensors run on the float32 kernel.
* `native-int8`: the same blocks, with each row's activations quantised to int8 per 32-block (as
  ggml's Q8 activation blocks are) and integer dot products: about twice as fast as `native` on
  these CPUs, batch-invariant too, but not the float32 model's arithmetic: its text moves from
  `native`'s as llama.cpp's Q4_1 text moves from its F32 (benchmarks/results/kernel/).
* `float32`: every `Linear` on the float32 kernel, over the loader's float32 weights (what `native`
  dequantises to).
* `torch`: the path before the kernels: oneDNN-packed float32 matmuls and torch's attention. Faster to
  set up, not batch-invariant: a row's logits move with the other rows of its pass (~1e-4).

`native` computes exactly what `float32` computes, bit for bit (a block dequantises to the loader's
float32 values and both kernels share one reduction order), reading 5.5x fewer bytes. With the three
kernel choices, RMSNorm, attention over the KV cache and the SiLU product run on the layer ops of the
same library, so the model's logits for a row are bit-identical whatever else shares its pass:
`ntp`, `verify` and `tree` do the same arithmetic on every position (tests/test_weights.py,
benchmarks/identity.py). How a pass runs on them (the module swap and the `Runner`: whole layers as
one C++ call, or op by op) is `mtp.core.runtime.runner`'s; this module decides which weights and
formats go there. Only rows without autograd use them; training takes the torch path.

Where the kernels cannot run (no C++ compiler, a failed build, `MTP_KERNELS=0`), the kernel choices
fall back to `torch`, and the one-line description says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mtp.core.runtime import kernels, runner
from mtp.core.runtime.model import Linear, RMSNorm, pack_weights
from mtp.core.runtime.runner import KernelLinear, KernelRMSNorm

CHOICES = ("native", "native-int8", "float32", "torch")


def check_weights(value: str) -> str:
    if value not in CHOICES:
        raise ValueError(f"--weights {value!r}: expected one of {', '.join(CHOICES)}")
    return value


QUANTIZE = ("q8_0", "q4_0", "q4_1")


def check_quantize(value: str | None, gguf: Path | None = None) -> str | None:
    """`--quantize` checked: None, or a block format of QUANTIZE for a model that has no GGUF blocks."""
    if value is None:
        return None
    if value not in QUANTIZE:
        raise ValueError(f"--quantize {value!r}: expected one of {', '.join(QUANTIZE)}")
    if gguf is not None:
        raise ValueError(
            f"--quantize {value}: the model comes from a GGUF file ({Path(gguf).name}) whose weights are already "
            "blocks; --quantize is for float32 (safetensors) checkpoints"
        )
    return value


def attach(
    model: torch.nn.Module, weights: str = "native", gguf: Path | None = None, quantize: str | None = None
) -> str:
    """Prepare `model` (weights final: adapter loaded, mask token added) for inference with `weights`;
    `gguf`: the file the model was loaded from, if any (`native` reads its blocks). `quantize`
    (q8_0 / q4_0 / q4_1, models without a GGUF only): every Linear whose input size is a multiple of 32
    is quantised to that format once, here, with the `gguf` package's quantiser, and its float32
    weight replaced by the dequantised values, so every path (kernels, torch, training) computes the
    quantised model; `native` then runs the blocks. Returns one line saying what runs, e.g. 'native
    (kernels, avx512): 210 q4_1, 1 q8_0, 1 f32 linears'."""
    check_weights(weights)
    check_quantize(quantize, gguf)
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        if quantize is not None:
            raise ValueError(f"--quantize {quantize}: needs a float32 CPU model, this one is {p.dtype} on {p.device}")
        return f"torch ({p.dtype} on {p.device}: the kernels serve float32 CPU models)"
    quantized = quantize_linears(model, quantize) if quantize is not None else {}
    line = _attach(model, weights, gguf, quantized)
    return line if quantize is None else f"{line}; quantised to {quantize} at load ({len(quantized)} linears)"


def quantize_linears(model: torch.nn.Module, fmt: str) -> dict:
    """Quantise every Linear of `model` whose input size is a multiple of 32 to `fmt` blocks (the
    `gguf` package's quantiser) and write the dequantised values back into its weight (tied weights
    once); returns parameter name -> KernelWeight."""
    from mtp.core.runtime.kernels.qlinear import KernelWeight

    out, done = {}, {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, Linear) or mod.in_features % 32:
                continue
            key = _param_name(name)
            w = mod.weight
            if id(w) not in done:
                kw = KernelWeight.quantize(w.detach(), fmt, key)
                w.copy_(kw.dequantize())
                done[id(w)] = kw
            out[key] = done[id(w)]
    return out


def _attach(model: torch.nn.Module, weights: str, gguf: Path | None, quantized: dict) -> str:
    disable(model)
    if weights != "torch" and not kernels.load(quiet=True):
        pack_weights(model)
        line = (
            f"torch (oneDNN-packed; {weights} needs the kernels, which are unavailable: {kernels.why_unavailable()}; "
            "passes run 1.5-3x slower and are not batch-invariant)"
        )
        print(f"mtp: weights: {line}", file=sys.stderr)
        return line
    if weights == "torch":
        pack_weights(model)
        return "torch (oneDNN-packed float32, not batch-invariant)"
    from mtp.core.runtime.kernels.qlinear import KernelWeight, gguf_weights

    native, int8 = weights.startswith("native"), weights == "native-int8"
    blocks = (gguf_weights(gguf) if gguf is not None else quantized) if native else {}
    # the model is the loader's conversion of this very file (mtp.core.runtime.loading.from_gguf)
    converted = gguf is not None and getattr(model, "gguf_source", None) == Path(gguf).resolve()
    counts: dict[str, int] = {}
    with torch.no_grad():
        for name, mod in list(model.named_modules()):
            if isinstance(mod, Linear):
                w, key = mod.weight.detach(), _param_name(name)
                as_loaded = converted and getattr(mod.weight, "loaded_version", None) == mod.weight._version
                parts = _native_parts(blocks.get(key), w, as_loaded) or [KernelWeight.from_float(w.contiguous(), key)]
                KernelLinear.bind(mod, parts, int8)
                for part in parts:
                    counts[part.fmt] = counts.get(part.fmt, 0) + 1
            elif isinstance(mod, RMSNorm):
                KernelRMSNorm.bind(mod)
            elif hasattr(mod, "unpack"):  # an adapter's fused oneDNN weights
                mod.unpack()
        model.runner = runner.build(model, weights)
    what = ", ".join(f"{n} {f}" for f, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    isa = kernels.ISA_NAMES[kernels.resolve_isa(int8=int8)]
    if native and gguf is None and not quantized:
        return f"{weights} = float32 (kernels, {isa}; the model has no GGUF blocks): {what} linears"
    return f"{weights} (kernels, {isa}): {what} linears"


def attach_proposer(proposer, model: torch.nn.Module, weights: str = "native") -> int:
    """Put a proposer's own modules (`proposer.modules()`: an EAGLE-3 drafter, MTP heads) on the kernels
    too, after `attach(model, weights)`: their float32 `Linear`s run on the float32 kernel (`native`,
    `float32`) or as Q8_0 blocks with int8 activations (`native-int8`, quantised here; other bits, as
    the trunk's), their RMSNorms on the layer op; the heads read out through the trunk's own head
    kernel restricted to their draft vocabulary (`set_readout`). At a few rows these run 2-8x faster
    than torch's matmuls on these CPUs, and batch-invariant. A proposer's arithmetic decides only what
    is drafted, never what is emitted (the trunk verifies every draft). `torch`, or no kernels:
    nothing changes. Returns the number of Linears put on the kernels."""
    if weights == "torch" or not kernels.loaded():
        return 0
    from mtp.core.runtime.kernels.qlinear import KernelWeight

    int8, n = weights == "native-int8", 0
    with torch.no_grad():
        for module in proposer.modules():
            for name, mod in module.named_modules():
                if isinstance(mod, Linear):
                    w = mod.weight.detach()
                    if w.dtype != torch.float32 or w.device.type != "cpu":
                        continue
                    q = int8 and mod.in_features % 32 == 0
                    kw = KernelWeight.quantize(w, "q8_0", name) if q else KernelWeight.from_float(w.contiguous(), name)
                    KernelLinear.bind(mod, [kw], int8)
                    n += 1
                elif isinstance(mod, RMSNorm):
                    KernelRMSNorm.bind(mod)
            if hasattr(module, "layer_kernel"):  # an EAGLE-3 drafter: its layer as one call
                module.layer_kernel = _drafter_layer(module, int8)
    if hasattr(proposer, "set_readout"):
        readout = _head_rows(model, getattr(proposer, "vocab", None), int8)
        if readout is not None:
            proposer.set_readout(readout)
    return n


def _drafter_layer(drafter, int8: bool):
    """The EAGLE-3 drafter's layer as one `mtp::eagle3_layer` call on the kernels its Linears were just
    put on (q/k/v and gate/up stacked: each output column keeps its bits), or None where they are not
    all single-part kernels of one format."""
    from mtp.core.runtime.kernels.layer import bind_layer

    m, cfg = drafter.midlayer, drafter.config
    attn, mlp = m.self_attn, m.mlp
    qkv = runner.stacked([attn.q_proj, attn.k_proj, attn.v_proj])
    gu = runner.stacked([mlp.gate_proj, mlp.up_proj])
    o, down = attn.o_proj, mlp.down_proj
    if qkv is None or gu is None or qkv[1] is not None or gu[1] is not None:
        return None
    if any(not isinstance(mod, KernelLinear) or len(mod.parts) != 1 or mod.bias is not None for mod in (o, down)):
        return None
    return bind_layer(
        m.input_layernorm.weight, qkv[0], None, o.parts[0], m.post_attention_layernorm.weight, gu[0],
        down.parts[0], cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps, int8, ln_hidden=m.hidden_norm.weight,
    )  # fmt: skip


def _head_rows(model: torch.nn.Module, rows: torch.Tensor | None, int8: bool):
    """h [N, dim] -> logits [N, len(rows)] (all rows: None) through the final norm and the trunk's head
    kernel (its GGUF blocks as attached), or None where the head has no kernel or rows reach past its
    first part."""
    head = model.lm_head
    if not isinstance(head, KernelLinear) or head.bound_version != head.weight._version:
        return None
    if rows is None:
        return lambda h: head(model.norm(h))
    from mtp.core.runtime.kernels.qlinear import KernelWeight

    first = head.parts[0]
    rows = rows.cpu()
    if int(rows.max()) >= first.shape[0]:
        return None
    call = runner.kernel_call([KernelWeight(first.fmt, first.data[rows], first.name + "[draft vocab]")], None, int8)
    return lambda h: call(model.norm(h))


def _param_name(module_name: str) -> str:
    """A Linear's weight under the model's parameter names (an adapter's LoRALinear wraps it as `.base`)."""
    return module_name.replace(".base", "") + ".weight"


def _native_parts(kw, w: torch.Tensor, as_loaded: bool = False) -> list | None:
    """The kernel parts of weight w [N, K] from a GGUF's blocks `kw`, if they hold w exactly: the blocks
    alone, or the blocks and float32 rows after them (a vocabulary grown by a mask token); else None.
    `as_loaded`: w is the loader's dequantisation of these very blocks, unchanged since: four rows are
    compared (a conversion cached by an older converter that ordered rows otherwise shows there), not
    all 135 M values (~0.1 s of every start); otherwise the blocks are dequantised and compared with w."""
    if kw is None or kw.shape[1] != w.shape[1] or kw.shape[0] > w.shape[0]:
        return None
    from mtp.core.runtime.kernels.qlinear import KernelWeight

    n = kw.shape[0]
    if as_loaded and n == w.shape[0]:
        rows = torch.tensor(sorted({0, n // 3, 2 * n // 3, n - 1}))
        if not torch.equal(KernelWeight(kw.fmt, kw.data[rows], kw.name).dequantize(), w[rows]):
            return None
    elif not torch.equal(kw.dequantize(), w[:n]):
        return None
    if n == w.shape[0]:
        return [kw]
    return [kw, KernelWeight.from_float(w[n:].contiguous(), kw.name + "[extra rows]")]


def disable(model: torch.nn.Module) -> None:
    """Back to the plain torch path (e.g. before training the model in place): the kernel modules become
    the reference's again and the runner goes."""
    for mod in model.modules():
        if isinstance(mod, KernelLinear):
            KernelLinear.unbind(mod)
        elif isinstance(mod, KernelRMSNorm):
            KernelRMSNorm.unbind(mod)
    if isinstance(model, torch.nn.Module) and "runner" in vars(model):
        del model.runner
