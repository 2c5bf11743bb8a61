"""No evaluation prompt is trained on or indexed, whatever its dress (issue 47, W2): a prefix ("Q:",
"Question:"), other punctuation, a trailing instruction, a chat template around it, or token ids
instead of text. Every reader of training or datastore data checks content: `train`, `train-heads`,
`train-eagle3` (--data and --examples), `datastore build` and `mtp data`, before any weight loads.

The fast tests build their own tiny hashes file (made-up prompts), so they always run; the real
GSM8K test split is reached only through MTP_DATA_DIR and the shipped hashes."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from helpers import WORDS, require_smollm2, write_jsonl

from mtp.cli import main
from mtp.training import eval_guard

# a made-up evaluation question (long enough to be found inside a longer text) and a short one
QUESTION = "A farmer has 1,200 apples and gives 3 to each of his 40 neighbours. How many apples are left?"
SHORT = "not ( True ) and ( False ) is"
# one the word-level tiny tokenizer can spell (its vocabulary is w0..w94)
WORD_QUESTION = "w3 w14 w15 w92 w65 w35 w89 w79 w32 w38"
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "eval_prompt_hashes.py"


@pytest.fixture
def eval_set(tmp_path, monkeypatch):
    """A hashes file of three made-up evaluation prompts, in place of the shipped one."""
    path = tmp_path / "eval_prompts.json"
    eval_guard.write_hashes(path, {"GSM8K test": [QUESTION, WORD_QUESTION], "BIG-Bench Hard": [SHORT]})
    monkeypatch.setattr(eval_guard, "HASHES", path)
    return path


@pytest.fixture(autouse=True)
def no_weights(monkeypatch, tmp_path):
    """Any weight load fails the test: every refusal here must come before one."""
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))

    def no_load(*a, **k):
        raise AssertionError("model weights were loaded")

    monkeypatch.setattr("mtp.core.runtime.loading.load_hf_dir", no_load)


def refused(argv, capsys, *words):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("mtp: error:") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


DRESSED = [
    "Q: " + QUESTION,
    QUESTION.replace("?", " ?"),
    "Question: " + QUESTION.replace("1,200", "1200"),
    "Problem:\n" + QUESTION + "\nLet's think step by step. Put the final answer after ####.",
    "Answer the question: " + QUESTION.upper(),
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    + QUESTION
    + "<|im_end|>\n<|im_start|>assistant\n",
    "Q: " + SHORT,
    "user\n" + SHORT + "\nassistant\n",
]


@pytest.mark.parametrize("text", DRESSED)
def test_a_dressed_evaluation_prompt_is_recognised(eval_set, text):
    with pytest.raises(ValueError, match=r"^data.jsonl: prompt 2 is a prompt of the (GSM8K test|BIG-Bench Hard) "):
        eval_guard.check_not_evaluation(["an ordinary training question", text], "data.jsonl")


@pytest.mark.parametrize(
    "text",
    [
        "A farmer has 1,200 apples and gives 3 to each of his 40 neighbours. How many pears are left?",
        "A farmer has 1,200 apples and gives 3 to each of his 40 neighbours.",
        "Is this true: not ( True ) and ( False ) is the same as False?",  # a short one only matches a whole line
        "not ( True ) and ( True ) is",
    ],
)
def test_other_prompts_pass(eval_set, text):
    eval_guard.check_not_evaluation([text], "data.jsonl")


def test_the_shipped_hashes_file_is_the_scripts_output_for_the_data():
    root = os.environ.get("MTP_DATA_DIR")
    if not root or not (Path(root) / "gsm8k" / "test.jsonl").exists():
        pytest.skip("set MTP_DATA_DIR to the evaluation data to compare the shipped hashes with it")
    spec = importlib.util.spec_from_file_location("eval_prompt_hashes", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    want = eval_guard.hash_sets(script.eval_prompts(Path(root)))
    assert json.loads(eval_guard.HASHES.read_text())["sets"] == {k: [list(e) for e in v] for k, v in want.items()}


# ---- the commands: text prompts ----------------------------------------------------------------------
def test_text_prompts_with_a_prefix_are_refused_by_every_trainer(eval_set, word_model, tmp_path, capsys):
    data = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"question": "w1 w2 w3", "answer": "w4 w5"},
            {"question": "Q: " + QUESTION.replace("?", " ?"), "answer": "w6"},
        ],
    )
    for command in ("train", "train-heads", "train-eagle3"):
        refused(
            [command, "--model", word_model, "--data", data, "--response-field", "answer", "--out", tmp_path / "o"],
            capsys,
            "train.jsonl: prompt 2",
            "GSM8K test",
        )
    refused(
        [
            "data",
            "--model",
            word_model,
            "--prompts",
            write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Question: " + QUESTION}]),
            "--out",
            tmp_path / "d",
        ],
        capsys,
        "p.jsonl: prompt 1",
        "GSM8K test",
    )
    refused(["data", "--model", word_model, "--gsm8k", data, "--out", tmp_path / "d"], capsys, "GSM8K test")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_prompts.json", "p.jsonl", "train.jsonl"]


def test_self_instruct_tasks_are_checked_before_the_model_loads(eval_set, word_model, tmp_path, capsys):
    tasks = [
        {"id": f"t{i}", "instruction": f"w{i} w{i + 1} w{i + 2}", "instances": [{"input": "", "output": ""}]}
        for i in range(3)
    ] + [{"id": "bad", "instruction": "Solve this problem.", "instances": [{"input": QUESTION, "output": "1080"}]}]
    si = write_jsonl(tmp_path / "seed_tasks.jsonl", tasks)
    refused(
        ["data", "--model", word_model, "--self-instruct", si, "--heldout-fraction", "0", "--out", tmp_path / "d"],
        capsys,
        "seed_tasks.jsonl",
        "GSM8K test",
    )
    assert not (tmp_path / "d").exists()


# ---- the commands: token ids -------------------------------------------------------------------------
def ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def test_token_id_examples_are_decoded_and_refused(eval_set, word_model, tmp_path, capsys):
    rows = [
        {"prompt_ids": ids("w1 w2 w3"), "response_ids": ids("w4 w5 w6")},
        {"prompt_ids": ids("w90 w91 " + WORD_QUESTION + " w93"), "response_ids": ids("w7 w8")},
    ]  # a template
    ex = write_jsonl(tmp_path / "answers.jsonl", rows)
    for command in ("train", "train-heads", "train-eagle3"):
        refused(
            [command, "--model", word_model, "--examples", ex, "--out", tmp_path / "o"],
            capsys,
            "answers.jsonl",
            "example 2",
            "GSM8K test",
        )
    refused(
        ["datastore", "build", "--model", word_model, "--data", ex, "--out", tmp_path / "ds"],
        capsys,
        "answers.jsonl",
        "example 2",
        "GSM8K test",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["answers.jsonl", "eval_prompts.json"]


def test_token_ids_of_a_data_folder_are_checked(eval_set, word_model, tmp_path, capsys):
    from mtp.training import shards

    folder = tmp_path / "mix"
    folder.mkdir()
    shards.write_manifest(folder, {"format": "mtp-data", "version": 2, "shards": []})
    write_jsonl(
        folder / "train.jsonl",
        [
            {"id": "a", "prompt_ids": ids("w1 w2"), "response_ids": ids("w3 w4")},
            {"id": "b", "prompt_ids": ids(WORD_QUESTION), "response_ids": ids("w5 w6")},
        ],
    )
    shards.seal(folder)
    refused(
        ["datastore", "build", "--model", word_model, "--data", folder, "--out", tmp_path / "ds"],
        capsys,
        "mix",
        "GSM8K test",
    )
    shard = next(folder.glob("train-*.jsonl.gz"))
    refused(
        ["train", "--model", word_model, "--examples", shard, "--out", tmp_path / "o"], capsys, shard.name, "GSM8K test"
    )
    assert not (tmp_path / "ds").exists() and not (tmp_path / "o").exists()


# ---- the real evaluation data (MTP_DATA_DIR) and the committed training data ---------------------------
def smollm2_tokenizer():
    require_smollm2()
    from mtp.core.runtime.loading import model_tokenizer

    return model_tokenizer("smollm2-135m")


@pytest.mark.slow
def test_real_gsm8k_test_questions_in_any_dress_are_refused(gsm8k_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MTP_CACHE_DIR")  # the converted SmolLM2 tokenizer of the user's cache
    tok = smollm2_tokenizer()
    questions = [json.loads(x)["question"] for x in Path(gsm8k_dir, "test.jsonl").read_text().splitlines()[:8]]
    data = write_jsonl(
        tmp_path / "mine.jsonl", [{"question": "Q: " + q.replace("?", " ?"), "answer": "42"} for q in questions]
    )
    refused(["train-heads", "--data", data, "--out", tmp_path / "h"], capsys, "mine.jsonl: prompt 1", "GSM8K test")
    chat = lambda q: tok.apply_chat_template(
        [{"role": "user", "content": q}],
        add_generation_prompt=True,  # noqa: E731
        tokenize=False,
    )
    rows = [
        {
            "prompt_ids": tok(chat(q), add_special_tokens=False)["input_ids"],
            "response_ids": tok("The answer is 42.", add_special_tokens=False)["input_ids"],
        }
        for q in questions
    ]
    ex = write_jsonl(tmp_path / "mine-ids.jsonl", rows)
    refused(["datastore", "build", "--data", ex, "--out", tmp_path / "ds"], capsys, "example 1", "GSM8K test")
    refused(["train", "--examples", ex, "--out", tmp_path / "o"], capsys, "example 1", "GSM8K test")


@pytest.mark.slow
def test_committed_training_data_passes_the_guard(monkeypatch):
    """Every prompt of the committed data set, decoded, against the shipped hashes: no false positive."""
    monkeypatch.delenv("MTP_CACHE_DIR")
    from mtp.training.data import check_examples_not_evaluation, load_examples

    folder = Path(__file__).resolve().parent.parent / "data" / "smollm2-135m" / "mix-v1"
    examples = load_examples(folder)
    assert len(examples) > 20_000
    check_examples_not_evaluation(examples, smollm2_tokenizer(), folder)
