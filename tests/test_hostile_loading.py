"""What a hostile user's model files and flags did (a probe of `mtp generate` and friends), each
reproduced, and the fix checked: a one-line error naming the file and field (exit 2), never a
traceback, a runaway allocation or a crash; concurrent conversions that share one cache."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import one_line_error, run_cli, write_tiny_gguf

from mtp.core.decoding.strategy import Strategy, StrategyError, expand_sweep
from mtp.core.runtime import loading


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def with_config(word_model, tmp_path, **changes) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(word_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **changes}))
    return bad


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


# ---- H1 / T3: config.json sizes bounded by the weights, every value type-checked ------------------------
@pytest.mark.parametrize(
    "changes, words",
    [
        ({"num_hidden_layers": 1_000_000_000}, ["'num_hidden_layers'", "2 layers"]),  # grew memory until killed
        ({"hidden_size": 577}, ["'hidden_size'", "embed_tokens.weight"]),
        ({"hidden_size": 1_000_000_000}, ["'hidden_size'"]),
        ({"hidden_size": 1e9}, ["'hidden_size'", "positive integer"]),
        ({"vocab_size": 10}, ["'vocab_size'", "embed_tokens.weight"]),
        ({"vocab_size": 10_000_000}, ["'vocab_size'"]),
        ({"intermediate_size": 1_000_000_000}, ["'intermediate_size'"]),
        ({"head_dim": 63}, ["'head_dim'", "even"]),
        ({"head_dim": 32}, ["'head_dim'", "q_proj"]),
        ({"max_position_embeddings": 10**12}, ["'max_position_embeddings'", "at most"]),
        ({"max_position_embeddings": 1e12}, ["'max_position_embeddings'"]),
        ({"eos_token_id": "x"}, ["'eos_token_id'"]),
        ({"eos_token_id": [1, 500]}, ["'eos_token_id'", "below vocab_size 97"]),
        ({"tie_word_embeddings": "yes"}, ["'tie_word_embeddings'", "true or false"]),
        ({"rms_norm_eps": float("inf")}, ["'rms_norm_eps'"]),
        ({"rope_scaling": "x"}, ["'rope_scaling'", "an object"]),
        ({"rope_scaling": {"rope_type": "linear", "factor": "big"}}, ["'rope_scaling'", "'factor'"]),
        ({"architectures": [{}], "model_type": "llama"}, []),  # unhashable entry: read past, not a crash
    ],
)
def test_t3_h1_config_values(word_model, tmp_path, capsys, changes, words):
    bad = with_config(word_model, tmp_path, **changes)
    code, out, err = run_cli(
        ["generate", "w1", "--model", str(bad), "--adapter", "none", "--max-new-tokens", "1"], capsys
    )
    if not words:  # a config that is fine once read carefully
        assert code == 0, err
        return
    one_line_error(code, err, str(bad / "config.json"), *words)


def test_h1_pipeline_refuses_a_config_bigger_than_its_weights_before_any_stage(word_model, tmp_path, capsys):
    bad = with_config(word_model, tmp_path, num_hidden_layers=1_000_000_000)
    code, _, err = run_cli(["pipeline", "--stages", "2", "w1", "--model", str(bad), "--adapter", "none"], capsys)
    one_line_error(code, err, "'num_hidden_layers'")
    assert loading.model_layers(str(word_model)) == 2


def test_h1_sizes_are_checked_against_the_headers_before_allocating(word_model, tmp_path, monkeypatch):
    """No weight is read and no model is built before the config matches the file headers."""
    bad = with_config(word_model, tmp_path, vocab_size=10_000_000)
    monkeypatch.setattr(loading, "load_safetensors", lambda *a, **k: pytest.fail("weights read"))
    monkeypatch.setattr(loading, "Transformer", lambda *a, **k: pytest.fail("model built"))
    with pytest.raises(loading.ModelLoadError, match="'vocab_size' is 10000000"):
        loading.load_hf_dir(bad)


# ---- H2: two conversions of one GGUF on a fresh cache --------------------------------------------------
def test_h2_concurrent_conversions_share_one_result(tiny_gguf, fresh_cache, monkeypatch):
    """Two converters start on a fresh cache; the first to save pauses until the other is inside too
    (at the lock, or, without one, saving beside it). Both get the one converted directory."""
    arrived, saves, cond = set(), [], threading.Condition()

    def note():
        with cond:
            arrived.add(threading.get_ident())
            cond.notify_all()

    real_flock, real_save = fcntl.flock, loading.save_file

    def flock(f, op):
        if op & fcntl.LOCK_EX:
            note()
        return real_flock(f, op)

    def save_file(state, path):
        note()
        saves.append(path)
        if len(saves) == 1:
            with cond:
                assert cond.wait_for(lambda: len(arrived) == 2, timeout=60)  # a guard against a hang only
        return real_save(state, path)

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(loading, "save_file", save_file)
    results, errors = [], []

    def convert():
        try:
            results.append(loading.gguf_to_hf_dir(tiny_gguf))
        except Exception as e:  # noqa: BLE001 - collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 2 and results[0] == results[1]
    assert len(saves) == 1  # converted once: the second found the first one's result
    assert loading.load(str(tiny_gguf)).model.config.n_layers == 2


# ---- T4: corrupt, truncated and huge GGUF files ----------------------------------------------------------
def gguf_error(path, capsys, *words):
    code, _, err = run_cli(["generate", "!", "--model", str(path), "--adapter", "none"], capsys)
    one_line_error(code, err, str(path), *words)


@pytest.mark.parametrize("count", [1, 2**40])
def test_t4_corrupt_tensor_count(tiny_gguf, tmp_path, capsys, count):
    data = bytearray(tiny_gguf.read_bytes())
    n = int.from_bytes(data[8:16], "little")
    data[8:16] = (n + count).to_bytes(8, "little")  # was an IndexError from the gguf reader
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    gguf_error(bad, capsys, "not a readable GGUF file")


@pytest.mark.parametrize("keep", [3, 20, 200, 3000, 300_000])  # magic, counts, metadata, tensor table, data
def test_t4_truncated_gguf_names_the_file(tiny_gguf, tmp_path, capsys, keep):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:keep])
    gguf_error(bad, capsys, "not a readable GGUF file")


def test_t4_huge_sparse_file_is_refused_before_hashing(tmp_path, capsys, monkeypatch):
    big = tmp_path / "huge.gguf"
    with open(big, "wb") as f:
        f.truncate(5 << 30)  # 5 GB of zeros, no disk used
    hashed = []
    monkeypatch.setattr(loading, "file_digest", lambda p: hashed.append(p) or "0" * 16)
    gguf_error(big, capsys, "no GGUF magic")
    assert hashed == []


def test_t4_gguf_header_with_data_past_the_end_is_refused_before_hashing(tiny_gguf, tmp_path, monkeypatch):
    bad = tmp_path / "short.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:-4])
    monkeypatch.setattr(loading, "file_digest", lambda p: pytest.fail("hashed before the check"))
    with pytest.raises(loading.ModelLoadError, match="past the end"):
        loading.gguf_to_hf_dir(bad)


@pytest.mark.parametrize(
    "meta, words",
    [
        ({"block_count": 1_000_000_000}, ["'num_hidden_layers'", "2 layers"]),
        ({"attention__head_count": 0}, ["'llama.attention.head_count'", "positive integer"]),
        ({"embedding_length": 65}, ["'hidden_size'"]),
        ({"context_length": 2**31}, ["'max_position_embeddings'"]),
    ],
)
def test_t4_gguf_metadata_checked_against_its_tensors(tmp_path, capsys, meta, words):
    bad = write_tiny_gguf(tmp_path / "meta.gguf", **meta)
    gguf_error(bad, capsys, *words)
    assert not any((tmp_path / "cache").glob("*-hf"))  # nothing cached from a bad file


# ---- T8: chat templates -----------------------------------------------------------------------------------
def with_template(word_model, tmp_path, template: str) -> Path:
    d = tmp_path / "chat"
    shutil.copytree(word_model, d)
    (d / "chat_template.jinja").write_text(template)
    return d


OK_TURN = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # a template that works


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m['content'] }",  # syntax
        "{{ messages[0].content | no_such_filter }}",
        "{{ raise_exception('this model has no chat format') }}",
        "{{ 1 + 'a' }}",
    ],
)
def test_t8_broken_chat_template(word_model, tmp_path, capsys, template):
    d = with_template(word_model, tmp_path, template)
    code, _, err = run_cli(["generate", "w1", "--model", str(d), "--adapter", "none"], capsys)
    one_line_error(code, err, str(d / "chat_template.jinja"), "broken chat template")


def test_t8_the_sandbox_stays(word_model, tmp_path, capsys):
    marker = tmp_path / "escaped"
    d = with_template(word_model, tmp_path, "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}")
    code, _, err = run_cli(["generate", "w1", "--model", str(d), "--adapter", "none"], capsys)
    one_line_error(code, err, "chat_template.jinja")
    assert not marker.exists()


def test_t8_template_failing_on_one_prompt_only(word_model, tmp_path, capsys):
    d = with_template(
        word_model,
        tmp_path,
        "{% if 'w9' in messages[0]['content'] %}{{ raise_exception('no w9') }}{% endif %}" + OK_TURN,
    )
    args = ["--model", str(d), "--adapter", "none", "--max-new-tokens", "2"]
    code, _, err = run_cli(["generate", "w1", *args], capsys)
    assert code == 0, err
    code, _, err = run_cli(["generate", "w9", *args], capsys)
    one_line_error(code, err, "chat_template.jinja", "no w9")


# ---- flags: --threads, strategies in non-ASCII digits, --stop that is not UTF-8 ------------------------
def test_threads_are_capped(capsys):
    code, _, err = run_cli(["generate", "hi", "--model", "/nowhere", "--threads", "100000"], capsys)
    one_line_error(code, err, "--threads is at most")  # was a segfault (exit 139)
    from mtp.core.runtime.checks import THREADS_PER_CPU, check_threads

    assert check_threads(THREADS_PER_CPU * (os.cpu_count() or 1)) == THREADS_PER_CPU * (os.cpu_count() or 1)


@pytest.mark.parametrize(
    "text",
    ["verify:４", "static:４", "verify:1_0", "verify: 4", "conf_adapt:０.９", "conf_adapt:0.9:１６", "conf_adapt:nan"],
)
def test_strategy_numbers_are_ascii(text):
    with pytest.raises(StrategyError):
        Strategy.parse(text)


def test_strategy_sweeps_are_ascii(capsys):
    for text in ("static:１..４", "static:1,２"):
        with pytest.raises(StrategyError):
            expand_sweep(text)
    assert [str(s) for s in expand_sweep("static:1..2,4")] == ["static:1", "static:2", "static:4"]
    assert str(Strategy.parse("conf_adapt:.9:4")) == "conf_adapt:0.9:4"
    code, _, err = run_cli(["generate", "hi", "--model", "/nowhere", "--strategy", "verify:４"], capsys)
    one_line_error(code, err, "malformed strategy")


def test_stop_that_is_not_utf8_is_refused(capsys):
    stop = os.fsdecode(b"\xff")  # what an undecodable argv byte becomes
    code, _, err = run_cli(["generate", "hi", "--model", "/nowhere", "--stop", stop], capsys)
    one_line_error(code, err, "--stop", "not valid UTF-8")


# ---- the pipeline's entry point loads only the engine and the pipeline ------------------------------------
def test_pipeline_entry_point_loads_no_server_trainer_or_evaluation():
    """A stage on another machine needs the engine, the pipeline and its own options: importing its
    entry point's program loads no server (FastAPI, uvicorn), trainer, evaluation or other engine."""
    code = (
        "import sys, mtp.cli.pipeline\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('mtp', 'fastapi', 'uvicorn'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = r.stdout.split()
    assert "mtp.cli.pipeline" in loaded and "mtp.pipeline.stages" in loaded
    banned = ("fastapi", "uvicorn", "mtp.serving", "mtp.training", "mtp.eval", "mtp.tune", "mtp.interop")
    assert [m for m in loaded if m.startswith(banned)] == []
    assert [m for m in loaded if m.startswith("mtp.cli.")] == ["mtp.cli.errors", "mtp.cli.options", "mtp.cli.pipeline"]


def test_pipeline_entry_point_runs_a_stage(word_model, tmp_path, capsys):
    """`python -m mtp.pipeline` as torchrun starts it (one stage here): the tokens of `mtp generate`."""
    args = ["w1 w2 w3", "--model", str(word_model), "--adapter", "none", "--max-new-tokens", "3", "--json"]
    code, out, err = run_cli(["generate", *args], capsys)
    assert code == 0, err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MTP_CACHE_DIR": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    r = subprocess.run(
        [sys.executable, "-m", "mtp.pipeline", *args, "--threads", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["stages"] == 1 and got["token_ids"] == json.loads(out)["token_ids"]


def test_pipeline_entry_point_outside_torchrun(capsys, monkeypatch):
    from mtp.cli.pipeline import stage_main

    monkeypatch.delenv("RANK", raising=False)
    assert stage_main(["hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run under torchrun" in err


def test_serve_reads_its_cost_model_and_demo_checks_threads_before_loading(tmp_path, capsys, monkeypatch):
    from mtp.cli import demo, main
    from mtp.core import engine

    monkeypatch.setattr(engine.Engine, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    bad = tmp_path / "cost.json"
    bad.write_text("{not json")
    assert main(["serve", "--cost-model", str(bad)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises((ValueError, SystemExit)):
        demo.main(["--threads", "100000"])


# ---- U2 (round 3): a corrupt cached conversion is converted again, never a dead end ------------------
@pytest.mark.parametrize("damage", ["truncate weights", "empty config", "broken tokenizer"])
def test_u2_a_corrupt_cached_conversion_is_rebuilt(tiny_gguf, capsys, damage):
    converted = loading.gguf_to_hf_dir(tiny_gguf)
    want = loading.load(str(tiny_gguf)).model.state_dict()
    if damage == "truncate weights":
        os.truncate(converted / "model.safetensors", (converted / "model.safetensors").stat().st_size // 2)
    elif damage == "empty config":
        (converted / "config.json").write_text("")
    else:
        (converted / "tokenizer.json").write_text("{not json")
    got = loading.load(str(tiny_gguf))  # every later command loads again, without a hand-deleted cache
    assert got.source == str(converted)
    assert all(torch.equal(v, want[k]) for k, v in got.model.state_dict().items())
    assert loading._converted(converted)
    if damage == "broken tokenizer":  # only a load can tell: it says so and converts again
        assert "converting tiny.gguf again" in capsys.readouterr().err
