"""Inference on the batch-invariant kernels (`core.runtime.weights`, `core/runtime/kernels/layer_ops.cpp`): the layer
ops give a row the same bits whatever shares its pass (other rows, padding behind the visible keys, the ISA
path), and so does a whole model: logits of 1-row and k-row passes `torch.equal`, token trees and chains
identical to `ntp`, on tiny models and on SmolLM2 in its own Q4_1/Q8_0 blocks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model

from mtp.core.decoding.decode import generate
from mtp.core.decoding.proposers import MaskProposer, PromptLookupProposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.runtime import kernels, weights
from mtp.core.runtime.cache import KVCache
from mtp.core.runtime.model import add_mask_token
from mtp.core.runtime.runner import KernelLinear

ISAS = ["scalar", "avx2", "avx512"]


@pytest.fixture(scope="module", autouse=True)
def built():
    if not kernels.load():
        pytest.skip(f"the C++ kernels do not build here ({kernels.why_unavailable()})")


def need(isa: str) -> int:
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU does not run the {isa} path")
    return kernels.ISAS[isa]


def attention_inputs(B=2, H=4, Hkv=2, T=5, S=12, hd=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g)
    k = torch.randn(B, Hkv, S, hd, generator=g)
    v = torch.randn(B, Hkv, S, hd, generator=g)
    mask = torch.rand(B, 1, T, S, generator=g) < 0.6
    mask[..., 0] = True  # every row sees at least one key
    return q, k, v, mask


@pytest.mark.parametrize("hd", [64, 8, 20])
@pytest.mark.parametrize("isa", ISAS)
def test_attention_row_depends_on_its_visible_keys_only(isa, hd):
    n = need(isa)
    q, k, v, mask = attention_inputs(hd=hd, seed=hd)
    scale = 1.0 / math.sqrt(hd)
    full = torch.ops.mtp.attention(q, k, v, mask, scale, n)  # [B, T, H, hd]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(full, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(99)
    pad = 7  # keys behind the visible ones, hidden, with other values: exact zeros of the row's result
    k2 = torch.cat([k, torch.randn(2, 2, pad, hd, generator=g)], 2)
    v2 = torch.cat([v, torch.randn(2, 2, pad, hd, generator=g)], 2)
    for b in range(2):
        for t in range(5):
            m1 = torch.cat([mask[b : b + 1, :, t : t + 1], torch.zeros(1, 1, 1, pad, dtype=torch.bool)], -1)
            alone = torch.ops.mtp.attention(q[b : b + 1, :, t : t + 1], k2[b : b + 1], v2[b : b + 1], m1, scale, n)
            assert torch.equal(alone[0, 0], full[b, t])
    other = q.clone()
    other[:, :, 1:] = torch.randn(2, 4, 4, hd, generator=g)  # the neighbours' queries change
    assert torch.equal(torch.ops.mtp.attention(other, k, v, mask, scale, n)[:, 0], full[:, 0])


@pytest.mark.parametrize("hd", [16, 64, 96, 128])
@pytest.mark.parametrize("per_head_mask", [False, True])
def test_attention_vector_paths_equal_the_plain_loops(hd, per_head_mask):
    """The AVX2/AVX-512 paths (keys scored in groups, a KV group's heads sharing one pass over the values) give
    the scalar loops' bits: 5 heads per KV head (groups of 4 + 1 on AVX-512), key counts off the group size."""
    g = torch.Generator().manual_seed(hd)
    B, H, Hkv, T, S = 2, 10, 2, 3, 37
    q = torch.randn(B, H, T, hd, generator=g)
    k, v = torch.randn(B, Hkv, S, hd, generator=g) * 2, torch.randn(B, Hkv, S, hd, generator=g)
    mask = torch.rand(B, H if per_head_mask else 1, T, S, generator=g) < 0.7
    mask[..., 0] = True
    outs = [torch.ops.mtp.attention(q, k, v, mask, 0.125, kernels.ISAS[isa]) for isa in kernels.supported_isas()]
    assert len(outs) > 1 or kernels.supported_isas() == ["scalar"]
    for got in outs[1:]:
        assert torch.equal(got, outs[0])
    for b, t, h in ((0, 0, 0), (1, 2, 7), (1, 1, 9)):  # a row alone, its neighbours and other heads absent
        m = mask[b : b + 1, (h if per_head_mask else 0) : (h if per_head_mask else 0) + 1, t : t + 1]
        kv = slice(h // 5, h // 5 + 1)
        qr = q[b : b + 1, h : h + 1, t : t + 1]
        alone = torch.ops.mtp.attention(qr, k[b : b + 1, kv], v[b : b + 1, kv], m, 0.125)
        assert torch.equal(alone[0, 0, 0], outs[0][b, t, h])


def test_layer_ops_same_bits_on_every_isa_and_thread_count():
    q, k, v, mask = attention_inputs(T=9, S=40, seed=3)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(4))
    w = torch.randn(96, generator=torch.Generator().manual_seed(5))
    outs = []
    for isa in kernels.supported_isas():
        n = kernels.ISAS[isa]
        outs.append(
            (
                torch.ops.mtp.attention(q, k, v, mask, 0.125, n),
                torch.ops.mtp.rmsnorm(x, w, 1e-5, n),
                torch.ops.mtp.silu_mul(x, x * 2, n),
            )
        )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        outs.append(
            (
                torch.ops.mtp.attention(q, k, v, mask, 0.125),
                torch.ops.mtp.rmsnorm(x, w, 1e-5),
                torch.ops.mtp.silu_mul(x, x * 2),
            )
        )
    finally:
        torch.set_num_threads(threads)
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))


