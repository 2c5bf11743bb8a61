"""Every training command README.md shows runs as shown: the `mtp train`, `mtp train-heads` and
`mtp train-eagle3` lines of its shell blocks (with the `cp -r` and `mtp export` lines beside them, in
order), on a tiny 4-layer model and tiny data, with step counts and sizes cut down; each must exit 0
and write what its command promises."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mtp.cli import main
from test_data import prompts_file, write_jsonl
from test_hostile_training import make_word_model_dir
from test_train import examples

README = Path(__file__).resolve().parents[1] / "README.md"
TRAINERS = ("train", "train-heads", "train-eagle3")
# small values for the sizes the README gives (a flag missing from a command is left out)
SMALL = {"--batch-size": "2", "--limit": "4", "--threads": "1", "--save-every": "1", "--seq-len": "64",
         "--k-max": "4", "--spans": "2", "--draft-vocab": "16"}


def wanted(line: str) -> bool:
    """An `mtp` training or export command, or a `cp` beside them (other lines are not split)."""
    words = line.split()
    if not words or words[0] == "cp":
        return bool(words)
    return Path(words[0]).name == "mtp" and len(words) > 1 and words[1] in (*TRAINERS, "export")


def training_blocks() -> list[list[list[str]]]:
    """The commands (argv lists) this test runs, per ```bash or plain ``` block of the README that
    holds a training command: continuation lines joined, comments dropped, in order."""
    out = []
    for body in re.findall(r"^```(?:bash)?\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.M | re.S):
        lines = re.sub(r"\\\n", " ", body).splitlines()
        cmds = [shlex.split(line, comments=True) for line in lines if wanted(line)]
        if any(a[0] != "cp" and a[1] in TRAINERS for a in cmds):
            out.append(cmds)
    return out


BLOCKS = training_blocks()
STEPS = sorted({int(a[a.index("--steps") + 1]) for b in BLOCKS for a in b if "--steps" in a})
SMALL_STEPS = {n: str(2 + i) for i, n in enumerate(STEPS)}  # same order, so `--steps` + `--resume` continues


def shrink(argv: list[str], model: Path, out: Path) -> list[str]:
    """argv of `mtp COMMAND ...` for the tiny run: placeholders (`...`) dropped, `~/.cache/mtp` and
    $VARS expanded, sizes made small, the tiny --model, an --out where the README leaves it out."""
    args = [os.path.expandvars(a.replace("~/.cache/mtp", "$MTP_CACHE_DIR")) for a in argv[1:] if a != "..."]

    def put(flag, value):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args.extend([flag, value])

    if args[0] in TRAINERS:
        for flag, value in SMALL.items():
            if flag in args:
                put(flag, value)
        put("--steps", SMALL_STEPS.get(int(args[args.index("--steps") + 1]), "2") if "--steps" in args else "2")
        put("--model", str(model))
        if "--self-generate" in args:
            put("--max-new-tokens", "8")
        if "--out" not in args:
            put("--out", str(out))
    return args


def make_inputs(args: list[str]) -> None:
    """The data files a command reads, where they do not exist yet: tiny prompts or token ids."""
    for flag, write in (("--data", lambda p: prompts_file(p.parent, n=6).rename(p)),
                        ("--examples", lambda p: write_jsonl(p, [{"prompt_ids": e.prompt_ids,
                                                                  "response_ids": e.response_ids}
                                                                 for e in examples(6)]))):
        if flag in args and not Path(args[args.index(flag) + 1]).exists():
            path = Path(args[args.index(flag) + 1])
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path)


def check_outputs(args: list[str]) -> None:
    """What the command promises: the finished directory (and --export's float16 copy)."""
    out = Path(args[args.index("--out") + 1])
    names = {p.name for p in out.iterdir()}
    weights = {"train": "adapter.safetensors", "train-heads": "heads.safetensors",
               "train-eagle3": "model.safetensors", "export": "model.safetensors"}[args[0]]
    assert {"config.json", weights} <= names, (args, names)
    if args[0] == "train":
        state = json.loads((out / "trainer_state.json").read_text())
        assert state["step"] == int(args[args.index("--steps") + 1])
    if "--export" in args:
        export = Path(args[args.index("--export") + 1])
        assert {p.name for p in export.iterdir()} == {"config.json", "adapter.safetensors"}
        assert all(str(t.dtype) == "torch.float16" for t in load_file(str(export / weights)).values())


def test_the_readme_shows_every_trainer():
    shown = {a[1] for b in BLOCKS for a in b if Path(a[0]).name == "mtp"}
    assert set(TRAINERS) <= shown, shown


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_word_model_dir(tmp_path_factory.mktemp("readme") / "tiny4", n_layers=4, max_seq_len=1024)


@pytest.mark.parametrize("block", BLOCKS, ids=[" | ".join(" ".join(a[:2]) for a in b) for b in BLOCKS])
def test_readme_training_block_runs(block, model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the README's relative paths (runs/..., my-heads) land here
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MTP_DATA_DIR", str(tmp_path / "data"))
    for i, argv in enumerate(block):
        if argv[0] == "cp":
            shutil.copytree(argv[-2], argv[-1])
            continue
        args = shrink(argv, model, tmp_path / f"out{i}")
        make_inputs(args)
        code = main(args)
        err = capsys.readouterr().err
        assert code == 0, (args, err[-2000:])
        check_outputs(args)
