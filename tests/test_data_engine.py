"""`mtp data`: answers through the one batching loop equal plain greedy decoding, a killed run resumes
with nothing duplicated or lost, corrupt lines are skipped and counted, held-out prompts never reach
the training file, and bad sources get one line."""

from __future__ import annotations

import json

import pytest
from helpers import data_config, data_records, data_sources, make_tiny_model_dir, write_jsonl

from mtp.cli import main
from mtp.core.decoding.decode import generate as greedy
from mtp.core.decoding.sampling import SamplingParams
from mtp.training import data_engine as E
from mtp.training import shards
from mtp.training.data import load_examples


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_answers_are_greedy_and_held_out_prompts_are_never_answered(word_engine, tmp_path):
    gsm, tasks = data_sources(tmp_path)
    card = E.run(word_engine, data_config(tmp_path, gsm, tasks), progress=False)
    out = tmp_path / "out"
    assert not (out / E.TRAIN).read_text()  # sealed when the run ended
    recs = data_records(out)
    assert len({r["id"] for r in recs}) == len(recs) == card["answers"]
    for r in recs[:8]:
        seq = greedy(
            word_engine.model,
            r["prompt_ids"],
            "ntp",
            SamplingParams(max_new_tokens=6),
            eos_ids=word_engine.loaded.eos_ids,
        )
        eos = [word_engine.tokenizer.eos_token_id] if seq.finish_reason == "stop" else []
        assert r["response_ids"] == seq.output + eos and r["finish"] == seq.finish_reason
    held = [json.loads(x) for f in (out / E.HELDOUT).glob("*.jsonl") for x in f.read_text().splitlines()]
    assert held and all(h["prompt"] for h in held)
    held_tasks = {h["id"].rsplit("-", 1)[0] for h in held if h["id"].startswith("si-")}
    trained_tasks = {r["id"].rsplit("-", 1)[0] for r in recs if r["id"].startswith("si-")}
    assert held_tasks and not held_tasks & trained_tasks  # a task's instances stay on one side
    assert {r["source"] for r in recs} >= {"gsm8k", "self_instruct"}
    assert card["by_source"]["gsm8k"]["answers"] == 6
    assert (out / "card.md").read_text().startswith("# Data card")
    written = {r["id"]: r["text"] for r in data_records(out, "instructions")}
    firsts = [E.first_word(written[r["id"]]) for r in recs if r["source"] == "self_written"]
    assert firsts and sum(c for _, c in card["self_written_first_words"]["top"]) == len(firsts)
    assert card["self_written_first_words"]["distinct"] == len(set(firsts))
    assert E.first_word('  "Write, then: explain!') == "write" and E.first_word("...") == ""
    assert len(load_examples(out)) == len(recs)  # what `mtp train --examples` reads
    assert len(load_examples(out / "train-00001.jsonl.gz")) == len(recs)
    with pytest.raises(ValueError, match="held-out split neither"):
        load_examples(next((out / E.HELDOUT).glob("*.jsonl")))


def test_a_killed_run_resumes_without_duplicates_or_losses(word_engine, tmp_path, monkeypatch):
    gsm, tasks = data_sources(tmp_path)
    full = tmp_path / "full"
    E.run(word_engine, data_config(tmp_path, gsm, tasks, out=str(full)), progress=False)
    real = E.generate
    calls = {"n": 0}

    def killed(engine, jobs, batch_size, on_finish, capacity=None, on_pass=None):
        def finish(job, seq):
            calls["n"] += 1
            if calls["n"] == 9:
                raise KeyboardInterrupt  # Ctrl-C (or a kill) mid-run
            on_finish(job, seq)

        return real(engine, jobs, batch_size, finish, capacity, on_pass)

    monkeypatch.setattr(E, "generate", killed)
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        E.run(word_engine, data_config(tmp_path, gsm, tasks, out=str(cut)), progress=False)
    card = json.loads((cut / "card.json").read_text())  # written on the way out: it counts what is on disk
    assert card["answers"] == len(data_records(cut)) > 0
    assert "train-00001.jsonl.gz" in card["shards"]
    with open(cut / E.TRAIN, "a") as f:
        f.write('{"id": "gsm8k-0", "prompt_ids": [1, 2')  # torn by the kill
    monkeypatch.setattr(E, "generate", real)
    E.run(word_engine, data_config(tmp_path, gsm, tasks, out=str(cut)), progress=False)
    a, b = data_records(full), data_records(cut)
    b_lines = [r for e in shards.shard_entries(shards.read_manifest(cut), "train") for r in shards.read_shard(cut, e)]
    assert len(b_lines) == len({r["id"] for r in b_lines}) == len(b)  # nothing twice, in two shards
    assert sorted(a, key=lambda r: r["id"]) == sorted(b, key=lambda r: r["id"])  # nothing lost, same answers
    assert len(data_records(full, "instructions")) == len(data_records(cut, "instructions"))


