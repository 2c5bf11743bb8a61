"""The data set as committed shards (`mtp.training.shards`) and `mtp data`'s faults: a changed or
truncated shard is refused in one line, a crash while sealing loses and duplicates nothing, two runs on
one folder are refused, a resume finds prompts by content, evaluation prompts never reach a training
file (by name, through a link, or by content), and `--card` reads a folder without touching it."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from helpers import data_config, data_records, data_sources, make_tiny_model_dir, require_smollm2, write_jsonl

from mtp.cli import main
from mtp.training import data_engine as E
from mtp.training import shards
from mtp.training.data import load_examples, load_prompts
from mtp.training.eval_guard import check_not_evaluation, known

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "data" / "smollm2-135m" / "mix-v1"


def rec(i, n=3):
    return {
        "id": f"a{i}",
        "source": "gsm8k",
        "category": "",
        "prompt_ids": [1, 2, i],
        "response_ids": [i] * n,
        "finish": "stop",
    }


def folder(tmp_path, n=5):
    out = tmp_path / "d"
    out.mkdir()
    shards.write_manifest(out, {"format": "mtp-data", "version": 2, "shards": []})
    write_jsonl(out / "train.jsonl", [rec(i) for i in range(n)])
    return out


def test_seal_writes_a_checked_shard_and_empties_the_working_file(tmp_path):
    out = folder(tmp_path)
    [entry] = shards.seal(out)
    assert entry["file"] == "train-00001.jsonl.gz" and entry["lines"] == 5 and entry["response_tokens"] == 15
    assert (out / "train.jsonl").read_bytes() == b""
    assert [r["id"] for r in shards.read_shard(out, entry)] == [f"a{i}" for i in range(5)]
    write_jsonl(out / "train.jsonl", [rec(3), rec(7)])  # a3 is sealed already: only a7 is new
    [second] = shards.seal(out)
    assert second["file"] == "train-00002.jsonl.gz" and second["lines"] == 1
    assert sorted(shards.read(out)[0]) == sorted(f"a{i}" for i in (0, 1, 2, 3, 4, 7))
    assert len(load_examples(out)) == 6
    assert shards.seal(out) == []  # nothing new: no empty shard


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "foreign-lines"])
def test_a_damaged_shard_is_refused_in_one_line(tmp_path, damage):
    out = folder(tmp_path)
    [entry] = shards.seal(out)
    path = out / entry["file"]
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-9] + bytes([data[-9] ^ 1]) + data[-8:])
    elif damage == "delete":
        path.unlink()
    else:  # rewritten with other lines, manifest edited to match the checksum but not the line count
        path.write_bytes(gzip.compress(b'{"id": "z", "prompt_ids": [1], "response_ids": [2]}\n'))
        m = shards.read_manifest(out)
        m["shards"][0]["sha256"] = shards.sha256_file(path)
        shards.write_manifest(out, m)
    with pytest.raises(shards.ShardError) as e:
        load_examples(out)
    msg = str(e.value)
    assert "\n" not in msg and entry["file"] in msg
    assert ("missing" if damage == "delete" else "checksum" if damage in ("truncate", "flip") else "lines") in msg


def test_a_crash_while_sealing_loses_and_duplicates_nothing(tmp_path, monkeypatch):
    out = folder(tmp_path)
    real = shards.write_manifest

    def crash(folder, manifest):
        raise KeyboardInterrupt  # killed after the shard file was renamed, before the manifest names it

    monkeypatch.setattr(shards, "write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        shards.seal(out)
    assert (out / "train-00001.jsonl.gz").exists() and len(shards.read(out)[0]) == 5  # lines still in working file
    monkeypatch.setattr(shards, "write_manifest", real)
    shards.seal(out)  # the orphan shard is written again, named this time
    assert len(shards.read(out)[0]) == 5 and (out / "train.jsonl").read_bytes() == b""

    write_jsonl(out / "train.jsonl", [rec(9)])
    monkeypatch.setattr(os, "ftruncate", lambda *a: None)
    real_open = open

    def no_truncate(path, mode="r", *a, **k):  # killed after the manifest, before the working file is emptied
        f = real_open(path, mode, *a, **k)
        if mode == "r+b":
            f.truncate = lambda *a: (_ for _ in ()).throw(KeyboardInterrupt())
        return f

    monkeypatch.setattr("builtins.open", no_truncate)
    with pytest.raises(KeyboardInterrupt):
        shards.seal(out)
    monkeypatch.setattr("builtins.open", real_open)
    assert sorted(shards.read(out)[0]) == sorted(f"a{i}" for i in (0, 1, 2, 3, 4, 9))  # a9 twice on disk, once read
    assert shards.seal(out) == [] and (out / "train.jsonl").read_bytes() == b""


def test_a_second_run_on_the_same_folder_is_refused(word_engine, tmp_path):
    gsm, tasks = data_sources(tmp_path)
    cfg = data_config(tmp_path, gsm, tasks, self_written=0)
    E.run(word_engine, cfg, progress=False)
    with E.locked(Path(cfg.out)):
        with pytest.raises(ValueError, match=f"another `mtp data` run holds it \\(pid {os.getpid()}\\)"):
            E.run(word_engine, cfg, progress=False)
        with pytest.raises(ValueError, match="another"):
            E.seal(cfg.out)
    assert E.run(word_engine, cfg, progress=False)["answers"] == len(data_records(Path(cfg.out)))  # free again


def test_resume_keys_prompts_by_content(word_engine, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"w{i} w{i + 1} w{i + 2}"} for i in range(4)])
    cfg = E.DataConfig(
        out=str(tmp_path / "out"), prompts=str(prompts), max_new_tokens=4, batch_size=2, heldout_fraction=0.0
    )
    E.run(word_engine, cfg, progress=False)
    first = {r["id"]: r for r in data_records(Path(cfg.out))}
    assert len(first) == 4
    write_jsonl(prompts, [{"prompt": "w40 w41 w42"}] + [{"prompt": f"w{i} w{i + 1} w{i + 2}"} for i in range(4)])
    E.run(word_engine, cfg, progress=False)  # a line added at the top: only it is answered
    second = data_records(Path(cfg.out))
    assert len(second) == 5 == len({r["id"] for r in second})
    assert {r["id"]: r for r in second if r["id"] in first} == first
    new = next(r for r in second if r["id"] not in first)
    assert new["prompt_ids"] == word_engine.encode("w40 w41 w42", chat=True)


@pytest.mark.parametrize(
    "name", ["held-out.jsonl", "testset.jsonl", "heldout/sub/p.jsonl", "my_eval.jsonl", "link.jsonl"]
)
def test_evaluation_files_are_refused_by_name_and_through_links(tmp_path, name):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if name == "link.jsonl":
        (tmp_path / "test.jsonl").write_text('{"question": "w1 w2"}\n')
        path.symlink_to(tmp_path / "test.jsonl")
    else:
        path.write_text('{"question": "w1 w2"}\n')
    with pytest.raises(ValueError, match="never used for training"):
        load_prompts(path)
    with pytest.raises(ValueError, match="never used for training"):
        load_examples(path)


def test_a_training_file_holding_an_evaluation_prompt_is_refused(tmp_path):
    assert len(known()) > 7000  # GSM8K test, BIG-Bench Hard and the diverse set, as hashes
    diverse = json.loads((ROOT / "benchmarks/results/final/diverse60.jsonl").read_text().splitlines()[3])["prompt"]
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "w1 w2"}, {"prompt": "  " + diverse.upper() + " "}])
    with pytest.raises(ValueError, match="prompt 2 is a prompt of the diverse held-out evaluation set"):
        load_prompts(path, "prompt")  # what `mtp train --data` and `mtp data --prompts` read
    check_not_evaluation(["w1 w2", "an ordinary request"], path)  # no match: no error


def test_a_prompts_file_with_an_evaluation_prompt_stops_mtp_data(word_engine, tmp_path):
    diverse = json.loads((ROOT / "benchmarks/results/final/diverse60.jsonl").read_text().splitlines()[0])["prompt"]
    path = write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "w1 w2"}, {"prompt": diverse}])
    cfg = E.DataConfig(out=str(tmp_path / "o"), prompts=str(path), max_new_tokens=2, heldout_fraction=0.0)
    with pytest.raises(ValueError, match="evaluation set"):
        E.run(word_engine, cfg, progress=False)
    assert data_records(Path(cfg.out)) == []


def test_card_reads_a_folder_without_changing_it(word_engine, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.jsonl").write_text('{"a": 1}\n{"b": 2}')  # the user's last line has no newline
    (mine / "card.md").write_text("my notes")
    code = main(["data", "--card", "--out", str(mine)])
    assert code == 2 and "not an mtp data set" in capsys.readouterr().err
    assert (mine / "train.jsonl").read_text() == '{"a": 1}\n{"b": 2}' and (mine / "card.md").read_text() == "my notes"
    (mine / "manifest.json").write_text('{"name": "someone else\'s"}')
    assert main(["data", "--card", "--out", str(mine)]) == 2
    assert "not an mtp data set" in capsys.readouterr().err

    gsm, tasks = data_sources(tmp_path)
    cfg = data_config(tmp_path, gsm, tasks, self_written=0, max_new_tokens=5)
    E.run(word_engine, cfg, progress=False)
    with open(Path(cfg.out) / "train.jsonl", "a") as f:
        f.write('{"id": "torn", "prompt_ids": [1')
    assert main(["data", "--card", "--out", cfg.out, "--max-new-tokens", "99"]) == 0  # no source flag needed
    card = json.loads(capsys.readouterr().out)
    assert card["max_new_tokens"] == 5 and card["answers"] == len(data_records(Path(cfg.out)))
    assert (Path(cfg.out) / "train.jsonl").read_text().endswith("[1")  # a read-only command cuts nothing


def test_self_written_needs_three_tasks_in_one_line(tmp_path, capsys):
    _, tasks = data_sources(tmp_path)
    model = make_tiny_model_dir(tmp_path / "m")
    code = main(
        [
            "data",
            "--out",
            str(tmp_path / "o"),
            "--model",
            str(model),
            "--self-instruct",
            str(tasks),
            "--self-written",
            "2",
            "--limit",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "at least 3 self-instruct training tasks" in err, err


def test_data_suggests_only_flags_it_has(tmp_path, capsys):
    bad = write_jsonl(tmp_path / "p.jsonl", [{"text": "w1"}])
    model = make_tiny_model_dir(tmp_path / "m")
    assert main(["data", "--out", str(tmp_path / "o"), "--model", str(model), "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--prompt-field" not in err and '"prompt"' in err, err


@pytest.mark.skipif(not (SHIPPED / "manifest.json").exists(), reason="no committed data set")
def test_the_committed_data_set_is_intact_and_holds_no_evaluation_or_heldout_prompt():
    """Every committed shard matches its checksum; no training answer's prompt is held out or evaluated."""
    manifest = shards.read_manifest(SHIPPED)
    entries = shards.shard_entries(manifest, "train")
    assert entries, "the committed data set has no sealed shard"
    recs = [r for e in entries for r in shards.read_shard(SHIPPED, e)]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids))
    held = [
        json.loads(x)
        for f in sorted((SHIPPED / "heldout").glob("*.jsonl"))
        for x in f.read_text().splitlines()
        if x.strip()
    ]
    held_keys = {h["id"] for h in held}
    assert not held_keys & set(ids)
    held_tasks = {h["id"].split("-")[1] for h in held if h["id"].startswith("si-")}
    assert not {i.split("-")[1] for i in ids if i.startswith("si-")} & held_tasks
    gsm_test = {E.content_id("gsm8k", q) for q in _gsm8k_test()}
    assert not gsm_test & set(ids)
    # self-written requests: the text of every trained one is neither held out nor an evaluation prompt
    texts = {
        r["id"]: r.get("text", "")
        for e in shards.shard_entries(manifest, "instructions")
        for r in shards.read_shard(SHIPPED, e)
    }
    trained = [E.clean_instruction(texts[i]) for i in ids if i.startswith("sw-") and i in texts]
    held_text = {E.normalise(h["prompt"]) for h in held}
    assert not {E.normalise(t) for t in trained if t} & held_text
    check_not_evaluation([t for t in trained if t], "committed self-written requests")


