"""Training data: prompt files, their errors, and self-generated answers (batched through the one
decoding loop, cached, resumable) on a tiny random model with a tiny word-level tokenizer."""

from __future__ import annotations

import pytest
import torch
from helpers import WORDS, make_tiny_model_dir, prompts_file, tiny_model, write_jsonl

from mtp.training import data
from mtp.training.data import Example, build_examples, load_examples, load_prompts


def test_load_prompts_fields_and_limit(tmp_path):
    path = prompts_file(tmp_path)
    got = load_prompts(path, "question", "answer", limit=2)
    assert got == [{"prompt": "w0 w1 w2 w3", "response": "w0 w1"}, {"prompt": "w3 w4 w5 w6 w7", "response": "w1 w2"}]
    assert [p["response"] for p in load_prompts(path)] == [None] * 5


@pytest.mark.parametrize(
    "rows, fields, message",
    [
        ([{"q": "x"}], ("question", None), "line 1: no field 'question'"),
        ([{"question": "x"}, {"question": "  "}], ("question", None), "line 2: empty prompt"),
        ([{"question": "x"}], ("question", "answer"), "line 1: no field 'answer'"),
        ([], ("question", None), "no prompts"),
    ],
)
def test_load_prompts_errors(tmp_path, rows, fields, message):
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        load_prompts(path, *fields)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="data file not found"):
        load_prompts(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("name", ["test.jsonl", "gsm8k_test.jsonl", "test-00000.jsonl", "test/train.jsonl"])
def test_test_split_refused(tmp_path, name):
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    write_jsonl(path, [{"question": "x"}])
    with pytest.raises(ValueError, match="the test split is never used for training"):
        load_prompts(path)
    with pytest.raises(ValueError, match="the test split"):
        load_examples(path)


def test_load_examples(tmp_path):
    path = write_jsonl(tmp_path / "ex.jsonl", [{"prompt_ids": [1, 2], "response_ids": [3], "index": 0}])
    assert load_examples(path) == [Example([1, 2], [3])]
    write_jsonl(path, [{"prompt_ids": [1, 2]}])
    with pytest.raises(ValueError, match=r"no examples \(1 line\(s\) not"):
        load_examples(path)


def test_examples_from_responses(word_engine, tmp_path):
    prompts = load_prompts(prompts_file(tmp_path), "question", "answer", limit=2)
    got = build_examples(word_engine, prompts, self_generate=False)
    eos = WORDS.index("<eos>")
    assert got[0] == Example([2, 3, 4, 5], [2, 3, eos])
    with pytest.raises(ValueError, match="--response-field"):
        build_examples(word_engine, load_prompts(prompts_file(tmp_path)), self_generate=False)


def test_self_generate_equals_greedy_and_is_cached(word_engine, tmp_path, monkeypatch):
    """Batched, continuously refilled generation gives each prompt its own greedy answer."""
    from mtp.core.decoding.decode import generate

    prompts = load_prompts(prompts_file(tmp_path, n=5))
    got = build_examples(word_engine, prompts, self_generate=True, max_new_tokens=7, batch_size=2)
    eos = word_engine.loaded.eos_ids
    for p, ex in zip(prompts, got):
        ids = word_engine.encode(p["prompt"])
        seq = generate(word_engine.model, ids, "ntp", eos_ids=eos, params=_params(7))
        assert ex.prompt_ids == ids
        assert ex.response_ids == seq.output + ([WORDS.index("<eos>")] if seq.finish_reason == "stop" else [])
    # cached: a second call never decodes
    monkeypatch.setattr("mtp.core.decoding.decode.decode_step", _boom)
    assert build_examples(word_engine, prompts, self_generate=True, max_new_tokens=7, batch_size=2) == got


def test_self_generate_resumes_after_a_torn_write(word_engine, tmp_path):
    prompts = load_prompts(prompts_file(tmp_path, n=4))
    full = build_examples(word_engine, prompts, self_generate=True, max_new_tokens=5, batch_size=3)
    ids = [word_engine.encode(p["prompt"]) for p in prompts]
    path = data.selfgen_cache_path(word_engine, ids, 5)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:7])  # killed while writing the second answer
    assert build_examples(word_engine, prompts, self_generate=True, max_new_tokens=5, batch_size=3) == full
    assert len(path.read_text().splitlines()) == 4


def _params(n):
    from mtp.core.decoding.sampling import SamplingParams

    return SamplingParams(max_new_tokens=n)


def _boom(*a, **k):
    raise AssertionError("decoded although cached")


def test_tiny_model_dir_logits_roundtrip(tmp_path):
    """The fixture's directory loads back into the same model (so the other tests mean something)."""
    from mtp.core.runtime.loading import load

    loaded = load(str(make_tiny_model_dir(tmp_path / "m")))
    x = torch.tensor([[5, 6, 7]])
    assert torch.equal(loaded.model(x), tiny_model(0)(x))