@pytest.mark.parametrize("n", [96, 37])
def test_rmsnorm_and_silu_mul_rows_are_invariant(n):
    g = torch.Generator().manual_seed(n)
    x, u, w = torch.randn(33, n, generator=g), torch.randn(33, n, generator=g), torch.randn(n, generator=g)
    norm, prod = torch.ops.mtp.rmsnorm(x, w, 1e-6), torch.ops.mtp.silu_mul(x, u)
    torch.testing.assert_close(norm, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))
    torch.testing.assert_close(prod, F.silu(x) * u)
    for i in (0, 5, 32):
        assert torch.equal(torch.ops.mtp.rmsnorm(x[i : i + 1], w, 1e-6)[0], norm[i])
        assert torch.equal(torch.ops.mtp.silu_mul(x[i : i + 1], u[i : i + 1])[0], prod[i])


def test_layer_ops_bad_input_is_one_line():
    q, k, v, mask = attention_inputs()
    with pytest.raises(RuntimeError, match="mask must be"):
        torch.ops.mtp.attention(q, k, v, mask[..., :3], 0.1)
    with pytest.raises(RuntimeError, match="cannot share"):
        torch.ops.mtp.attention(q, k.repeat(1, 2, 1, 1)[:, :3], v.repeat(1, 2, 1, 1)[:, :3], mask, 0.1)
    with pytest.raises(RuntimeError, match="rmsnorm weight"):
        torch.ops.mtp.rmsnorm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="--weights 'q4'"):
        weights.check_weights("q4")


def passes(model, tokens: list[int], split: list[int]) -> torch.Tensor:
    """Logits of every position after the first, computed in passes of the sizes in `split`."""
    cache = KVCache.for_model(model, 1, 128)
    out, at = [], 1
    with torch.inference_mode():
        model(torch.tensor([tokens[:1]]), torch.zeros(1, 1, dtype=torch.long), cache)
        cache.commit(0, 1)
        for n in split:
            out.append(model(torch.tensor([tokens[at : at + n]]), torch.arange(at, at + n).view(1, -1), cache)[0])
            cache.commit(0, n)
            at += n
    return torch.cat(out)


def test_a_weight_changed_in_place_leaves_the_one_call_layer():
    """A layer whose weight changed after `attach` stops running on the kernel's copy of it
    (`runner.current` sees the weight's version): Q8_0 blocks are a copy, so a stale call would give
    the logits of before bit for bit."""
    model = tiny_model(12)
    weights.attach(model, "native", quantize="q8_0")
    assert all(model.runner.layers[layer].whole is not None for layer in model.layers)
    tokens = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    before = passes(model, tokens, [8])
    assert torch.equal(passes(model, tokens, [8]), before)
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(2.0)
    assert not torch.allclose(passes(model, tokens, [8]), before, atol=1e-3)


