"""Gated LoRA and the mask token: ordinary positions are the base model bit for bit; adapters save
and load atomically and refuse another base model."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_model

from mtp.core.decoding.decode import generate
from mtp.core.runtime import adapter
from mtp.core.runtime.adapter import add_adapters, load_adapter, save_adapter
from mtp.core.runtime.artifacts import base_hash


def adapted(mode="gated", seed=0, std=0.2):
    """A tiny model with adapters whose weights are random (a fresh LoRA B is zero: a no-op)."""
    model = tiny_model(seed)
    torch.manual_seed(1)
    params = add_adapters(model, rank=4, alpha=8, mode=mode)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * std)
    return model


TOKENS = torch.tensor([[5, 17, 3, 44, 9, 21], [8, 8, 60, 2, 71, 30]])  # [B, T]


def test_gated_without_masks_is_the_base_model():
    base = tiny_model(0)
    model = adapted("gated")
    assert model.config.mask_token_id == 97 and model.config.vocab_size == 98  # vocab was full: grown
    got, want = model(TOKENS), base(TOKENS)
    assert torch.equal(got[..., :97], want)


def test_gated_ordinary_positions_unchanged_next_to_masks():
    base, model = tiny_model(0), adapted("gated")
    mid = model.config.mask_token_id
    with_masks = torch.cat([TOKENS, torch.full((2, 3), mid)], 1)  # [B, T+3]
    got = model(with_masks)
    with model.base_only():
        off = model(with_masks)
    assert torch.equal(got[:, :6], off[:, :6])  # same shapes, same bits: gate 0 adds exact zeros
    torch.testing.assert_close(got[:, :6, :97], base(TOKENS))  # other shapes: only rounding differs
    assert not torch.allclose(got[:, 6:], off[:, 6:])  # the adapters do act on the masks


def test_plain_lora_changes_ordinary_positions():
    base, model = tiny_model(0), adapted("plain")
    assert not torch.allclose(model(TOKENS)[..., :97], base(TOKENS))
    with model.base_only():
        assert torch.equal(model(TOKENS)[..., :97], base(TOKENS))


def test_verify_with_gated_adapter_equals_plain_greedy():
    """Lossless: verify:k decoding with the adapter's guesses reproduces plain greedy exactly."""
    base, model = tiny_model(0), adapted("gated")
    prompt = [5, 17, 3, 44]
    want = generate(base, prompt, "ntp", params=_params(24)).output
    seq = generate(model, prompt, "verify:4", params=_params(24))
    assert seq.output == want
    assert seq.stats.forward_passes <= len(want)


def test_packed_adapter_matches_the_plain_path():
    """pack_weights fuses each LoRA projection's A into its base matmul: same numbers up to rounding,
    and verify still reproduces plain greedy."""
    from mtp.core.runtime.model import pack_weights

    model = adapted("gated")
    mid = model.config.mask_token_id
    with_masks = torch.cat([TOKENS, torch.full((2, 3), mid)], 1)  # [B, T+3]
    with torch.inference_mode():
        want = model(with_masks)
        pack_weights(model)
        assert all(m.fused is not None for m in model.modules() if isinstance(m, adapter.LoRALinear))
        got = model(with_masks)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(got[:, 6:], model(with_masks.masked_fill(with_masks == mid, 5))[:, 6:])
    base = tiny_model(0)
    seq = generate(model, [5, 17, 3, 44], "verify:4", params=_params(24))
    assert seq.output == generate(base, [5, 17, 3, 44], "ntp", params=_params(24)).output


def test_save_load_roundtrip(tmp_path):
    model = adapted("gated")
    save_adapter(model, tmp_path / "a", {"note": "x"})
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["mode"] == "gated" and cfg["rank"] == 4 and cfg["mask_token_id"] == 97 and cfg["meta"] == {"note": "x"}
    assert cfg["base_hash"] == base_hash(tiny_model(0))
    fresh = tiny_model(0)
    load_adapter(fresh, tmp_path / "a")
    x = torch.cat([TOKENS, torch.full((2, 2), 97)], 1)
    assert torch.equal(fresh(x), model(x))
    assert not any(p.requires_grad for p in fresh.parameters())


def test_float16_copy_loads(tmp_path):
    model = adapted("gated")
    save_adapter(model, tmp_path / "a", dtype=torch.float16)
    fresh = tiny_model(0)
    load_adapter(fresh, tmp_path / "a")
    x = torch.cat([TOKENS, torch.full((2, 2), 97)], 1)
    torch.testing.assert_close(fresh(x), model(x), atol=5e-2, rtol=0)