def _gsm8k_test():
    root = os.environ.get("MTP_DATA_DIR")
    path = Path(root or "/nonexistent") / "gsm8k" / "test.jsonl"
    return [json.loads(x)["question"] for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.mark.parametrize("what", ["folder", "shard"])
def test_a_data_set_made_by_another_model_is_refused_whatever_its_vocabulary(tmp_path, capsys, what):
    """Its manifest's base_hash names the model the answers came from: another model's answers (here a
    tiny model of the same vocabulary, other weights) are refused in one line; the same model's pass."""
    from mtp.core.runtime.artifacts import base_hash
    from mtp.core.runtime.loading import load

    mine, other = make_tiny_model_dir(tmp_path / "mine", seed=0), make_tiny_model_dir(tmp_path / "other", seed=1)
    out = folder(tmp_path)
    m = shards.read_manifest(out)
    m["base_hash"] = base_hash(load(str(mine)).model)
    shards.write_manifest(out, m)
    [entry] = shards.seal(out)
    data = out if what == "folder" else out / entry["file"]
    argv = ["datastore", "build", "--data", str(data), "--out", str(tmp_path / "ds")]
    assert main(argv + ["--model", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtp: error:") and len(err.strip().splitlines()) == 1 and "another model" in err, err
    assert not (tmp_path / "ds").exists()
    assert main(argv + ["--model", str(mine)]) == 0, capsys.readouterr().err


def refuse_model_load(monkeypatch):
    """Any model load fails the test: the input was to be refused before it."""
    from mtp.core.engine import Engine

    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))


@pytest.mark.parametrize("command", ["data", "train", "train-heads", "train-eagle3"])
def test_a_batch_too_large_for_memory_is_refused_before_the_model_loads(command, tmp_path, capsys, monkeypatch):
    """T7: the KV cache's rows are zero-filled up front; 100,000 of them is one line, not a traceback."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w1 w2"}])
    refuse_model_load(monkeypatch)
    if command == "data":
        argv = ["data", "--out", str(tmp_path / "o"), "--prompts", str(prompts), "--batch-size", "100000"]
    else:
        argv = [
            command,
            "--data",
            str(prompts),
            "--prompt-field",
            "prompt",
            "--self-generate",
            "--gen-batch-size",
            "100000",
            "--out",
            str(tmp_path / "o"),
        ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    flag = "--batch-size" if command == "data" else "--gen-batch-size"
    assert err.startswith("mtp: error:") and err.count("\n") == 1 and f"{flag} must be in 1..256" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["file", "foreign-folder", "foreign-manifest"])
def test_an_out_mtp_data_cannot_use_is_refused_before_the_model_loads(kind, tmp_path, capsys, monkeypatch):
    """`--out` is checked before the model loads (a missing model is not the first complaint), in one
    line, and nothing in it changes."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w1 w2"}])
    out = tmp_path / "o"
    if kind == "file":
        out.write_text("mine")
    else:
        out.mkdir()
        (out / ("manifest.json" if kind == "foreign-manifest" else "notes.txt")).write_text('{"mine": 1}')
    before = {p: p.read_bytes() for p in [out, *out.rglob("*")] if p.is_file()}
    refuse_model_load(monkeypatch)
    assert main(["data", "--out", str(out), "--prompts", str(prompts), "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtp: error:") and err.count("\n") == 1 and str(out) in err, err
    assert "not a directory" in err if kind == "file" else "not an mtp data set" in err, err
    assert {p: p.read_bytes() for p in [out, *out.rglob("*")] if p.is_file()} == before


@pytest.mark.slow
def test_the_shipped_heads_recipe_trains_from_a_committed_shard(tmp_path, capsys):
    """`git clone` + the README's train-heads command on the committed data: a few steps on one real
    shard (the smallest) with the real model; the manifest's base_hash matches SmolLM2, the heads are
    written with the steps asked for and load onto the model."""
    require_smollm2()
    from mtp.core.decoding.proposers.heads import load_heads
    from mtp.core.engine import Engine, EngineConfig

    entry = min(shards.shard_entries(shards.read_manifest(SHIPPED), "train"), key=lambda e: e["lines"])
    out = tmp_path / "heads"
    rc = main(
        [
            "train-heads",
            "--examples",
            str(SHIPPED / entry["file"]),
            "--limit",
            "4",
            "--depths",
            "2",
            "--steps",
            "3",
            "--batch-size",
            "64",
            "--draft-vocab",
            "512",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["depths"] == 2 and 0 < cfg["draft_vocab"] <= 512 and cfg["meta"]["metrics"]["steps"] == 3
    engine = Engine.load(EngineConfig(adapter="none"))
    assert cfg["base_hash"] == shards.read_manifest(SHIPPED)["base_hash"]
    heads = load_heads(engine.model, out)
    assert all(p.isfinite().all() for p in heads.parameters())
