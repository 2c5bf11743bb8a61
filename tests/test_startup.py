"""What a start of `mtp` does not do: import the modules of other commands, or transformers' model
registry for a tokenizer whose class the directory names (each ~0.3-1 s of every `mtp generate`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mtp.cli import COMMANDS, build_parser, command_of


def test_a_command_builds_its_own_parser_only():
    probe = (
        "import sys\n"
        "from mtp.cli import build_parser, command_of\n"
        "argv = ['generate', 'hi', '--max-new-tokens', '3']\n"
        "args = build_parser(command_of(argv)).parse_args(argv)\n"
        "assert args.command == 'generate' and args.max_new_tokens == 3, args\n"
        "print(sorted(m for m in sys.modules if m.startswith(('mtp.cli.', 'mtp.eval', 'mtp.serving', 'mtp.tune'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)  # a list literal of module names
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
