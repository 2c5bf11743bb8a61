"""The small-row matmul kernels (`mtp.core.runtime.kernels`): exact dequantisation against the `gguf`
package, agreement with float32 matmul, batch invariance (a row's bits do not depend on M, its
position or its neighbours) on every ISA path this CPU runs (the AVX2 path forced on AVX-512
machines), and one-line errors for bad input. Skipped, with the reason, where the C++ does not build."""

from __future__ import annotations

import types

import gguf
import numpy as np
import pytest
import torch

from mtp.core.runtime import kernels
from mtp.core.runtime.kernels import qlinear
from mtp.core.runtime.kernels.qlinear import KernelWeight, linear

FORMATS = ["f32", "q8_0", "q4_0", "q4_1"]
ISAS = ["scalar", "avx2", "avx512"]
QTYPE = {f: gguf.GGMLQuantizationType[f.upper()] for f in FORMATS if f != "f32"}


@pytest.fixture(scope="module", autouse=True)
def built():
    if not kernels.load():
        pytest.skip(f"the C++ kernels do not build here ({kernels.why_unavailable()})")


def need(isa: str) -> None:
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU does not run the {isa} path")


def random_blocks(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Random valid blocks: any quants, finite fp16 scales of both signs incl. subnormal and zero."""
    size, scale_bytes = qlinear.FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, size), dtype=torch.uint8, generator=g)
    scales = torch.randn(n, k // 32, scale_bytes // 2, generator=g) * 0.05
    scales[0, 0] = 3e-7  # fp16 subnormal
    scales[-1, -1] = 0.0
    blocks[:, :, :scale_bytes] = scales.half().view(torch.uint8).view(n, k // 32, scale_bytes)
    return blocks.view(n, -1)


def weight(fmt: str, n: int = 72, k: int = 160, seed: int = 0, kind: str = "quantized") -> KernelWeight:
    g = torch.Generator().manual_seed(seed)
    if fmt == "f32":
        return KernelWeight.from_float(torch.randn(n, k, generator=g) * 0.1, name="w")
    if kind == "random":
        return KernelWeight.from_blocks(random_blocks(fmt, n, k, seed), fmt, name="w")
    return KernelWeight.quantize(torch.randn(n, k, generator=g) * 0.1, fmt, name="w")


def gguf_dequant(w: KernelWeight) -> torch.Tensor:
    arr = gguf.quants.dequantize(w.data.numpy(), QTYPE[w.fmt])
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(w.shape)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("kind", ["quantized", "random"])
def test_dequantize_equals_gguf(fmt, isa, kind):
    need(isa)
    w = weight(fmt, kind=kind, seed=3)
    assert torch.equal(w.dequantize(isa=isa), gguf_dequant(w))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_matches_float32(fmt, isa):
    need(isa)
    w = weight(fmt, kind="random" if fmt != "f32" else "quantized", seed=1)
    x = torch.randn(9, w.shape[1], generator=torch.Generator().manual_seed(2))
    ref = (x.double() @ w.dequantize().double().T).float()
    y = linear(x, w, isa=isa)
    assert y.shape == (9, w.shape[0]) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, x @ w.dequantize().T, rtol=1e-4, atol=1e-4)


def check_invariant(w: KernelWeight, isa, k: int, seed: int = 0) -> torch.Tensor:
    """Every row's output, in batches of M = 1..32 and 64, alone, and moved among other rows, is
    bit-equal to the same row in the full batch; returns the full batch's output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, k, generator=g)
    full = linear(x, w, isa=isa)
    for m in [*range(1, 33), 64]:
        assert torch.equal(linear(x[:m], w, isa=isa), full[:m]), f"M={m}"
    for r in range(0, 64, 5):
        assert torch.equal(linear(x[r : r + 1], w, isa=isa)[0], full[r]), f"row {r} alone"
        others = torch.randn(11, k, generator=g) * 10
        pos = (r * 7) % 12
        moved = torch.cat([others[:pos], x[r : r + 1], others[pos:]])
        assert torch.equal(linear(moved, w, isa=isa)[pos], full[r]), f"row {r} at {pos}"
    return full


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_invariant(fmt, isa):
    need(isa)
    w = weight(fmt, n=75, k=192, seed=4)  # N not a multiple of any tile width
    check_invariant(w, isa, 192)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k", [7, 16, 40, 50, 96])
def test_f32_any_k(k, isa):
    need(isa)
    w = weight("f32", n=13, k=k, seed=k)
    full = check_invariant(w, isa, k, seed=k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(k))
    torch.testing.assert_close(full, x @ w.data.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_bits_on_every_isa_and_thread_count(fmt):
    w = weight(fmt, n=67, k=224, seed=5, kind="random" if fmt != "f32" else "quantized")
    for m in (5, 6, 21):  # one-pass tiles: AVX2 4-5 rows, AVX-512 5-8; 21: row tiles over a float32 panel
        x = torch.randn(m, 224, generator=torch.Generator().manual_seed(6))
        outs = [linear(x, w, isa=isa) for isa in kernels.supported_isas()]
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            outs.append(linear(x, w))
        finally:
            torch.set_num_threads(threads)
        for y in outs[1:]:
            assert torch.equal(y, outs[0]), f"M={m}"


def test_env_forces_the_isa(monkeypatch):
    need("avx2")
    w = weight("q4_1", seed=7)
    x = torch.randn(5, 160)
    monkeypatch.setenv(kernels.ENV_ISA, "avx2")
    assert kernels.resolve_isa() == kernels.ISAS["avx2"]
    assert torch.equal(linear(x, w), linear(x, w, isa="avx2"))
    monkeypatch.setenv(kernels.ENV_ISA, "scalar")
    assert kernels.resolve_isa() == 0
    monkeypatch.setenv(kernels.ENV_ISA, "sse9")
    with pytest.raises(ValueError, match="MTP_KERNEL_ISA"):
        kernels.resolve_isa()


def test_ops_are_registered():
    w = weight("q4_1")
    x = torch.randn(3, 160)
    y = torch.ops.mtp.linear_q4_1(x, w.data, -1)
    assert torch.equal(y, linear(x, w))
    assert torch.equal(torch.ops.mtp.dequantize_q4_1(w.data, -1), w.dequantize())
    assert int(torch.ops.mtp.cpu_isa()) == kernels.best_isa()
    assert torch.equal(qlinear.linear_q4_1(x, w.data), y)
    assert linear(torch.randn(0, 160), w).shape == (0, 72)
    assert linear(torch.randn(2, 3, 160), w).shape == (2, 3, 72)


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_bad_input_is_one_line():
    w = weight("q8_0")
    with pytest.raises(ValueError) as e:
        linear(torch.randn(2, 160, dtype=torch.float64), w)
    assert "float32" in one_line(e)
    with pytest.raises(ValueError) as e:
        linear(torch.randn(2, 161), w)
    assert "160" in one_line(e)
    with pytest.raises(ValueError) as e:
        linear(torch.randn(2, 160, requires_grad=True), w)
    assert "inference-only" in one_line(e)
    with torch.no_grad():
        linear(torch.randn(2, 160, requires_grad=True), w)
    with pytest.raises(ValueError) as e:
        KernelWeight("q8_0", torch.zeros(4, 33, dtype=torch.uint8), name="blk.0.x")
    assert "blk.0.x" in one_line(e)
    with pytest.raises(ValueError) as e:
        KernelWeight("q5_k", torch.zeros(4, 34, dtype=torch.uint8))
    one_line(e)
    with pytest.raises(ValueError) as e:
        KernelWeight.from_float(torch.zeros(4, 8, dtype=torch.float16))
    one_line(e)
    with pytest.raises(ValueError) as e:
        linear(torch.randn(2, 160), w.data)
    one_line(e)


@pytest.mark.parametrize(
    "fmt,offset,bad",
    [("q8_0", 0, float("nan")), ("q4_0", 0, float("inf")), ("q4_1", 0, float("nan")), ("q4_1", 2, float("-inf"))],
)
def test_corrupt_scale_refused(fmt, offset, bad):
    blocks = random_blocks(fmt, 6, 96, seed=8)
    size = qlinear.FORMATS[fmt][0]
    blocks.view(6, -1, size)[4, 2, offset : offset + 2] = torch.tensor([bad]).half().view(torch.uint8)
    with pytest.raises(ValueError) as e:
        KernelWeight.from_blocks(blocks, fmt, name="blk.3.ffn_up.weight")
    msg = one_line(e)
    assert "blk.3.ffn_up.weight" in msg and "row 4, block 2" in msg


def reader_tensor(name: str, qtype, n: int, k: int, data: np.ndarray):
    return types.SimpleNamespace(name=name, tensor_type=qtype, shape=np.array([k, n]), data=data)


def test_from_gguf_formats_and_fallback(capsys):
    blocks = random_blocks("q4_1", 8, 64, seed=9)
    w = KernelWeight.from_gguf(reader_tensor("blk.0.attn_q.weight", QTYPE["q4_1"], 8, 64, blocks.numpy()))
    assert w.fmt == "q4_1" and w.shape == (8, 64) and torch.equal(w.data, blocks)
    wq = KernelWeight.from_gguf(
        reader_tensor("blk.0.attn_q.weight", QTYPE["q4_1"], 8, 64, blocks.numpy()), unpermute_heads=2
    )
    from mtp.core.runtime.gguf import unpermute

    assert torch.equal(wq.dequantize(), unpermute(w.dequantize(), 2))
    # a type the kernels lack: dequantised by gguf, served in float32, one line naming it
    q5k = np.random.default_rng(0).integers(0, 256, (4, 176), dtype=np.uint8)
    q5k.reshape(4, 176)[:, :4] = np.frombuffer(np.array([0.01, 0.002], dtype=np.float16).tobytes(), np.uint8)
    w5 = KernelWeight.from_gguf(reader_tensor("blk.1.ffn_down.weight", gguf.GGMLQuantizationType.Q5_K, 4, 256, q5k))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "blk.1.ffn_down.weight" in err[0] and "Q5_K" in err[0] and "float32" in err[0]
    assert w5.fmt == "f32"
    ref = torch.from_numpy(np.array(gguf.quants.dequantize(q5k, gguf.GGMLQuantizationType.Q5_K), np.float32))
    assert torch.equal(w5.data, ref.reshape(4, 256))
    with pytest.raises(ValueError) as e:
        KernelWeight.from_gguf(
            types.SimpleNamespace(name="x.weight", tensor_type=0, shape=np.array([5]), data=np.zeros(5, np.float32))
        )
    assert "x.weight" in one_line(e)


def test_real_model_weights_equal_the_loader():
    """The shipped GGUF's blocks, kept as stored, dequantise to the float32 values the loader
    (`mtp.core.runtime.gguf.read_gguf`: gguf.quants.dequantize, then the Q/K unpermute) gives."""
    from helpers import require_smollm2

    require_smollm2()
    from mtp.core.runtime.gguf import unpermute
    from mtp.core.runtime.loading import resolve

    reader = gguf.GGUFReader(str(resolve("smollm2-135m")))
    heads = {
        "attn_q": reader.fields["llama.attention.head_count"].contents(),
        "attn_k": reader.fields["llama.attention.head_count_kv"].contents(),
    }
    seen = set()
    for t in reader.tensors:
        part = t.name.split(".")[2] if t.name.startswith("blk.0.") else t.name.split(".")[0]
        if not (t.name.startswith("blk.0.") and len(t.shape) == 2) and t.name != "token_embd.weight":
            continue
        w = KernelWeight.from_gguf(t, unpermute_heads=heads.get(part))
        rows = 2048 if part == "token_embd" else w.shape[0]  # the embedding: its first rows (time)
        ref = torch.from_numpy(np.array(gguf.quants.dequantize(t.data[:rows], t.tensor_type), np.float32))
        ref = ref.reshape(rows, w.shape[1])
        if part in heads:
            ref = unpermute(ref, heads[part])
        assert torch.equal(w.dequantize()[:rows], ref), t.name
        seen.add(w.fmt)
    assert seen == {"q4_1", "q8_0"}


def test_no_compiler_says_which_path(monkeypatch, capsys):
    saved = dict(kernels._state)
    try:
        kernels._state.clear()
        monkeypatch.setenv("CXX", "/nonexistent/c++")
        assert not kernels.load()
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no C++ compiler" in err[0] and "pure-torch path" in err[0]
        assert "pure-torch" in qlinear.describe()
        w = weight("q4_1", seed=10)
        x = torch.randn(12, 160)
        full = linear(x, w)  # the fallback: rows one at a time, still batch-invariant
        assert all(torch.equal(linear(x[i : i + 1], w)[0], full[i]) for i in range(12))
        torch.testing.assert_close(full, x @ gguf_dequant(w).T, rtol=1e-5, atol=1e-5)
    finally:
        kernels._state.clear()
        kernels._state.update(saved)


# ---------------------------------------------------------------------------------------- int8 activations


def need_int8(isa: str) -> None:
    need(isa)
    if kernels.ISAS[isa] > kernels.best_isa_int8():
        pytest.skip(f"this CPU does not run the int8 {isa} path (AVX-512 without VNNI)")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_int8_matches_its_reference_and_is_invariant(fmt, isa):
    """int8 activations: close to (activations rounded as the op rounds them) @ W in float64, and
    every row's bits independent of M, position and neighbours. N = 75 and K = 160 leave a partial
    16-column tile and an odd block count."""
    need_int8(isa)
    w = weight(fmt, n=75, k=160, seed=11, kind="random")
    g = torch.Generator().manual_seed(12)
    x = torch.randn(64, 160, generator=g)
    full = qlinear.linear_int8(x, w, isa=isa)
    ref = qlinear.quantize_activations(x).double() @ w.dequantize().double().T
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-4)
    for m in [*range(1, 33), 64]:
        assert torch.equal(qlinear.linear_int8(x[:m], w, isa=isa), full[:m]), f"M={m}"
    for r in range(0, 64, 7):
        others = torch.randn(9, 160, generator=g) * 5
        moved = torch.cat([others[: r % 10], x[r : r + 1], others[r % 10 :]])
        assert torch.equal(qlinear.linear_int8(moved, w, isa=isa)[r % 10], full[r])
        assert torch.equal(qlinear.linear_int8(x[r : r + 1], w, isa=isa)[0], full[r])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_int8_same_bits_on_every_isa(fmt):
    w = weight(fmt, n=40, k=192, seed=13, kind="random")
    x = torch.randn(19, 192, generator=torch.Generator().manual_seed(14)) * 3
    x[3, 5] = 1e4  # an outlier in one block
    outs = [
        qlinear.linear_int8(x, w, isa=isa)
        for isa in kernels.supported_isas()
        if kernels.ISAS[isa] <= kernels.best_isa_int8()
    ]
    assert all(torch.equal(y, outs[0]) for y in outs[1:])


def test_int8_packing_is_a_permutation():
    for fmt in ("q8_0", "q4_0", "q4_1"):
        w = weight(fmt, n=21, k=96, seed=15, kind="random")
        packed = w.packed_int8()
        assert packed.shape[:2] == (2, 3) and packed.dtype == torch.uint8
        real = packed.view(2, 3, -1)  # the padded columns' bytes are zero; the rest is the blocks' bytes
        assert sorted(real.flatten().tolist()) == sorted(
            w.data.flatten().tolist() + [0] * (real.numel() - w.data.numel())
        )


def test_int8_nonfinite_rows_give_nan_and_bad_input():
    w = weight("q4_1", n=16, k=64, seed=16)
    x = torch.randn(3, 64)
    x[1, 40] = float("inf")
    y = qlinear.linear_int8(x, w)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()
    assert torch.equal(y[0], qlinear.linear_int8(x[:1], w)[0])
    with pytest.raises(ValueError) as e:
        qlinear.linear_int8(x, KernelWeight.from_float(torch.randn(16, 64)))
    assert "Q8_0/Q4_0/Q4_1" in one_line(e)


def _mixed_gguf(path):
    """A small GGUF holding one tensor of each kind the reader types differently: F32 (1-D and 2-D),
    F16, Q8_0, Q4_0, Q4_1 and a 3-D F32."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.attention.head_count", 2)
    for name, qtype, shape in [
        ("output_norm.weight", "F32", (64,)),
        ("blk.0.attn_q.weight", "Q8_0", (8, 64)),
        ("blk.0.attn_k.weight", "Q4_0", (4, 64)),
        ("blk.0.ffn_up.weight", "Q4_1", (6, 96)),
        ("blk.0.ffn_down.weight", "F16", (5, 32)),
        ("token_embd.weight", "F32", (7, 32)),
        ("cube.weight", "F32", (2, 3, 32)),
    ]:
        kind = gguf.GGMLQuantizationType[qtype]
        arr = rng.standard_normal(shape).astype(np.float32)
        if qtype == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        elif qtype == "F32":
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("which", ["mixed", "smollm2"])
def test_the_one_reader_gives_what_the_gguf_package_reads(tmp_path, which):
    """`mtp.core.runtime.gguf.read_tensors` (one header walk, views of the memory map) gives every tensor of the file
    exactly as `gguf.GGUFReader` does: name, type, shape, the array's dtype, shape and bytes; and the metadata
    values the loader reads."""
    from mtp.core.runtime.gguf import read_tensors

    if which == "smollm2":
        from helpers import require_smollm2

        require_smollm2()
        from mtp.core.runtime.loading import resolve

        path = resolve("smollm2-135m")
    else:
        path = _mixed_gguf(tmp_path / "mixed.gguf")
    reader = gguf.GGUFReader(str(path))
    meta, tensors = read_tensors(path)
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, ref in zip(tensors, reader.tensors):
        assert ours.tensor_type == int(ref.tensor_type) and list(ours.shape) == [int(d) for d in ref.shape], ref.name
        assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape, ref.name
        assert np.array_equal(ours.data.view(np.uint8), np.asarray(ref.data).view(np.uint8)), ref.name
    arch = meta["general.architecture"]
    assert meta[f"{arch}.attention.head_count"] == reader.fields[f"{arch}.attention.head_count"].contents()
    if which == "mixed":
        kinds = {gguf.GGMLQuantizationType(t.tensor_type).name for t in tensors}
        assert kinds == {"F32", "F16", "Q8_0", "Q4_0", "Q4_1"}
