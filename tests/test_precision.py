"""The engine's number format (`--dtype`, mtp.core.precision): lossless strategies stay identical to `ntp`
in bfloat16 as in float32 (tiny random models, every tree proposer and the mask proposer; SmolLM2 with the
shipped heads, suffix datastore and EAGLE-3 drafter), assets made on float32 weights load on bfloat16 ones,
`auto` keeps float32 without native bf16 and measures both where there is, and a bad name is one line."""
from __future__ import annotations

import pytest
import torch

from conftest import require_smollm2, tiny_model
from test_serve import save_tiny
from mtp.core import precision
from mtp.core.artifacts import base_hash
from mtp.core.decode import generate
from mtp.core.engine import Engine, EngineConfig
from mtp.core.model import add_mask_token
from mtp.core.proposers import MaskProposer, PromptLookupProposer
from mtp.core.proposers import heads as N
from mtp.core.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("precision") / "tiny")


def bf16_tiny(seed=0):
    m = tiny_model(seed)
    add_mask_token(m)
    return m.to(torch.bfloat16)


@pytest.mark.parametrize("strategy, which", [("verify:4", "mask"), ("verify:3", "lookup"), ("tree:6", "lookup"),
                                             ("tree:8", "heads"), ("verify:4", "heads")])
def test_lossless_strategies_equal_ntp_in_bfloat16(strategy, which):
    model = bf16_tiny()
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    torch.manual_seed(0)
    heads = N.MTPHeads(N.HeadsConfig.for_model(model.config, 3)).to(torch.bfloat16).eval().requires_grad_(False)
    for seed in range(3):
        prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        prop = {"mask": MaskProposer(), "lookup": PromptLookupProposer(),
                "heads": N.HeadsProposer(model, heads, "bfloat16")}[which]
        ref = generate(model, prompt, "ntp", SamplingParams(max_new_tokens=32))
        out = generate(model, prompt, strategy, SamplingParams(max_new_tokens=32), proposer=prop)
        assert out.output == ref.output and len(ref.output) == 32


def test_engine_loads_in_either_dtype_with_the_same_fingerprint(tiny_dir):
    f32 = Engine.load(EngineConfig(model=str(tiny_dir), adapter="none"))
    bf16 = Engine.load(EngineConfig(model=str(tiny_dir), adapter="none", dtype="bfloat16", proposer="lookup"))
    assert f32.model.embed_tokens.weight.dtype == torch.float32 and f32.dtype_choice.name == "float32"
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16 and bf16.dtype_choice.name == "bfloat16"
    # adapters and heads record the float32 weights' hash: the bf16 model must report the same one
    assert base_hash(bf16.model) == base_hash(f32.model)
    a = bf16.generate("abcabcabc", "ntp", SamplingParams(max_new_tokens=16))
    b = bf16.generate("abcabcabc", "tree:6", SamplingParams(max_new_tokens=16))
    assert a.token_ids == b.token_ids


def test_auto_keeps_float32_without_native_bf16_and_measures_where_there_is(tiny_dir):
    plain = precision.resolve("auto", str(tiny_dir), flags={"avx2", "fma"})
    assert plain.name == "float32" and "no native bf16" in plain.reason and not plain.timings_ms
    native = precision.resolve("auto", str(tiny_dir), flags={"avx512f", "avx512_bf16"}, repeats=1)
    assert native.name in ("float32", "bfloat16") and set(native.timings_ms) == {"float32", "bfloat16"}
    t = native.timings_ms
    faster = min(t, key=lambda n: t[n][1] + t[n][precision.AUTO_BLOCK])
    assert native.name == faster and all(v > 0 for d in t.values() for v in d.values())
    assert precision.resolve("bfloat16", str(tiny_dir)).name == "bfloat16"
    assert precision.native_bf16({"amx_bf16"}) and not precision.native_bf16({"avx512f"})


def test_bad_dtype_is_one_line(tiny_dir, capsys):
    from mtp.cli import main
    assert main(["generate", "--model", str(tiny_dir), "--adapter", "none", "--dtype", "float16", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtp: error:") and "--dtype must be one of float32, bfloat16, auto" in err and "\n" not in err


@pytest.mark.slow
def test_smollm2_bfloat16_lossless_with_the_shipped_proposers():
    require_smollm2()
    engine = Engine.load(EngineConfig(dtype="bfloat16", proposer="heads"))
    params = SamplingParams(max_new_tokens=32)
    prompt = "Tom has 5 apples and buys 7 more. How many apples does he have?"
    ref = engine.generate(prompt, "ntp", params)
    for strategy, proposer in (("verify:4", "heads"), ("tree:8", "heads+suffix+lookup"), ("verify:4", "eagle3"),
                               ("verify:4", "mask")):
        seq = engine.new_sequence(engine.encode(prompt), strategy, params, proposer)
        for _ in engine.stream(seq):
            pass
        out = engine.result(seq)
        assert out.token_ids == ref.token_ids, (strategy, proposer)
        assert out.summary["tokens_per_forward"] > 1.2
