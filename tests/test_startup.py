"""What a start of `mtp` does not do: import the modules of other commands, or transformers' model
registry for a tokenizer whose class the directory names (each ~0.3-1 s of every `mtp generate`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mtp.cli import COMMANDS, build_parser, command_of


def test_a_command_builds_its_own_parser_only():
    probe = (
        "import json, sys\n"
        "from mtp.cli import build_parser, command_of\n"
        "argv = ['generate', 'hi', '--max-new-tokens', '3']\n"
        "args = build_parser(command_of(argv)).parse_args(argv)\n"
        "assert args.command == 'generate' and args.max_new_tokens == 3, args\n"
        "ours = ('mtp.cli.', 'mtp.eval', 'mtp.serving', 'mtp.tune')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(ours))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    assert "mtp.cli.generate" in loaded
    assert not [m for m in loaded if m.startswith(("mtp.eval", "mtp.serving", "mtp.tune", "mtp.cli.bench"))]


def test_command_of_and_the_full_parser():
    assert command_of(["train-heads", "--help"]) == "train-heads"
    assert command_of(["--help"]) is None and command_of([]) is None and command_of(["bogus"]) is None
    full = build_parser()._subparsers._group_actions[0].choices
    assert list(full) == list(COMMANDS)
    with pytest.raises(SystemExit):
        build_parser(command_of(["bogus"])).parse_args(["bogus"])


def test_tokenizer_class_skips_auto_only_where_the_directory_names_the_fast_class(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from mtp.core.runtime.loading import tokenizer_class

    (tmp_path / "tokenizer.json").write_text("{}")
    for named, want in (
        ("TokenizersBackend", PreTrainedTokenizerFast),
        ("PreTrainedTokenizerFast", PreTrainedTokenizerFast),
        ("LlamaTokenizer", AutoTokenizer),
    ):
        (tmp_path / "tokenizer_config.json").write_text(f'{{"tokenizer_class": "{named}"}}')
        assert tokenizer_class(tmp_path) is want, named
    (tmp_path / "tokenizer_config.json").write_text("not json")
    assert tokenizer_class(tmp_path) is AutoTokenizer


def test_a_measured_t_q_is_kept_per_key_and_a_bad_file_is_measured_again(tmp_path, capsys):
    from mtp.core.policy.costmodel import CostModel, cached

    made = []

    def make(t1=0.005):
        made.append(t1)
        return CostModel({1: t1, 8: 2 * t1})

    key = {"cpu": {"name": "AMD EPYC", "family": "25", "model": "17"}, "threads": 2, "weights": "native-int8"}
    first = cached(key, make, tmp_path)
    again = cached(dict(reversed(list(key.items()))), lambda: make(1.0), tmp_path)  # the same key, other order
    assert made == [0.005] and again.points == first.points == {1: 0.005, 8: 0.010}
    assert capsys.readouterr().err == ""
    other = cached({**key, "threads": 1}, lambda: make(0.007), tmp_path)  # another key: its own file
    assert made == [0.005, 0.007] and other.points[1] == 0.007 and len(list(tmp_path.iterdir())) == 2
    assert cached(key, lambda: make(0.006), tmp_path, refresh=True).points[1] == 0.006  # asked: measured
    path = next(p for p in tmp_path.iterdir() if '"threads": 2' in p.read_text())
    for damage in ("truncate", "another key", "not json"):
        text = path.read_text()
        if damage == "truncate":
            path.write_text(text[: len(text) // 2])
        elif damage == "another key":
            path.write_text(text.replace('"threads": 2', '"threads": 3'))
        else:
            path.write_text("[1, 2]")
        got = cached(key, lambda: make(0.004), tmp_path)
        err = capsys.readouterr().err
        assert got.points[1] == 0.004 and err.count("\n") == 1 and "does not read" in err and str(path) in err
        assert cached(key, lambda: make(9.0), tmp_path).points[1] == 0.004  # rewritten whole: read back


def test_tree_auto_measures_t_q_once_per_machine_and_model(tmp_path, monkeypatch, tiny_hf_dir):
    from mtp.core import engine as engine_module
    from mtp.core.engine import Engine, EngineConfig
    from mtp.core.runtime import kernels

    kernels.load(quiet=True)  # built (or found) in the session's cache, before the cache moves
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = engine_module.measure
    monkeypatch.setattr(engine_module, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    for _ in range(2):  # two processes' worth of engines
        e = Engine.load(EngineConfig(model=str(tiny_hf_dir), adapter="none", proposer="lookup"))
        assert e.pass_time()(4) > 0
    assert calls == [1]
    torch_threads = __import__("torch").get_num_threads()
    assert e.timing_key()["threads"] == torch_threads and e.timing_key()["weights"] == e.weights_line