def test_other_base_model_refused(tmp_path):
    save_adapter(adapted("gated", seed=0), tmp_path / "a")
    other = tiny_model(1)
    with pytest.raises(ValueError, match="trained on another base model"):
        load_adapter(other, tmp_path / "a")
    assert not getattr(other, "has_adapters", False) and other.config.vocab_size == 97  # left untouched


def test_atomic_write_leaves_no_partial_dir(tmp_path, monkeypatch):
    model = adapted("gated")
    save_adapter(model, tmp_path / "a", {"v": 1})
    before = (tmp_path / "a" / "adapter.safetensors").read_bytes()

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", fail)
    with pytest.raises(OSError):
        save_adapter(adapted("gated", std=0.5), tmp_path / "a", {"v": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp dir left behind
    assert (tmp_path / "a" / "adapter.safetensors").read_bytes() == before
    assert json.loads((tmp_path / "a" / "config.json").read_text())["meta"] == {"v": 1}
    with pytest.raises(OSError):
        save_adapter(model, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown adapter mode"):
        add_adapters(tiny_model(0), mode="sparse")
    with pytest.raises(ValueError, match="unknown adapter target"):
        add_adapters(tiny_model(0), targets=("q", "qq"))
    model = adapted()
    with pytest.raises(ValueError, match="already has adapters"):
        add_adapters(model)


def test_padded_vocab_row_is_reused():
    model = tiny_model(0)
    add_adapters(model, rank=2, n_used_tokens=90)
    assert model.config.mask_token_id == 90 and model.config.vocab_size == 97


def test_full_mode_trains_everything():
    model = tiny_model(0)
    params = add_adapters(model, mode="full")
    assert sum(p.numel() for p in params) == sum(p.numel() for p in model.parameters())
    assert adapter.trainable_state(model)  # saved as a whole


def _params(n):
    from mtp.core.decoding.sampling import SamplingParams

    return SamplingParams(max_new_tokens=n)


def test_upper_layers_only(tmp_path):
    """LoRA on layers FROM..TO-1: the others stay plain projections, the mask row is frozen (FROM > 0),
    the range is saved and comes back on load; verify stays plain greedy."""
    model = tiny_model(0, n_layers=4)
    params = add_adapters(model, rank=4, alpha=8, layers=(2, 4))
    assert [isinstance(b.mlp.down_proj, adapter.LoRALinear) for b in model.layers] == [False, False, True, True]
    assert not model.embed_tokens.mask_row.requires_grad and len(params) == 2 * 7 * 2
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.2)
    save_adapter(model, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["layers"] == [2, 4]
    fresh = tiny_model(0, n_layers=4)
    load_adapter(fresh, tmp_path / "a")
    x = torch.cat([TOKENS, torch.full((2, 2), 97)], 1)
    assert torch.equal(fresh(x), model(x))
    prompt = [5, 17, 3, 44]
    assert (
        generate(fresh, prompt, "verify:4", params=_params(24)).output
        == generate(tiny_model(0, n_layers=4), prompt, "ntp", params=_params(24)).output
    )


def test_layer_range_refused(tmp_path):
    for bad in ((1, 1), (2, 1), (0, 3), (-1, 2)):
        with pytest.raises(ValueError, match="must satisfy 0 <= FROM < TO"):
            add_adapters(tiny_model(0), layers=bad)
    with pytest.raises(ValueError, match="needs --mode gated or plain"):
        add_adapters(tiny_model(0), mode="full", layers=(0, 2))
    save_adapter(adapted("gated"), tmp_path / "a")
    conf = json.loads((tmp_path / "a" / "config.json").read_text())
    assert conf["layers"] == [0, 2]
    for bad, match in (([1, 1], "field 'layers' must be"), ("0:2", "field 'layers' must be"), ([0, 5], "beyond")):
        (tmp_path / "a" / "config.json").write_text(json.dumps({**conf, "layers": bad}))
        with pytest.raises(ValueError, match=match):
            load_adapter(tiny_model(0), tmp_path / "a")
    del conf["layers"]  # an adapter from before the field: LoRA on every layer
    (tmp_path / "a" / "config.json").write_text(json.dumps(conf))
    fresh = tiny_model(0)
    load_adapter(fresh, tmp_path / "a")
    assert all(isinstance(b.self_attn.q_proj, adapter.LoRALinear) for b in fresh.layers)