def test_tiny_model_rows_are_bit_identical_in_any_pass():
    model = tiny_model(5)
    line = weights.attach(model, "float32")
    assert "float32 (kernels" in line and "f32 linears" in line
    tokens = torch.randint(0, 97, (33,), generator=torch.Generator().manual_seed(1)).tolist()
    one = passes(model, tokens, [1] * 32)
    for split in ([4] * 8, [16, 16], [32], [3, 1, 7, 2, 19]):
        assert torch.equal(passes(model, tokens, split), one)
    weights.disable(model)  # the torch path: other arithmetic, so other bits, within float tolerance
    torch_path = passes(model, tokens, [32])
    torch.testing.assert_close(torch_path, one, rtol=1e-4, atol=1e-4)
    assert not torch.equal(torch_path, one)


@pytest.mark.parametrize("strategy", ["verify:4", "tree:8", "verify:3"])
def test_tiny_model_chains_and_trees_equal_ntp(strategy):
    model = tiny_model(2)
    add_mask_token(model)
    weights.attach(model, "float32")
    prop = MaskProposer() if strategy == "verify:3" else PromptLookupProposer()
    for seed in range(3):
        prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = generate(model, prompt, "ntp", SamplingParams(max_new_tokens=40))
        out = generate(model, prompt, strategy, SamplingParams(max_new_tokens=40), proposer=prop)
        assert out.output == ref.output


def test_attach_without_kernels_falls_back_to_torch(monkeypatch, capsys):
    model = tiny_model(1)
    monkeypatch.setattr(kernels, "load", lambda quiet=False: False)
    line = weights.attach(model, "native")
    assert line.startswith("torch (oneDNN-packed; native needs the kernels")
    assert capsys.readouterr().err.strip() == f"mtp: weights: {line}"  # one line says which path runs
    assert not any(isinstance(m, KernelLinear) for m in model.modules()) and model.runner is None


