"""A hostile user's probe of token trees (`tree:N`), the suffix proposer and its datastores, merged
proposers and the sharded data set, on tiny random models: bad input is one `mtp: error:` line (exit 2)
or an HTTP 400, checked before the model loads where the flag alone says it is wrong; no user file is
overwritten; lossless trees give plain greedy's output token for token (EOS, stop strings and
max_new_tokens inside an accepted path, tree:31 at the context window within its KV slack), and
sampled trees make plain sampling's draws."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import MTP, make_app, make_tiny_model_dir, random_heads, save_tiny, tiny_model

from mtp.core.decoding.decode import Sequence, block_slack, decode_step, generate
from mtp.core.decoding.proposers import DraftRequest, Guesses, PassView, PromptLookupProposer, Proposer
from mtp.core.decoding.proposers import heads as N
from mtp.core.decoding.proposers.merged import MergedProposer
from mtp.core.decoding.proposers.suffix import Datastore, SuffixProposer, build_datastore
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.runtime import loading
from mtp.core.runtime.cache import KVCache
from mtp.training import shards

PROMPT = [5, 17, 3, 44, 9, 5, 17, 3]


# ---- helpers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A loadable HF directory: tiny random model (vocabulary 97), word-level tokenizer `w0 .. w94`."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("hostile-trees") / "tiny")


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir):
    return loading.load(str(tiny_dir)).model


def mtp_main(capsys, argv) -> tuple[int, str, str]:
    from mtp.cli import main

    rc = main([*argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(capsys, argv) -> str:
    rc, _, err = mtp_main(capsys, argv)
    assert rc == 2, err
    assert err.startswith("mtp: error:") and len(err.strip().splitlines()) == 1, err
    return err


def no_model_load(monkeypatch):
    """Any model load fails the test: the input was to be refused before it."""

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(loading, "load", refuse)


def snapshot(path: Path) -> dict:
    """Every file under `path` (or `path` itself) and its bytes."""
    path = Path(path)
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def gen_args(tiny_dir, *extra) -> list[str]:
    return [
        "generate",
        "w1 w2 w3",
        "--model",
        str(tiny_dir),
        "--adapter",
        "none",
        "--threads",
        "1",
        "--max-new-tokens",
        "16",
        *extra,
    ]


def params(n=24, **kw):
    return SamplingParams(max_new_tokens=n, **kw)


class FullTree(Proposer):
    """Always exactly n tree nodes: a wrong root child first, then the true continuation as a chain
    under a second root child, padded with junk, so the accepted path is off the diagonal and every
    pass uses all n nodes (the most KV-cache slots a tree can write)."""

    name = "oracle"
    has_confidence = True

    def __init__(self, truth: list[int], prompt_len: int, vocab: int = 97):
        self.truth, self.prompt_len, self.vocab = truth, prompt_len, vocab

    def propose(self, request):
        if not request.tree:
            return Guesses.none()
        n = request.n
        done = len(request.view.context) - self.prompt_len
        nxt = self.truth[done : done + n - 1]
        nxt += [(7 * j + 3) % self.vocab for j in range(n - 1 - len(nxt))]  # past the truth: junk
        bad = (nxt[0] + 1) % self.vocab
        tokens = [bad] + nxt
        parents = [-1, -1] + list(range(1, n - 1))
        return Guesses(tokens[:n], [0.5] * min(n, len(tokens)), None, parents[:n])


def decode_all(model, seq: Sequence, capacity: int) -> tuple[KVCache, int]:
    """Decode `seq` to the end in a cache of `capacity` slots; (the cache, the highest slot written)."""
    cache = KVCache.for_model(model, 1, capacity)
    highest = [0]
    writer = cache.writer

    def spy(layer, positions, slots):
        highest[0] = max(highest[0], int(positions.max()))
        return writer(layer, positions, slots)

    cache.writer = spy
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)
    return cache, highest[0]


# ---- strategies and proposer names: one line, before the model loads --------------------------------


@pytest.mark.parametrize("strategy", ["tree:0", "tree:-1", "tree:100000", "tree:", "tree:8:2", "tree:1.5"])
def test_tree_n_out_of_range_is_refused_before_the_model_loads(strategy, tiny_dir, capsys, monkeypatch):
    no_model_load(monkeypatch)
    err = one_line_error(capsys, gen_args(tiny_dir, "--proposer", "lookup", "--strategy", strategy))
    assert strategy in err


def test_tree_n_out_of_range_in_bench_is_refused_before_the_model_loads(tiny_dir, tmp_path, capsys, monkeypatch):
    no_model_load(monkeypatch)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    err = one_line_error(
        capsys,
        [
            "bench",
            "--data",
            f"prompts:{data}",
            "--model",
            str(tiny_dir),
            "--adapter",
            "none",
            "--strategies",
            "tree:8@lookup,tree:100000@lookup",
            "--out",
            str(tmp_path / "b"),
        ],
    )
    assert "1..31" in err and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "proposer, words",
    [
        ("heads+nope+lookup", "unknown proposer 'nope'"),
        ("heads+suffix+", "malformed"),
        ("lookup+lookup", "each part once"),
        ("lookup+mask", "cannot be merged"),
        ("suffix+eagle3+mask-single", "cannot be merged"),
        ("eagle3+eagle3", "each part once"),
    ],
)
def test_a_bad_name_inside_a_plus_list_is_refused_before_the_model_loads(
    proposer, words, tiny_dir, capsys, monkeypatch
):
    no_model_load(monkeypatch)
    err = one_line_error(capsys, gen_args(tiny_dir, "--proposer", proposer, "--strategy", "tree:8"))
    assert words in err


def test_suffix_without_a_datastore_is_one_line(tiny_dir, capsys):
    err = one_line_error(capsys, gen_args(tiny_dir, "--proposer", "suffix", "--strategy", "tree:8"))
    assert "--datastore" in err


def test_serve_refuses_bad_tree_requests_with_400():
    pytest.importorskip("fastapi")
    import tempfile

    from fastapi.testclient import TestClient

    from mtp.core.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory() as tmp:
        eng = Engine.load(EngineConfig(model=str(save_tiny(Path(tmp) / "m")), adapter="none"))  # proposer: mask
        with TestClient(make_app(eng)) as c:
            for strategy, words in [("tree:0", "1..31"), ("tree:100000", "1..31")]:
                r = c.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "ab", "max_tokens": 4, "mtp": {"strategy": strategy}},
                )
                assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
            # a tree from the mask proposer (the tiny model has the mask token) is served, no longer refused
            r = c.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "ab", "max_tokens": 4, "mtp": {"strategy": "tree:8"}},
            )
            assert r.status_code == 200, r.text


# ---- datastores that are refused -----------------------------------------------------------------------


def good_store(path: Path, model) -> Path:
    build_datastore([[5, 6, 7, 8], [5, 6, 9]], model, None, path)
    return path


def corrupt(kind: str, path: Path, model) -> Path:
    from safetensors.torch import save_file

    if kind == "empty-folder":
        path.mkdir()
        return path
    if kind == "other-model":
        return good_store(path, tiny_model(1))
    if kind == "other-tokenizer":  # no base hash to compare: the vocabulary check must still hold
        Datastore(np.array([5, 6, 500, -1])).save(path)
        return path
    good_store(path, model)
    w, cfg = path / "datastore.safetensors", path / "config.json"
    if kind == "truncated":
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif kind == "bad-json":
        cfg.write_text("{not json")
    elif kind == "json-list":
        cfg.write_text("[1, 2]")
    elif kind == "not-a-datastore-config":
        cfg.write_text(json.dumps({"format": "mtp-heads"}))
    elif kind == "only-separators":
        save_file({"tokens": torch.full((6,), -1, dtype=torch.int32)}, str(w))
    elif kind == "bf16-tokens":
        save_file({"tokens": torch.arange(6, dtype=torch.bfloat16)}, str(w))
    elif kind == "float-tokens":
        save_file({"tokens": torch.arange(6, dtype=torch.float32) + 0.5}, str(w))
    elif kind == "2d-tokens":
        save_file({"tokens": torch.zeros(2, 3, dtype=torch.int32)}, str(w))
    return path


@pytest.mark.parametrize(
    "kind, words",
    [
        ("empty-folder", "not a datastore"),
        ("other-model", "another model"),
        ("other-tokenizer", "outside the model's vocabulary"),
        ("truncated", "not a readable safetensors"),
        ("bad-json", "not a valid JSON"),
        ("json-list", "must be a JSON object"),
        ("not-a-datastore-config", "not an mtp datastore"),
        ("only-separators", "empty"),
        ("bf16-tokens", "int32"),
        ("float-tokens", "int32"),
        ("2d-tokens", "1-D"),
    ],
)
def test_a_bad_datastore_is_one_line(kind, words, tiny_dir, tiny_loaded, tmp_path, capsys):
    ds = corrupt(kind, tmp_path / "ds", tiny_loaded)
    before = snapshot(ds)
    err = one_line_error(
        capsys, gen_args(tiny_dir, "--proposer", "suffix", "--datastore", str(ds), "--strategy", "tree:8")
    )
    assert words in err
    assert snapshot(ds) == before  # nothing of the user's is touched


# ---- mtp datastore build -------------------------------------------------------------------------------


def answers_file(path: Path, rows=((1, 2, 3), (4, 5, 6, 7)), name="answers.jsonl") -> Path:
    f = path / name
    f.write_text("".join(json.dumps({"prompt_ids": [9, 9], "response_ids": list(r)}) + "\n" for r in rows))
    return f


def build_args(data, out, model) -> list[str]:
    return ["datastore", "build", "--data", str(data), "--out", str(out), "--model", str(model)]


@pytest.mark.parametrize("target", ["model-folder", "heads-folder", "plain-folder", "file"])
def test_datastore_build_never_replaces_a_user_folder_and_says_so_before_loading(
    target, tiny_dir, tmp_path, capsys, monkeypatch
):
    if target == "model-folder":  # has a config.json, as a datastore does
        out = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    elif target == "heads-folder":
        out = tmp_path / "heads"
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"format": "mtp-heads"}))
        (out / "heads.safetensors").write_bytes(b"weights")
    elif target == "plain-folder":
        out = tmp_path / "notes"
        out.mkdir()
        (out / "todo.txt").write_text("mine")
    else:
        out = tmp_path / "notes.txt"
        out.write_text("mine")
    before = snapshot(out)
    data = answers_file(tmp_path)
    no_model_load(monkeypatch)
    one_line_error(capsys, build_args(data, out, tiny_dir))
    assert snapshot(out) == before


def test_datastore_build_rebuilds_an_earlier_datastore(tiny_dir, tmp_path, capsys):
    out = tmp_path / "ds"
    rc, _, err = mtp_main(capsys, build_args(answers_file(tmp_path), out, tiny_dir))
    assert rc == 0, err
    bigger = answers_file(tmp_path, rows=((1, 2, 3), (4, 5, 6, 7), (8, 9, 10)), name="more.jsonl")
    rc, _, err = mtp_main(capsys, build_args(bigger, out, tiny_dir))  # "replaced atomically", says --out's help
    assert rc == 0, err
    assert json.loads((out / "config.json").read_text())["tokens"] == 10
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "datastore.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.")]  # no temporary left behind


def test_datastore_build_refuses_test_splits_and_folders_that_are_not_data_sets(
    tiny_dir, tmp_path, capsys, monkeypatch
):
    no_model_load(monkeypatch)
    test_split = answers_file(tmp_path, name="test.jsonl")
    heldout = tmp_path / "set" / "heldout"
    heldout.mkdir(parents=True)
    answers_file(heldout, name="self_written.jsonl")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "manifest.json").write_text(json.dumps({"name": "someone else's"}))
    answers_file(foreign, name="train.jsonl")
    plain = tmp_path / "plain"
    plain.mkdir()
    answers_file(plain, name="train.jsonl")
    for data, words in [
        (test_split, "test split"),
        (heldout, "test split"),
        (heldout / "self_written.jsonl", "test split"),
        (foreign, "not an mtp data set"),
        (plain, "must be an `mtp data` output"),
        (tmp_path / "missing.jsonl", "not found"),
    ]:
        err = one_line_error(capsys, build_args(data, tmp_path / "ds", tiny_dir))
        assert words in err, (data, err)
    assert not (tmp_path / "ds").exists()


def test_datastore_build_refuses_answers_of_another_tokenizer(tiny_dir, tmp_path, capsys):
    data = answers_file(tmp_path, rows=((1, 2, 3), (4, 500, 6)))  # 500: outside the tiny vocabulary (97)
    err = one_line_error(capsys, build_args(data, tmp_path / "ds", tiny_dir))
    assert "500" in err and "vocabulary" in err
    assert not (tmp_path / "ds").exists()  # not a datastore that no load would ever accept


# ---- the sharded data set ------------------------------------------------------------------------------


def data_folder(path: Path, lines: list) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"format": "mtp-data", "version": 2, "shards": []}))
    (path / "train.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def rec(i, n=3):
    return {"id": f"r-{i}", "prompt_ids": [1, 2], "response_ids": [(i + j) % 90 + 3 for j in range(n)]}


def test_a_record_with_an_unhashable_id_is_a_skipped_line_not_a_traceback(tiny_dir, tmp_path, capsys):
    folder = data_folder(
        tmp_path / "set",
        [
            rec(1),
            {"id": [1], "prompt_ids": [1], "response_ids": [2]},
            {"id": {"a": 1}, "prompt_ids": [1], "response_ids": [2]},
            rec(2),
        ],
    )
    recs, bad = shards.read(folder, "train", repair=False)
    assert sorted(recs) == ["r-1", "r-2"] and bad == 2
    rc, _, err = mtp_main(capsys, build_args(folder, tmp_path / "ds", tiny_dir))
    assert rc == 0, err
    rc, out, err = mtp_main(capsys, ["data", "--out", str(folder), "--seal"])
    assert rc == 0, err
    assert json.loads(out)["answers"] == 2


def test_sealing_never_overwrites_a_sealed_shard(tmp_path):
    folder = data_folder(tmp_path / "set", [rec(1), rec(2)])
    first = shards.seal(folder)[0]
    (folder / "train.jsonl").write_text(json.dumps(rec(3)) + "\n")
    second = shards.seal(folder)[0]
    kept = (folder / second["file"]).read_bytes()
    # the user drops the first shard's entry (a shard they no longer want); the next seal must not reuse
    # the number of the newest shard
    m = shards.read_manifest(folder)
    shards.write_manifest(folder, {**m, "shards": [e for e in m["shards"] if e["file"] != first["file"]]})
    (folder / "train.jsonl").write_text(json.dumps(rec(4)) + "\n")
    third = shards.seal(folder)[0]
    assert third["file"] not in (first["file"], second["file"])
    assert (folder / second["file"]).read_bytes() == kept
    recs, bad = shards.read(folder, "train")
    assert sorted(recs) == ["r-3", "r-4"] and bad == 0
    assert json.loads(gzip.decompress((folder / third["file"]).read_bytes()))["id"] == "r-4"


# ---- the suffix proposer's chain ------------------------------------------------------------------------


def test_suffix_chain_follows_the_most_frequent_continuation():
    # after "2": "5 6" three times, "9" once (the latest); verify:K must draft the frequent one
    store = Datastore.from_answers([[2, 5, 6], [2, 5, 6], [2, 5, 6], [2, 9]])
    view = PassView(context=[7, 2], mask_logits=torch.zeros(0, 1), hidden=None, masks_valid=False)
    g = SuffixProposer(store).propose(DraftRequest(view, 3, False, params()))  # room for both continuations
    assert g.tokens == [5, 6] and g.confidences == [0.75, 0.75]


# ---- lossless trees: identical to plain greedy, within their KV slack -----------------------------------


@pytest.mark.parametrize("drafts", ["right", "wrong"])
def test_tree31_at_the_context_window_writes_only_the_slack_it_reserved(drafts):
    n_prompt, n_new, n = 16, 32, 31
    model = tiny_model(0, max_seq_len=n_prompt + n_new)  # prompt + max_new_tokens == the context window
    prompt = [(3 * j + 1) % 90 for j in range(n_prompt)]
    want = generate(model, prompt, "ntp", params=params(n_new)).output
    truth = want if drafts == "right" else [(t + 1) % 97 for t in want]  # wrong: every draft rejected
    seq = Sequence(list(prompt), Strategy.parse(f"tree:{n}"), params(n_new), FullTree(truth, n_prompt))
    # the last pass starts with n_new - 1 tokens emitted, n_prompt + n_new - 2 of them committed, and
    # feeds its pending token and the n nodes: slots up to n_prompt + n_new - 2 + n; one slot more than
    # that is all this cache has
    cache, highest = decode_all(model, seq, n_prompt + n_new - 1 + n)
    assert seq.output == want and seq.finish_reason == "length"
    assert highest <= n_prompt + n_new - 2 + n
    assert n_prompt + n_new - 1 + n <= n_prompt + n_new + block_slack(Strategy.parse(f"tree:{n}").k)
    assert cache.lengths[0] <= n_prompt + n_new
    if drafts == "right":
        assert seq.stats.forward_passes < n_new / 4  # long accepted paths


@pytest.mark.parametrize("n_new", [1, 2, 5, 9])
def test_max_new_tokens_is_never_exceeded_by_a_tree(n_new):
    model = tiny_model(0)
    truth = generate(model, PROMPT, "ntp", params=params(40)).output
    seq = Sequence(list(PROMPT), Strategy.parse("tree:31"), params(n_new), FullTree(truth, len(PROMPT)))
    emitted = []
    cache = KVCache.for_model(model, 1, len(PROMPT) + n_new + block_slack(32))
    with torch.inference_mode():
        while not seq.finished:
            emitted.append(decode_step(model, cache, [seq], None)[0])
    assert seq.output == truth[:n_new] and sum(map(len, emitted)) == n_new and seq.finish_reason == "length"


def first_new(tokens: list[int], start: int = 3) -> int:
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_eos_inside_an_accepted_tree_path_stops_there():
    model = tiny_model(0)
    truth = generate(model, PROMPT, "ntp", params=params(30)).output
    i = first_new(truth, 4)
    eos = (truth[i],)
    want = generate(model, PROMPT, "ntp", params=params(30), eos_ids=eos)
    assert want.output == truth[:i] and want.finish_reason == "stop"
    seq = Sequence(list(PROMPT), Strategy.parse("tree:12"), params(30), FullTree(truth, len(PROMPT)), eos_ids=eos)
    decode_all(model, seq, len(PROMPT) + 30 + block_slack(13))
    assert seq.output == want.output and seq.finish_reason == "stop"
    assert seq.stats.forward_passes < i  # the EOS sat inside an accepted path


def test_stop_string_inside_an_accepted_tree_path_cuts_as_plain_decoding_does():
    model = tiny_model(0)
    truth = generate(model, PROMPT, "ntp", params=params(30)).output
    text = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731
    i = first_new(truth, 5)
    stop = f"<{truth[i - 1]}><{truth[i]}>"
    want = generate(model, PROMPT, "ntp", params=params(30, stop=[stop]), decode_text=text)
    assert want.finish_reason == "stop" and len(want.output) < 30
    seq = Sequence(
        list(PROMPT), Strategy.parse("tree:12"), params(30, stop=[stop]), FullTree(truth, len(PROMPT)), decode_text=text
    )
    decode_all(model, seq, len(PROMPT) + 30 + block_slack(13))
    assert (seq.output, seq.text, seq.finish_reason) == (want.output, want.text, want.finish_reason)


def test_sampled_trees_of_suffix_heads_and_merged_proposers_make_plain_samplings_draws():
    model = tiny_model(0)
    for seed in range(3):
        p = params(24, temperature=0.9, top_p=0.95, seed=seed)
        want = generate(model, PROMPT, "ntp", params=p).output
        store = Datastore.from_answers([want[2:], want[6:]])  # drafts that are often right
        heads = N.HeadsProposer(model, random_heads(model, seed=0), "float32")
        for prop in [
            SuffixProposer(store),
            heads,
            MergedProposer([heads, SuffixProposer(store), PromptLookupProposer()]),
        ]:
            for strategy in ("tree:6", "tree:31"):
                got = generate(model, PROMPT, strategy, params=p, proposer=prop)
                assert got.output == want, (seed, prop.name, strategy)


def test_cli_merged_tree_equals_ntp_token_for_token(tiny_dir, tiny_loaded, tmp_path, capsys):
    heads_dir = tmp_path / "heads"
    from mtp.core.runtime.artifacts import write_dir_atomic

    write_dir_atomic(heads_dir, N.heads_files(random_heads(tiny_loaded, seed=0), tiny_loaded))
    base = gen_args(tiny_dir, "--max-new-tokens", "24", "--json", "--heads", str(heads_dir))
    rc, out, err = mtp_main(capsys, base + ["--strategy", "ntp"])
    assert rc == 0, err
    want = json.loads(out)["token_ids"]
    build_datastore([want[1:], want[5:]], tiny_loaded, None, tmp_path / "ds")  # the model's own answer
    for strategy in ("tree:8", "tree:31", "verify:4"):
        for proposer in ("heads+suffix+lookup", "suffix", "suffix+lookup"):
            rc, out, err = mtp_main(
                capsys, base + ["--strategy", strategy, "--proposer", proposer, "--datastore", str(tmp_path / "ds")]
            )
            assert rc == 0, err
            got = json.loads(out)
            assert got["token_ids"] == want, (strategy, proposer)
    assert got["forward_passes"] < len(want)  # the datastore's drafts were accepted


# ---- mtp pipeline: a tree over stages gives plain greedy's output, token for token -----------------------


def test_mtp_pipeline_with_a_tree_equals_ntp(tiny_dir):
    """`mtp pipeline` runs trees (stage 0 compacts the accepted path; the moves reach every stage): from the
    command line, two stages and `tree:8` print exactly the tokens plain greedy prints in one process."""
    base = ["--model", str(tiny_dir), "--adapter", "none", "--max-new-tokens", "12", "--threads", "1", "--json"]
    want = subprocess.run(
        MTP + ["generate", "w1 w2 w3 w1 w2 w3", *base, "--strategy", "ntp"], capture_output=True, text=True, timeout=300
    )
    assert want.returncode == 0, want.stderr
    got = subprocess.run(
        MTP + ["pipeline", "w1 w2 w3 w1 w2 w3", "--stages", "2", *base, "--proposer", "lookup", "--strategy", "tree:8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr
    want_ids, got_ids = json.loads(want.stdout)["token_ids"], json.loads(got.stdout)["token_ids"]
    assert len(want_ids) == 12 and got_ids == want_ids
