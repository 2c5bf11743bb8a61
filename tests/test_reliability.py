"""The defects a hostile and a careless user found (CLI, files, training): each test reproduces one
(numbered as in the report) and checks the fix: a one-line error, exit 2, nothing lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import one_line_error, run_cli, tiny_model, write_jsonl, write_tiny_gguf
from safetensors.torch import load_file

from mtp.core.runtime.adapter import add_adapters, load_adapter, save_adapter
from mtp.core.runtime.artifacts import ArtifactError, write_dir_atomic
from mtp.training.distill import TrainConfig, train


def examples_file(tmp_path, ids=None):
    rows = [{"prompt_ids": [1, 2, 3], "response_ids": ids or [4, 5, 6, 7, 8]} for _ in range(4)]
    return write_jsonl(tmp_path / "examples.jsonl", rows)


def user_folder(tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "thesis.txt").write_text("x")
    (d / "sub" / "notes.txt").write_text("y")
    return d


def untouched(d):
    return (d / "thesis.txt").read_text() == "x" and (d / "sub" / "notes.txt").read_text() == "y"


# ---- 1. never delete what mtp did not write --------------------------------------------------------
TRAIN_ARGS = ["--steps", "1", "--batch-size", "2", "--k-max", "3", "--spans", "1", "--seq-len", "32", "--threads", "1"]


@pytest.mark.parametrize("flag", ["--out", "--export"])
def test_1_train_refuses_a_user_folder(word_model, tmp_path, capsys, flag):
    d = user_folder(tmp_path)
    out = ["--out", str(d)] if flag == "--out" else ["--out", str(tmp_path / "run"), "--export", str(d)]
    code, _, err = run_cli(
        ["train", "--model", str(word_model), "--examples", str(examples_file(tmp_path)), *TRAIN_ARGS, *out], capsys
    )
    one_line_error(code, err, str(d), "refusing to overwrite")
    assert untouched(d) and not (tmp_path / "run").exists()


def test_1_train_heads_refuses_a_user_folder(word_model, tmp_path, capsys):
    d = user_folder(tmp_path)
    data = write_jsonl(tmp_path / "train.jsonl", [{"question": "w1 w2", "answer": "w3 w4"}] * 3)
    code, _, err = run_cli(
        [
            "train-heads",
            "--model",
            str(word_model),
            "--data",
            str(data),
            "--out",
            str(d),
            "--steps",
            "1",
            "--limit",
            "3",
        ],
        capsys,
    )
    one_line_error(code, err, "refusing to overwrite")
    assert untouched(d)


def test_1_an_existing_file_is_refused_and_kept(word_model, tmp_path, capsys):
    report = tmp_path / "report.txt"
    report.write_text("mine")
    code, _, err = run_cli(
        [
            "train",
            "--model",
            str(word_model),
            "--examples",
            str(examples_file(tmp_path)),
            *TRAIN_ARGS,
            "--out",
            str(report),
        ],
        capsys,
    )
    one_line_error(code, err, "is not a directory")
    assert report.read_text() == "mine" and not (tmp_path / ".report.txt.old").exists()


def test_1_an_mtp_directory_of_the_same_kind_is_replaced(tmp_path):
    model = tiny_model(0)
    add_adapters(model, rank=2)
    save_adapter(model, tmp_path / "a", {"v": 1})
    save_adapter(model, tmp_path / "a", {"v": 2})  # ours: replaced
    assert json.loads((tmp_path / "a" / "config.json").read_text())["meta"] == {"v": 2}
    (tmp_path / "a" / "mine.txt").write_text("x")  # a user file inside: no longer only ours
    with pytest.raises(ArtifactError, match="refusing to overwrite"):
        save_adapter(model, tmp_path / "a", {"v": 3})
    assert (tmp_path / "a" / "mine.txt").exists()


# ---- 5. one cap on K, checked before the model loads -----------------------------------------------
def test_5_k_is_capped_before_loading(capsys):
    t0 = time.perf_counter()
    code, _, err = run_cli(["generate", "hi", "--model", "/nowhere", "--strategy", "static:100000"], capsys)
    one_line_error(code, err, "K is at most 32")
    code, _, err = run_cli(["generate", "hi", "--model", "/nowhere", "--strategy", "verify:999"], capsys)
    one_line_error(code, err, "K is at most 32")
    code, _, err = run_cli(
        ["bench", "--model", "/nowhere", "--data", "prompts:/nowhere", "--strategies", "static:1..8000"], capsys
    )
    one_line_error(code, err, "1..32")
    assert time.perf_counter() - t0 < 5


# ---- 6. pipeline stages checked against the layers before any stage starts --------------------------
def test_6_pipeline_checks_stages_first(word_model, capsys):
    t0 = time.perf_counter()
    code, _, err = run_cli(
        ["pipeline", "--stages", "3", "w1 w2", "--model", str(word_model), "--adapter", "none"], capsys
    )
    one_line_error(code, err, "between 1 and the model's 2 layers")
    assert time.perf_counter() - t0 < 5  # no stage was spawned (each would load the model)


# ---- 7. corrupt safetensors: one line naming the file ----------------------------------------------
def test_7_truncated_model_weights(word_model, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(word_model, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    code, _, err = run_cli(["generate", "w1", "--model", str(bad), "--adapter", "none"], capsys)
    one_line_error(code, err, str(w))


def test_7_truncated_adapter_and_heads(tmp_path):
    model = tiny_model(0)
    add_adapters(model, rank=2)
    save_adapter(model, tmp_path / "a")
    f = tmp_path / "a" / "adapter.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ValueError, match="adapter.safetensors: not a readable safetensors file"):
        load_adapter(tiny_model(0), tmp_path / "a")
    from mtp.core.decoding.proposers import heads as N

    heads = N.MTPHeads(N.HeadsConfig.for_model(tiny_model(0).config, 2))
    write_dir_atomic(tmp_path / "h", N.heads_files(heads, tiny_model(0)))
    h = tmp_path / "h" / "heads.safetensors"
    h.write_bytes(h.read_bytes()[:100])
    with pytest.raises(ValueError, match="heads.safetensors: not a readable safetensors file"):
        N.load_heads(tiny_model(0), tmp_path / "h")


# ---- 8. bad config.json values: validated, naming file and field ----------------------------------
@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c: [c], ["must be a JSON object"]),
        (lambda c: {**c, "hidden_size": 0}, ["'hidden_size'", "positive integer"]),
        (lambda c: {**c, "num_hidden_layers": "two"}, ["'num_hidden_layers'", "positive integer"]),
        (lambda c: {k: v for k, v in c.items() if k != "num_attention_heads"}, ["missing field 'num_attention_heads'"]),
        (None, ["not a valid JSON"]),
    ],
)
def test_8_bad_config_values(word_model, tmp_path, capsys, change, words):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(word_model, bad)
    cfg = bad / "config.json"
    cfg.write_text("{not json" if change is None else json.dumps(change(json.loads(cfg.read_text()))))
    code, _, err = run_cli(["generate", "w1", "--model", str(bad), "--adapter", "none"], capsys)
    one_line_error(code, err, "config.json", *words)


# ---- 9. non-UTF-8 input ----------------------------------------------------------------------------
def test_9_non_utf8_prompt_argv_and_stdin(word_model, tmp_path):
    env = {**os.environ, "MTP_CACHE_DIR": str(tmp_path / "cache")}
    base = [
        sys.executable,
        "-m",
        "mtp.cli",
        "generate",
        "--model",
        str(word_model),
        "--adapter",
        "none",
        "--max-new-tokens",
        "2",
    ]
    r = subprocess.run(base, input=b"Say \xff", capture_output=True, env=env, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1 and "not valid UTF-8" in err, err
    r = subprocess.run(base + [os.fsdecode(b"Say \xff")], capture_output=True, env=env, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1 and "not valid UTF-8" in err, err


# ---- 10 / 11 / 17. sampling and engine flags: finite, in range, checked before loading ------------
@pytest.mark.parametrize(
    "args, words",
    [
        (["--temperature", "nan"], ["temperature must be a number in [0, 2]"]),
        (["--temperature", "inf"], ["temperature"]),
        (["--temperature", "2.5"], ["temperature"]),
        (["--top-p", "nan"], ["top_p"]),
        (["--seed", str(2**64)], ["seed must be in"]),
        (["--threads", "-1"], ["--threads must be >= 0"]),
        (["--device", "bogus"], ["--device 'bogus'"]),
        (
            ["--device", "cuda:7"]
            if torch.cuda.is_available() and torch.cuda.device_count() < 8
            else ["--device", "cuda"],
            ["CUDA"],
        ),
    ],
)
def test_10_11_17_flags_checked_before_the_model_loads(capsys, args, words):
    code, _, err = run_cli(["generate", "hi", "--model", "/nowhere", *args], capsys)  # a model load would fail
    one_line_error(code, err, *words)


# ---- 12. out-of-vocabulary ids in --examples -------------------------------------------------------
def test_12_examples_with_out_of_vocabulary_ids(word_model, tmp_path, capsys):
    path = write_jsonl(
        tmp_path / "examples.jsonl",
        [{"prompt_ids": [1, 2], "response_ids": [3, 4, 5]}, {"prompt_ids": [1, 2], "response_ids": [3, 4000, 5]}],
    )
    code, _, err = run_cli(
        ["train", "--model", str(word_model), "--examples", str(path), *TRAIN_ARGS, "--out", str(tmp_path / "run")],
        capsys,
    )
    one_line_error(code, err, "examples.jsonl line 2", "token id 4000")
    assert not (tmp_path / "run").exists()


# ---- 13. a tampered adapter cannot change lossless output -------------------------------------------
def test_13_tampered_mask_token_id_is_refused(tmp_path):
    model = tiny_model(0)
    add_adapters(model, rank=2)
    save_adapter(model, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["mask_token_id"] == 97 and cfg["vocab_size"] == 98
    for mid, vocab in ((5, 98), (5, 97), (98, 99)):  # a real token's row; an id past the added row
        json.dump({**cfg, "mask_token_id": mid, "vocab_size": vocab}, open(tmp_path / "a" / "config.json", "w"))
        fresh = tiny_model(0)
        with pytest.raises(ValueError, match="not the row an adapter adds"):
            load_adapter(fresh, tmp_path / "a")
        assert fresh.config.vocab_size == 97 and fresh.config.mask_token_id is None  # left untouched
    json.dump(cfg, open(tmp_path / "a" / "config.json", "w"))
    load_adapter(tiny_model(0), tmp_path / "a")  # the genuine one still loads


def test_13_mask_id_must_follow_the_tokenizer(tmp_path):
    model = tiny_model(0)
    add_adapters(model, rank=2, n_used_tokens=90)  # a padded model: rows 90..96 unused
    save_adapter(model, tmp_path / "a")
    load_adapter(tiny_model(0), tmp_path / "a", n_tokenizer=90)
    with pytest.raises(ValueError, match="not the row an adapter adds"):
        load_adapter(tiny_model(0), tmp_path / "a", n_tokenizer=95)  # row 90 is a real token here


# ---- 16. temp folders of interrupted saves are cleaned ----------------------------------------------
def test_16_stale_temp_folders_are_removed_on_the_next_save_and_resume(tmp_path):
    exs = [__import__("mtp.training.data", fromlist=["Example"]).Example([1, 2, 3], [4, 5, 6, 7, 8])] * 4
    cfg = dict(
        out=str(tmp_path / "run"), steps=2, batch_size=2, k_max=3, spans=1, seq_len=32, save_every=1, log_every=1
    )
    import json
    import subprocess

    from mtp.core.runtime import artifacts

    dead = subprocess.Popen(["true"])
    dead.wait()  # a process id that no longer runs: the save that made the folder was killed

    def left_by_a_killed_save():
        stale = tmp_path / ".run.tmp-killed"
        stale.mkdir()
        (stale / "adapter.safetensors").write_bytes(b"x" * 1000)
        (stale / artifacts.MARKER).write_text(json.dumps({"pid": dead.pid}))
        return stale

    mine = tmp_path / ".run.tmp-mine"  # looks like a temp folder, but mtp did not make it (D4): kept
    mine.mkdir()
    stale = left_by_a_killed_save()
    train(TrainConfig(**cfg), tiny_model(0), exs, progress=False)
    assert not stale.exists() and mine.is_dir()
    stale = left_by_a_killed_save()
    train(TrainConfig(**{**cfg, "steps": 3, "resume": True}), tiny_model(0), exs, progress=False)
    assert not stale.exists() and sorted(p.name for p in tmp_path.iterdir()) == [".run.tmp-mine", "run"]
    assert set(load_file(str(tmp_path / "run" / "adapter.safetensors")))


# ---- 18. the demo speaks while it works, and its table fits 80 columns -----------------------------
def test_18_demo_progress_and_width(word_model, capsys):
    from mtp.cli import demo

    assert demo.main(["--model", str(word_model), "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("loading ")
    assert sum(1 for ln in lines if ln.startswith("[") and "tokens/pass" in ln) == 2 * len(demo.PROMPTS)
    assert max(len(ln) for ln in lines) <= 80
    assert "tokens/pass" in out and "speedup" in out


# ---- issue 64 U2. an output folder that cannot be written is refused before the work -----------------
@pytest.fixture
def read_only(tmp_path):
    """A folder nothing can be created in, even by root (`chattr +i`; else mode 0555 where that binds)."""
    d = tmp_path / "ro"
    d.mkdir()
    immutable = subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0
    if not immutable:
        d.chmod(0o555)
        if os.access(d, os.W_OK):
            d.chmod(0o755)
            pytest.skip("no way to make a folder read-only here (root without chattr)")
    yield d
    if immutable:
        subprocess.run(["chattr", "-i", str(d)], check=True)
    d.chmod(0o755)


def test_u2_train_heads_into_a_read_only_folder_is_refused_first(word_model, tmp_path, capsys, read_only):
    data = write_jsonl(tmp_path / "train.jsonl", [{"question": "w1 w2", "answer": "w3 w4"}] * 3)
    argv = ["train-heads", "--model", str(word_model), "--data", str(data), "--out", str(read_only / "h")]
    code, _, err = run_cli([*argv, "--steps", "1", "--limit", "3", "--cache-dir", str(tmp_path / "c")], capsys)
    one_line_error(code, err, "--out", str(read_only / "h"), "cannot write in", str(read_only))
    assert not (tmp_path / "c").exists()  # no answers generated, no hidden states cached


def test_u2_datastore_build_into_a_read_only_folder_is_refused_first(
    word_model, tmp_path, capsys, read_only, monkeypatch
):
    from mtp.core.runtime import loading

    calls, real = [], loading.load
    monkeypatch.setattr(loading, "load", lambda *a, **k: calls.append(a) or real(*a, **k))
    argv = ["datastore", "build", "--data", str(examples_file(tmp_path)), "--model", str(word_model)]
    code, _, err = run_cli([*argv, "--out", str(read_only / "ds")], capsys)
    one_line_error(code, err, "--out", "cannot write in", str(read_only))
    assert calls == []  # the model was never loaded


# ---- issue 64 U5. the first start says what it does, once -------------------------------------------
def test_u5_a_first_conversion_says_what_it_does_once(tmp_path, monkeypatch, capsys):
    from mtp.core.runtime import loading

    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = loading.gguf_to_hf_dir(gguf_file)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"converting tiny.gguf into {out}" in err[0] and "once" in err[0], err
    assert loading.gguf_to_hf_dir(gguf_file) == out and capsys.readouterr().err == ""  # cached: silent


def test_a_kill_before_the_marker_is_written_leaves_nothing_in_the_way(tmp_path):
    """A kill between creating a save's work folder and writing its marker: the folder's name carries the
    PID (`.NAME.tmp-PID-*`), so an empty one (or one holding only a cut marker) of a dead process is
    removed; one of a live process, one with content, or one named otherwise is kept."""
    from mtp.core.runtime import artifacts

    dead = subprocess.Popen(["true"])
    dead.wait()
    target = tmp_path / "run"
    empty = tmp_path / f".run.tmp-{dead.pid}-x1"
    cut = tmp_path / f".run.old-{dead.pid}-x2"
    live = tmp_path / ".run.tmp-1-x3"  # pid 1 runs
    full = tmp_path / f".run.tmp-{dead.pid}-x4"
    other = tmp_path / ".run.tmp-x5"
    for folder in (empty, cut, live, full, other):
        folder.mkdir()
    (cut / artifacts.MARKER).write_text('{"pi')
    (full / "adapter.safetensors").write_bytes(b"x")
    artifacts.recover_interrupted(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, full, other))
    with artifacts.atomic_dir(target) as work:  # the folders a save makes carry its PID from the start
        assert work.parent.name.startswith(f".run.tmp-{os.getpid()}-")
        (work / "x.json").write_text("{}")
    assert (target / "x.json").exists()