@pytest.mark.slow
def test_smollm2_runs_native_blocks_bit_identically(smollm2):
    assert smollm2.weights_line.startswith("native (kernels") and "q4_1" in smollm2.weights_line
    head = smollm2.model.lm_head.parts
    assert [p.fmt for p in head] == ["q8_0"]  # the tied embedding, as stored
    tokens = smollm2.encode("Name three rivers in Europe and one fact about each.")[:40]
    one = passes(smollm2.model, tokens, [1] * (len(tokens) - 1))
    assert torch.equal(passes(smollm2.model, tokens, [len(tokens) - 1]), one)
    assert torch.equal(passes(smollm2.model, tokens, [4] * ((len(tokens) - 1) // 4) + [(len(tokens) - 1) % 4]), one)


@pytest.mark.slow
def test_smollm2_native_is_float32_arithmetic_and_int8_is_invariant(smollm2):
    """`native` reads the blocks, `float32` the loader's float32 weights: the same values in the same
    order, so the same bits; `native-int8` rounds activations (other bits), batch-invariant all the same."""
    model, gguf = smollm2.model, smollm2.loaded.gguf
    tokens = smollm2.encode("Write a haiku about the sea.")[:24]
    native = passes(model, tokens, [len(tokens) - 1])
    try:
        weights.attach(model, "float32", gguf)
        assert torch.equal(passes(model, tokens, [1] * (len(tokens) - 1)), native)
        assert "q4_1" in weights.attach(model, "native-int8", gguf)
        int8 = passes(model, tokens, [len(tokens) - 1])
        assert not torch.equal(int8, native)
        torch.testing.assert_close(int8, native, rtol=0, atol=3.0)  # the activation rounding: up to ~1.7
        assert torch.equal(
            passes(model, tokens, [3, 1] * ((len(tokens) - 1) // 4) + [1] * ((len(tokens) - 1) % 4)), int8
        )
    finally:
        weights.attach(model, "native", gguf)


def test_adapters_added_after_attach_keep_the_kernel_path_and_its_bits():
    """`mtp train` attaches first, then wraps projections in LoRA adapters: a pass without mask tokens
    (the teacher's, self-generation) still runs the stacked kernels and gives the same logits; a pass
    with masks goes through the adapters."""
    from mtp.core.runtime.adapter import add_adapters

    model = tiny_model(4)
    weights.attach(model, "float32")
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        before = model(tokens)
    add_adapters(model, rank=4, alpha=8)
    with torch.inference_mode():
        # B starts at zero and no mask: the layers add nothing (the head grew a mask row: a new Linear)
        torch.testing.assert_close(model(tokens)[..., :97], before, rtol=1e-5, atol=1e-5)
        masked = tokens.clone()
        masked[0, -2:] = model.config.mask_token_id
        assert torch.isfinite(model(masked)).all()


def per_op_layer(x, cos, sin, mask, kc, vc, rows, positions, ws, bias, H, Hkv, eps, int8):
    """The per-op path of one decoder layer (Block.forward with the kernels attached), op by op."""
    from mtp.core.runtime.kernels.qlinear import linear, linear_int8

    ln1, qkv_w, o_w, ln2, gu_w, down_w = ws

    def lin(a, w):
        return linear_int8(a, w) if int8 and w.fmt != "f32" else linear(a, w)

    ops = torch.ops.mtp
    B, T, D = x.shape
    hd = qkv_w.shape[0] // (H + 2 * Hkv)
    x2 = x.reshape(-1, D)
    qkv = lin(ops.rmsnorm(x2, ln1, eps), qkv_w)
    if bias is not None:
        qkv = qkv + bias
    q = ops.rope(qkv[:, : H * hd].view(B, T, H, hd), cos, sin)
    k = ops.rope(qkv[:, H * hd : (H + Hkv) * hd].view(B, T, Hkv, hd), cos, sin)
    v = qkv[:, (H + Hkv) * hd :].view(B, T, Hkv, hd).transpose(1, 2)
    ops.kv_write(kc, vc, rows, positions, k, v)
    S = mask.shape[-1]
    y = ops.attention(q, kc[rows, :, :S], vc[rows, :, :S], mask, 1.0 / math.sqrt(hd))
    x1 = x2 + lin(y.view(B * T, -1), o_w)
    gu = lin(ops.rmsnorm(x1, ln2, eps), gu_w)
    n = gu.shape[1] // 2
    return (x1 + lin(ops.silu_mul(gu[:, :n], gu[:, n:]), down_w)).view(B, T, D)


@pytest.mark.parametrize(
    "fmt,int8,bias",
    [("f32", False, True), ("q8_0", False, False), ("q4_0", True, True), ("q4_1", False, False)]
    + [("q4_1", True, False), ("q8_0", True, False)],
)
def test_whole_layer_call_has_the_per_op_bits(fmt, int8, bias):
    """mtp::decoder_layer (one call) gives exactly the bits of the layer's ops run one by one, in every
    weight format, with int8 activations, a q/k/v bias and cache rows other than the batch order."""
    from mtp.core.runtime.kernels.layer import bind_layer
    from mtp.core.runtime.kernels.qlinear import KernelWeight

    g = torch.Generator().manual_seed(3)
    B, T, D, H, Hkv, hd, inter, cap, eps = 2, 3, 64, 4, 2, 16, 96, 20, 1e-5

    def w(n, k):
        return KernelWeight.quantize(torch.randn(n, k, generator=g) * 0.2, fmt)

    ws = [torch.rand(D, generator=g) + 0.5, w((H + 2 * Hkv) * hd, D), w(D, H * hd), torch.rand(D, generator=g) + 0.5]
    ws += [w(2 * inter, D), w(D, inter)]
    b = torch.randn((H + 2 * Hkv) * hd, generator=g) if bias else None
    x = torch.randn(B, T, D, generator=g)
    positions = torch.tensor([[5, 6, 7], [5, 6, 7]])
    cos, sin = torch.rand(B, 1, T, hd, generator=g), torch.rand(B, 1, T, hd, generator=g)
    mask = (torch.rand(B, 1, T, 8, generator=g) > 0.3) | (torch.arange(8) == 0)  # a tree-like layout
    rows = torch.tensor([2, 0])
    kc0, vc0 = torch.randn(3, Hkv, cap, hd, generator=g), torch.randn(3, Hkv, cap, hd, generator=g)
    run = bind_layer(ws[0], ws[1], b, ws[2], ws[3], ws[4], ws[5], H, Hkv, eps, int8)
    kc, vc = kc0.clone(), vc0.clone()
    with torch.inference_mode():
        got = run(x, cos, sin, mask, kc, vc, rows, positions)
        kr, vr = kc0.clone(), vc0.clone()
        ref = per_op_layer(x, cos, sin, mask, kr, vr, rows, positions, ws, b, H, Hkv, eps, int8)
    assert torch.equal(got, ref) and torch.equal(kc, kr) and torch.equal(vc, vr)
    assert not torch.equal(kc, kc0)  # the block's keys were written
    with pytest.raises(ValueError, match="do not fit a qkv"):
        bind_layer(ws[0], ws[1], b, ws[2], ws[3], ws[4], ws[5], 3, 2, eps, int8)


def run_passes(model, blocks):
    """Logits of a sequence of (tokens, positions, slots) passes over one 3-row cache."""
    cache = KVCache.for_model(model, 3, 64)
    with torch.inference_mode():
        return [model(t, p, cache, slots=s) for t, p, s in blocks]


def test_model_runs_whole_layers_with_the_per_op_bits(monkeypatch):
    """A model with the kernels attached runs each layer as one call in cached passes (counted), with
    the logits of the per-op path bit for bit, batch rows mapped to other cache rows included."""
    model = tiny_model(6)
    weights.attach(model, "float32")
    assert all(model.runner.layers[layer].whole is not None for layer in model.layers)
    g = torch.Generator().manual_seed(4)
    blocks = [
        (torch.randint(0, 97, (2, 6), generator=g), torch.arange(6).expand(2, 6), torch.tensor([2, 0])),
        (torch.randint(0, 97, (2, 3), generator=g), torch.arange(6, 9).expand(2, 3), torch.tensor([2, 0])),
        (torch.randint(0, 97, (1, 4), generator=g), torch.arange(9, 13).view(1, 4), torch.tensor([0])),
    ]
    calls = []
    for layer in model.layers:
        run = model.runner.layers[layer].whole
        monkeypatch.setattr(model.runner.layers[layer], "whole", lambda *a, run=run: calls.append(1) or run(*a))
    whole = run_passes(model, blocks)
    assert len(calls) == 3 * len(model.layers)
    for layer in model.layers:
        monkeypatch.setattr(model.runner.layers[layer], "whole", None)
    per_op = run_passes(model, blocks)
    assert all(torch.equal(a, b) for a, b in zip(whole, per_op))


def test_whole_layers_serve_plain_passes_of_an_adapter_model_and_step_aside_for_gated_ones():
    """LoRA adapters add nothing without a gate: plain passes run whole layers on the base weights; a
    pass with mask tokens (gate) takes the per-op path through the adapters."""
    from mtp.core.runtime.adapter import add_adapters

    model = tiny_model(7)
    add_adapters(model, rank=4, alpha=8)
    for name, p in model.named_parameters():
        if "lora_b" in name:
            torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(5))
    weights.attach(model, "float32")
    assert all(model.runner.layers[layer].whole is not None for layer in model.layers)
    tokens = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(6))
    masked = tokens.clone()
    masked[0, -2:] = model.config.mask_token_id
    pos = torch.arange(10).view(1, 10)
    whole = run_passes(model, [(tokens, pos, None), (masked, pos, None)])
    for layer in model.layers:
        model.runner.layers[layer].whole = None
    per_op = run_passes(model, [(tokens, pos, None), (masked, pos, None)])
    assert torch.equal(whole[0], per_op[0]) and torch.equal(whole[1], per_op[1])
    with torch.inference_mode():
        gated = run_passes(model, [(masked, pos, None)])
        model.adapters_enabled = False
        base = run_passes(model, [(masked, pos, None)])
    assert not torch.equal(gated[0], base[0])  # the gated pass did go through the adapters


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_quantize_makes_a_float32_model_its_quantised_self_on_every_path(fmt):
    """`--quantize`: the linears become blocks (run by `native`), the float32 weights their dequantised
    values, so `native` and `float32` give the same bits, rows stay invariant, and the model moved."""
    model = tiny_model(8)
    tokens = torch.randint(0, 97, (25,), generator=torch.Generator().manual_seed(7)).tolist()
    weights.attach(model, "float32")
    before = passes(model, tokens, [24])
    line = weights.attach(model, "native", quantize=fmt)
    assert f"{fmt} linears" in line and f"quantised to {fmt} at load (" in line  # 14 projections + the head
    q = model.layers[0].self_attn.o_proj.parts[0]
    assert q.fmt == fmt and torch.equal(q.dequantize(), model.layers[0].self_attn.o_proj.weight)
    native = passes(model, tokens, [24])
    assert torch.equal(passes(model, tokens, [1] * 24), native) and not torch.equal(native, before)
    weights.attach(model, "float32")
    assert torch.equal(passes(model, tokens, [5, 19]), native)


def test_quantize_bad_input_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^--quantize 'q5_k': expected one of q8_0, q4_0, q4_1$"):
        weights.check_quantize("q5_k")
    with pytest.raises(ValueError, match="whose weights are already blocks"):
        weights.check_quantize("q4_1", tmp_path / "model.gguf")
    assert weights.check_quantize(None, tmp_path / "model.gguf") is None


def random_eagle3(model, seed: int, vocab: torch.Tensor):
    """An EAGLE-3 proposer for `model` with a random drafter over trunk layers 0-2 and draft vocabulary `vocab`."""
    from mtp.core.decoding.proposers.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Proposer

    torch.manual_seed(seed)
    drafter = Eagle3Drafter(Eagle3Config.for_model(model.config, len(vocab), (0, 1, 2)))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(std=0.3) if p.dim() == 2 else None
    drafter.set_vocab(vocab)
    return Eagle3Proposer(model, drafter.eval().requires_grad_(False))


def test_proposer_modules_run_on_the_kernels_and_drafts_stay_lossless():
    """`attach_proposer`: an EAGLE-3 drafter's Linears run on the float32 kernel (float32's values
    within rounding) or as Q8_0 blocks with int8 activations; trees drafted either way equal `ntp`."""
    model = tiny_model(9)
    weights.attach(model, "float32")
    proposer = random_eagle3(model, seed=2, vocab=torch.arange(0, 96, 2))
    drafter = proposer.drafter
    h = torch.randn(3, 1, model.config.dim, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch_logits = drafter.logits(h)
    assert weights.attach_proposer(proposer, model, "torch") == 0
    assert weights.attach_proposer(proposer, model, "float32") == 9  # fc, q, k, v, o, gate, up, down, head
    assert drafter.layer_kernel is not None  # and its layer as one call (mtp::eagle3_layer)
    with torch.inference_mode():
        kernel_logits = drafter.logits(h)
    torch.testing.assert_close(kernel_logits, torch_logits, rtol=1e-5, atol=1e-5)
    prompt = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = generate(model, prompt, "ntp", SamplingParams(max_new_tokens=30))
    assert generate(model, prompt, "tree:8", SamplingParams(max_new_tokens=30), proposer=proposer).output == ref.output
    assert weights.attach_proposer(proposer, model, "native-int8") == 9
    assert {m.parts[0].fmt for m in drafter.modules() if isinstance(m, torch.nn.Linear)} == {"q8_0"}
    with torch.inference_mode():
        assert not torch.equal(drafter.logits(h), kernel_logits)  # int8 activations: other bits
    assert generate(model, prompt, "tree:8", SamplingParams(max_new_tokens=30), proposer=proposer).output == ref.output


def test_eagle3_layer_kernel_is_the_drafters_layer():
    """`mtp::eagle3_layer` (the drafter's layer in one call, on its KV buffer) computes what the torch
    ops compute within float32 rounding: the committed state after ingesting in one pass or in pieces,
    and every node of a tree (token, parent, confidence) drafted on scratch slots, which leave the
    committed slots as they were."""
    from mtp.core.decoding.proposers.base import PassView

    model = tiny_model(11)
    weights.attach(model, "float32")
    proposer = random_eagle3(model, seed=5, vocab=torch.arange(1, 97, 2))
    drafter = proposer.drafter
    weights.attach_proposer(proposer, model, "float32")
    run = drafter.layer_kernel
    assert run is not None
    ctx = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.inference_mode():
        _, _, aux = model(torch.tensor([ctx[:30]]), aux_layers=proposer.aux_layers)
    got = {}
    for name, kernel in (("kernel", run), ("torch", None)):
        drafter.layer_kernel = kernel
        st: dict = {}
        with torch.inference_mode():
            proposer.ingest(PassView(ctx[:18], torch.zeros(0), None, True, aux=aux[0, :17], start=0, state=st))
            proposer.ingest(PassView(ctx[:31], torch.zeros(0), None, True, aux=aux[0, 17:30], start=17, state=st))
            committed = st["kc"][:, :, :30].clone()
            tree = proposer._tree(PassView(ctx[:31], torch.zeros(0), None, True, start=30, state=st), st["h"], 12)
        assert st["len"] == 30 and torch.equal(st["kc"][:, :, :30], committed)  # scratch stayed scratch
        got[name] = (st["h"], committed, tree)
    drafter.layer_kernel = run
    (hk, kk, tk), (ht, kt, tt) = got["kernel"], got["torch"]
    torch.testing.assert_close(hk, ht, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kk, kt, rtol=1e-5, atol=1e-5)
    assert len(tk.tokens) == 12 and max(tk.parents) >= 1  # a tree with nodes below depth 1
    assert tk.tokens == tt.tokens and tk.parents == tt.parents
    torch.testing.assert_close(torch.tensor(tk.confidences), torch.tensor(tt.confidences), rtol=1e-4, atol=1e-6)


def test_heads_read_out_through_the_trunks_head_kernel_rows():
    """The heads' draft-vocabulary readout is the trunk's head kernel on those rows: the same bits as
    the trunk's full readout at those columns."""
    from mtp.core.decoding.proposers.heads import HeadsConfig, HeadsProposer, MTPHeads

    model = tiny_model(10)
    weights.attach(model, "float32")
    heads = MTPHeads(HeadsConfig.for_model(model.config, 3, 0, 0)).eval().requires_grad_(False)
    heads.draft_vocab = torch.arange(1, 97, 3)
    proposer = HeadsProposer(model, heads, readout_dtype="float32")
    assert weights.attach_proposer(proposer, model, "float32") == 3  # one projection per depth
    h = torch.randn(5, model.config.dim, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        assert torch.equal(proposer.readout(h), model.lm_head(model.norm(h))[:, heads.draft_vocab])
    prompt = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = generate(model, prompt, "ntp", SamplingParams(max_new_tokens=30))
    assert generate(model, prompt, "tree:8", SamplingParams(max_new_tokens=30), proposer=proposer).output == ref.output


def test_a_loaded_gguf_model_takes_its_blocks_without_comparing_every_value(tmp_path, monkeypatch):
    """The loader's conversion of a GGUF, unchanged since: attach takes the file's blocks after comparing
    four rows of each (`loading.from_gguf`, `weights._native_parts`); a weight written since (its version
    counter moved) is compared whole, and one whose values moved runs from its float32 values."""
    from helpers import write_tiny_gguf

    from mtp.core.runtime import loading
    from mtp.core.runtime.kernels.qlinear import KernelWeight

    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    kernels.load(quiet=True)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    model = loading.load(str(gguf)).model
    compared = []
    real = KernelWeight.dequantize
    monkeypatch.setattr(KernelWeight, "dequantize", lambda self, *a: compared.append(self.shape[0]) or real(self, *a))
    weights.attach(model, "native", gguf)
    linears = [m for m in model.modules() if isinstance(m, KernelLinear)]
    assert compared and max(compared) <= 4  # four rows of each, never a whole matrix
    assert all(m.parts[0].name.startswith(("blk.", "output.")) for m in linears)  # the file's tensors, all
    q = model.layers[0].self_attn.q_proj
    assert q.parts[0].name == "blk.0.attn_q.weight"  # the file's tensor, as stored
    compared.clear()
    with torch.no_grad():
        q.weight.mul_(1.0)  # written in place: same values, new version
    weights.attach(model, "native", gguf)
    assert sorted(compared)[-1] == q.weight.shape[0] and q.parts[0].name == "blk.0.attn_q.weight"
    with torch.no_grad():
        q.weight[1, 0] += 1.0  # a row the four-row look does not see
    weights.attach(model, "native", gguf)
    assert q.parts[0].name == "layers.0.self_attn.q_proj.weight"  # its float32 values, not the stale blocks