def test_corrupt_lines_are_skipped_and_counted(word_engine, tmp_path, monkeypatch):
    gsm, tasks = data_sources(tmp_path)
    cfg = data_config(tmp_path, gsm, tasks, self_written=0)
    monkeypatch.setattr(shards, "seal", lambda out, key="id": [])  # a kill -9: nothing sealed, the working file stays
    E.run(word_engine, cfg, progress=False)
    path = tmp_path / "out" / E.TRAIN
    good = lines(path)
    text = path.read_text().splitlines(keepends=True)
    path.write_text(
        text[0] + "not json\n" + '{"id": "x", "prompt_ids": ["a"], "response_ids": []}\n' + "".join(text[2:])
    )  # answer 2 corrupted, two bad lines
    assert len(load_examples(path, log=lambda m: None)) == len(good) - 1  # the trainers' reader skips them too
    card = E.run(word_engine, cfg, progress=False)
    assert card["corrupt_lines_skipped"] == 2
    ids = [r["id"] for r in lines_ok(path)]
    assert sorted(ids) == sorted(r["id"] for r in good)  # the corrupted answer was made again


def lines_ok(path):
    out = []
    for x in path.read_text().splitlines():
        try:
            rec = json.loads(x)
        except json.JSONDecodeError:
            continue
        if isinstance(rec.get("prompt_ids"), list) and all(isinstance(t, int) for t in rec["prompt_ids"]):
            out.append(rec)
    return out


def test_other_settings_and_foreign_folders_are_refused(word_engine, tmp_path):
    gsm, tasks = data_sources(tmp_path)
    E.run(word_engine, data_config(tmp_path, gsm, tasks, self_written=0), progress=False)
    with pytest.raises(ValueError, match="other settings"):
        E.run(word_engine, data_config(tmp_path, gsm, tasks, self_written=0, max_new_tokens=9), progress=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not an mtp data set"):
        E.run(word_engine, data_config(tmp_path, gsm, tasks, out=str(mine)), progress=False)
    assert (mine / "notes.txt").read_text() == "x"


def test_clean_and_deduplicate_written_tasks():
    assert E.clean_instruction(" Write a short poem about rain.\n5. more") == "Write a short poem about rain."
    assert E.clean_instruction(" Here is a new task:") is None and E.clean_instruction(" Yes.") is None
    d = E.Deduplicator(["Write a short poem about the rain"])
    assert d.seen("write a short poem about rain!") and not d.seen("Summarise this email for a manager")


def _scan_seen(sets: list[frozenset], exact: set[str], text: str) -> bool:
    """The definition `Deduplicator.seen` must keep: an exact match, or Jaccard >= t with any added set."""
    norm = E.normalise(text)
    words = frozenset(norm.split())
    return norm in exact or any(len(words & s) >= E.DUPLICATE_JACCARD * len(words | s) for s in sets)


def test_deduplicator_index_agrees_with_the_scan_over_every_pair():
    # small vocabularies and lengths 0..12 make many pairs sit right at the threshold (7 of 10, 7 of 9 ...)
    import random

    rng = random.Random(3)
    vocab = [f"w{i}" for i in range(14)]
    human = [" ".join(rng.sample(vocab, rng.randint(1, 10))) for _ in range(30)]
    d = E.Deduplicator(human)
    sets = [frozenset(E.normalise(t).split()) for t in human]
    exact = {E.normalise(t) for t in human}
    verdicts = []
    for _ in range(3000):
        text = " ".join(rng.choice(vocab + ["new", "x", "y"]) for _ in range(rng.randint(0, 12))) or "!!"
        want = _scan_seen(sets, exact, text)
        assert d.seen(text) == want, text
        verdicts.append(want)
        if not want:
            d.add(text)
            sets.append(frozenset(E.normalise(text).split()))
            exact.add(E.normalise(text))
    assert 100 < sum(verdicts) < 2900  # both answers were exercised


@pytest.mark.parametrize(
    "args, words",
    [
        (["--gsm8k", "DATA/test.jsonl"], "test split"),
        (["--self-written", "3"], "--self-written needs --self-instruct"),
        ([], "no source"),
        (["--prompts", "DATA/empty.jsonl"], "no prompts"),
    ],
)
def test_bad_sources_one_line(tmp_path, capsys, args, words):
    (tmp_path / "test.jsonl").write_text('{"question": "x"}\n')
    (tmp_path / "empty.jsonl").write_text("\n\n")
    model = make_tiny_model_dir(tmp_path / "m")
    args = [a.replace("DATA", str(tmp_path)) for a in args]
    code = main(["data", "--out", str(tmp_path / "o"), "--model", str(model), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("mtp: error:") and err.count("\n") == 1 and words in err, err


def test_card_counts_prompts_skipped_as_too_long_and_a_resume_says_what_it_replays(word_engine, tmp_path):
    _, tasks = data_sources(tmp_path)
    long = " ".join(f"w{i % 90}" for i in range(300))
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": q, "answer": "w1"} for q in ("w1 w2 w3", long)])
    logged = []
    cfg = data_config(tmp_path, gsm, tasks, max_prompt_tokens=128)
    card = E.run(word_engine, cfg, progress=False, log=logged.append)
    assert card["skipped_prompts_too_long"] == {"gsm8k": 1}, card  # the long question only
    on_disk = json.loads((tmp_path / "out" / "card.json").read_text())
    assert on_disk["skipped_prompts_too_long"] == card["skipped_prompts_too_long"]
    logged.clear()
    E.run(word_engine, cfg, progress=False, log=logged.append)  # a resume: the written requests are replayed
    assert any(m.startswith("data: replaying 4 self-written requests") for m in logged), logged
