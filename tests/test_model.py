"""Our model against transformers' own implementation of each architecture, the mask token, and
weight loading (HF directory, GGUF conversion)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_model

from mtp.core.runtime import loading
from mtp.core.runtime.model import add_mask_token

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0)),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            ("rope_parameters" if int(transformers.__version__.split(".")[0]) >= 5 else "rope_scaling"): {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 500000.0,
            }
        },
    ),
    "smollm-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
}


def save_hf_reference(arch: str, path):
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    cfg = cfg_cls(**COMMON, **extra)
    ref = model_cls(cfg).eval()
    ref.save_pretrained(path, safe_serialization=True)
    return ref


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_match_transformers(arch, tmp_path):
    ref = save_hf_reference(arch, tmp_path)
    ours = loading.load_hf_dir(tmp_path)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(tokens).logits
        got = ours(tokens)
    rel = (got - expected).abs().max() / expected.abs().max()
    assert rel <= 1e-4, f"{arch}: relative error {rel:.2e}"


def test_cached_decoding_matches_full_forward(tiny):
    from mtp.core.runtime.cache import KVCache

    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    full = tiny(tokens)
    cache = KVCache.for_model(tiny, 1, 32)
    a = tiny(tokens[:, :7], torch.arange(7).view(1, 7), cache=cache)
    b = tiny(tokens[:, 7:], torch.arange(7, 12).view(1, 5), cache=cache)
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-5, atol=1e-5)


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(loading.ModelLoadError, match="supported: LlamaForCausalLM"):
        loading.load_hf_dir(tmp_path)


def test_pickle_weights_are_not_loaded(tmp_path):
    save_hf_reference("llama", tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(loading.ModelLoadError, match="safetensors"):
        loading.load_hf_dir(tmp_path)


def test_mask_token_grows_full_vocab_and_reloads(tmp_path):
    model = tiny_model()
    emb = model.embed_tokens.weight.clone()
    mid = add_mask_token(model)
    assert mid == 97 and model.config.vocab_size == 98
    assert model.embed_tokens.weight.shape == (98, 64) and model.lm_head.weight.shape == (98, 64)
    assert torch.equal(model.embed_tokens.weight[:97], emb)
    # initialised from the existing rows' statistics: close to their mean scale, not zeros
    row = model.embed_tokens.weight[mid]
    assert 0.5 * emb.std() < row.std() < 2 * emb.std()
    assert add_mask_token(model) == mid  # idempotent
    loading.save_hf_dir(model, tmp_path / "m")
    again = loading.load_hf_dir(tmp_path / "m")
    assert again.config.mask_token_id == mid
    assert torch.equal(again.embed_tokens.weight, model.embed_tokens.weight)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_mask_token_reuses_padded_row():
    model = tiny_model()
    before = model.embed_tokens.weight.clone()
    mid = add_mask_token(model, n_used_tokens=90)  # rows 90..96 are padding
    assert mid == 90 and model.config.vocab_size == 97
    assert torch.equal(model.embed_tokens.weight[:90], before[:90])
    assert not torch.equal(model.embed_tokens.weight[90], before[90])


def test_tied_mask_token_shares_one_row():
    model = tiny_model(tie_embeddings=True)
    add_mask_token(model)
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_gguf_loader(smollm2):
    """Our GGUF dequantisation (incl. undoing llama.cpp's Q/K row permutation) against transformers'."""
    path = loading.resolve("smollm2-135m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    ids = smollm2.encode("What is 3 + 4?")
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits
        got = smollm2.model(torch.tensor([ids]))
    rel = (got - expected).abs().max() / expected.abs().max()
    assert rel <= 1e-4


def test_packed_weights_match_plain_and_fall_back_after_a_change(tiny):
    from mtp.core.runtime.model import can_pack, pack_weights, unpack_weights

    if not can_pack(tiny):
        pytest.skip("this torch build has no oneDNN")
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        plain = tiny(tokens)
    assert pack_weights(tiny) == 2 * 7 + 1  # 7 projections per layer + the LM head
    with torch.inference_mode():
        packed = tiny(tokens)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))
    with torch.no_grad():  # an in-place change after packing: that layer must use the new weight
        tiny.layers[0].mlp.down_proj.weight.mul_(2.0)
    with torch.inference_mode():
        changed = tiny(tokens)
    unpack_weights(tiny)
    with torch.inference_mode():
        reference = tiny(tokens)
    torch.testing.assert_close(changed, reference, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, plain, atol=1e-3)


def test_packed_weights_off_the_main_thread_only_for_several_rows(tiny, monkeypatch):
    import threading

    from mtp.core.runtime.model import can_pack, pack_weights

    if not can_pack(tiny):
        pytest.skip("this torch build has no oneDNN")
    pack_weights(tiny)
    calls = []
    real = torch._C._nn.mkldnn_linear
    monkeypatch.setattr(
        torch._C._nn, "mkldnn_linear", lambda *a: calls.append(threading.current_thread().name) or real(*a)
    )
    gen = torch.Generator().manual_seed(4)
    one, eight = torch.randint(0, 97, (1, 1), generator=gen), torch.randint(0, 97, (2, 4), generator=gen)
    out = {}

    def run(tag, tokens):
        with torch.inference_mode():
            out[tag] = tiny(tokens, out_index=torch.zeros(tokens.shape[0], 1, dtype=torch.long))

    per_pass = 2 * 7 + 1
    run("main-1", one)
    assert len(calls) == per_pass  # the main thread: packed for any size
    for tag, tokens in (("worker-1", one), ("worker-8", eight)):
        worker = threading.Thread(target=run, args=(tag, tokens), name=tag)
        worker.start()
        worker.join()
    assert calls.count("worker-1") == 0  # one row off the main thread: the plain path
    assert calls.count("worker-8") == 2 * 7  # 8 rows: packed projections (the head sees 2 rows: plain)
    torch.testing.assert_close(out["worker-1"], out["main-1"], rtol=1e-5, atol=1e-5)
