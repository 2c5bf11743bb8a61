"""Every command line the documentation shows runs as shown: each `mtp` line of the shell blocks of
README.md and of every page under docs/ (with the `cp -r` lines beside them, in order, in one folder
per block) and the ones they give inline (`mtp datastore build`), on a tiny 4-layer model and tiny
inputs; each must exit 0 and write or print what its command promises.

What is changed, and why:
- the commands run in a temporary folder, so the docs' relative paths (`data/smollm2-135m/mix-v1`,
  `runs/...`) land there, never in the repository; `$MTP_DATA_DIR` points at tiny GSM8K and self-instruct
  files written there (no shared data set is read), `~/.cache/mtp` at a temporary cache;
- sizes are cut down (SMALL, SMALL_STEPS, `--max-new-tokens`, `--limit`, `--stages`, tune's probes) and
  the tiny model is given as `--model`; a `DIR` placeholder becomes a folder, a trailing `...` is dropped;
- the tiny model "ships" what the docs' lines take from the default model (`--adapter auto`, `--heads
  auto`, the suffix datastore); `mtp pipeline`'s stages, fresh processes, are given its adapter as `--adapter`;
- `mtp bench`'s `llamacpp-server*` and `vllm*` baselines are left out, and `mtp export --format llamacpp`
  lines are not run: they need `make llamacpp` / `make vllm` and a GGUF model
  (tests/test_llamacpp_server.py and tests/test_vllm.py run them);
- `mtp serve` lines are not served: the command runs up to its model load (every flag and file it names,
  e.g. tune's deploy.json, checked by the command's own pre-load checks) and stops there.
Lines of other programs (`make`, `curl`, `torchrun`, `python benchmarks/...`) are not run."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
from helpers import data_sources, make_tiny_model_dir, prompts_file, train_args, write_examples, write_jsonl
from safetensors.torch import load_file

from mtp.cli import build_parser, main
from mtp.core import engine as engine_module
from mtp.training import shards

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]  # every page whose commands run here
# the pages the README's user manual hands each command and topic to
PAGES = (
    "generate-and-strategies",
    "training",
    "data",
    "bench",
    "serve",
    "tune-and-rollout",
    "pipeline",
    "export",
    "design",
)
TRAINERS = ("train", "train-heads", "train-eagle3")
INLINE = ("datastore",)  # commands the docs give only inline (`mtp datastore build ...`), run too
# small values for the sizes the docs give (a flag missing from a command is left out)
SMALL = {
    "--batch-size": "2",
    "--limit": "4",
    "--threads": "1",
    "--save-every": "1",
    "--seq-len": "64",
    "--k-max": "4",
    "--spans": "2",
    "--draft-vocab": "16",
    "--self-written": "3",
    "--stages": "2",
}
# and flags added to the commands that have them (short answers, few tuning probes and repeats)
ADDED = {
    "--max-new-tokens": "6",
    "--probe": "2",
    "--measure": "2",
    "--calibrate": "2",
    "--measure-rows": "1",
    "--profile-repeats": "1",
    "--profile-cache-len": "32",
    "--repeats": "1",
}
EXTERNAL_BASELINES = ("llamacpp", "vllm")  # peers that need their own build (see the docstring)


def is_mtp(words: list[str]) -> bool:
    return len(words) > 1 and Path(words[0]).name == "mtp"


def runs_here(argv: list[str]) -> bool:
    """False for a line that needs a build this test does not make (see the docstring)."""
    return not (is_mtp(argv) and argv[1] == "export" and "llamacpp" in argv)


def shown_blocks(page: Path) -> list[list[list[str]]]:
    """The commands (argv lists) this test runs from one page: per ```bash or plain ``` block that holds
    an `mtp` line, its `mtp` and `cp` lines (continuation lines joined, comments dropped), in order;
    then one block per inline `mtp datastore ... --flag ...` command line."""
    text = page.read_text(encoding="utf-8")
    out = []
    for body in re.findall(r"^```(?:bash)?\n(.*?)^```", text, flags=re.M | re.S):
        lines = [
            line
            for line in re.sub(r"\\\n", " ", body).splitlines()  # (other lines are not split)
            if is_mtp(line.split()) or line.startswith("cp ")
        ]
        cmds = [a for a in (shlex.split(line, comments=True) for line in lines) if runs_here(a)]
        if any(is_mtp(a) for a in cmds):
            out.append(cmds)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S).replace("\n", " ")
    for span in re.findall(r"`((?:\.venv/bin/)?mtp [^`]*)`", prose):
        if shlex.split(span)[1] in INLINE and " --" in span:  # a whole command line, not its name
            out.append([shlex.split(span)])
    return out


SHOWN = [(page.relative_to(REPO).as_posix(), block) for page in DOCS for block in shown_blocks(page)]
BLOCKS = [block for _, block in SHOWN]
STEPS = sorted({int(a[a.index("--steps") + 1]) for b in BLOCKS for a in b if "--steps" in a})
SMALL_STEPS = {n: str(2 + i) for i, n in enumerate(STEPS)}  # same order, so `--steps` + `--resume` continues
PARSERS = build_parser()._subparsers._group_actions[0].choices  # command -> its parser


def takes(command: str, flag: str) -> bool:
    return flag in PARSERS[command]._option_string_actions


def shrink(argv: list[str], model: Path, out: Path, shipped: Path) -> list[str]:
    """argv of `mtp COMMAND ...` for the tiny run (see the module docstring)."""
    args = [os.path.expandvars(a.replace("~/.cache/mtp", "$MTP_CACHE_DIR")) for a in argv[1:]]
    if args[-1] == "...":  # "and the rest as you like"; a "..." prompt stays a prompt
        args.pop()
    args = [str(out) if a in ("DIR", "D") else a for a in args]
    command = args[0]

    def put(flag, value):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args.extend([flag, value])

    for flag, value in SMALL.items():
        if flag in args:
            put(flag, value)
    bare = "--card" in args or "--predict" in args  # no model, nothing decoded: run exactly as shown
    for flag, value in ADDED.items():
        if takes(command, flag) and not bare and "--toy" not in args:
            put(flag, value)
    if "--baselines" in args:
        peers = args[args.index("--baselines") + 1].split(",")
        put("--baselines", ",".join(p for p in peers if not p.startswith(EXTERNAL_BASELINES)))
    if command in TRAINERS:
        put("--steps", SMALL_STEPS.get(int(args[args.index("--steps") + 1]), "2") if "--steps" in args else "2")
        if "--out" not in args:
            put("--out", str(out))
    if takes(command, "--model") and not bare:
        put("--model", str(model))
        if command == "pipeline" and "--adapter" not in args:  # its stages are fresh processes: no SHIPPED patch
            put("--adapter", str(shipped / "adapter"))
    return args


def make_inputs(args: list[str]) -> None:
    """The data files a command reads, where no earlier line of its block wrote them: tiny prompts (GSM8K
    style, or `prompt` lines for a `prompts:` file), or token ids (`--examples`, and the datastore's
    `--data`)."""

    def token_ids(p):
        write_examples(p, 6)

    def prompts(p):
        rows = [json.loads(line) for line in prompts_file(p.parent, n=6).read_text().splitlines()]
        write_jsonl(p, [{"prompt": r["question"], "category": f"c{i % 2}"} for i, r in enumerate(rows)])

    for flag, write in (("--data", lambda p: prompts_file(p.parent, n=6).rename(p)), ("--examples", token_ids)):
        if flag in args:
            value = args[args.index(flag) + 1]
            path = Path(value.split(":", 1)[-1])
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                if args[0] == "datastore":
                    write = token_ids
                elif value.startswith("prompts:"):
                    write = prompts
                write(path)


def check_outputs(args: list[str], stdout: str) -> None:
    """What the command promises: the finished directory, the printed answer or report."""
    command = args[0]
    out = Path(args[args.index("--out") + 1]) if "--out" in args else None
    if command in (*TRAINERS, "export"):
        names = {p.name for p in out.iterdir()}
        weights = {
            "train": "adapter.safetensors",
            "train-heads": "heads.safetensors",
            "train-eagle3": "model.safetensors",
            "export": "model.safetensors",
        }[command]
        assert {"config.json", weights} <= names, (args, names)
        if command == "train":
            state = json.loads((out / "trainer_state.json").read_text())
            assert state["step"] == int(args[args.index("--steps") + 1])
        if "--export" in args:
            export = Path(args[args.index("--export") + 1])
            assert {p.name for p in export.iterdir()} == {"config.json", "adapter.safetensors"}
            assert all(str(t.dtype) == "torch.float16" for t in load_file(str(export / weights)).values())
    elif command == "data":
        card = json.loads(stdout) if "--card" in args else json.loads((out / "card.json").read_text())
        assert card["answers"] == len(shards.read(out)[0]) > 0, card
        assert (out / "card.md").is_file() and (out / "heldout").is_dir()
    elif command == "generate":
        assert stdout.strip(), args
        if "--json" in args:
            assert json.loads(stdout)["text"] is not None
    elif command == "bench":
        out = Path(args[args.index("--out") + 1] if "--out" in args else "bench-out")
        assert {"results.jsonl", "report.html"} <= {p.name for p in out.iterdir()}, args
    elif command == "tune":
        assert stdout.strip() if "--toy" in args else (out / "deploy.json").is_file(), args
    elif command == "pipeline":
        assert stdout.strip(), args
        if "--json" in args:
            assert json.loads(stdout.strip().splitlines()[-1])
    elif command == "datastore":
        assert out.is_dir() and any(out.iterdir()), args


def fake_data_dir(root: Path) -> None:
    """$MTP_DATA_DIR as the docs' lines read it: gsm8k/{train,test}.jsonl and self_instruct/, tiny."""
    root.mkdir(parents=True)
    gsm, tasks = data_sources(root)
    (root / "gsm8k").mkdir()
    (root / "self_instruct").mkdir()
    gsm.rename(root / "gsm8k" / "train.jsonl")
    shutil.copy(root / "gsm8k" / "train.jsonl", root / "gsm8k" / "test.jsonl")
    tasks.rename(root / "self_instruct" / "seed_tasks.jsonl")


class StopBeforeLoad(Exception):
    """`mtp serve` got as far as its model load: every check before it passed."""


def test_the_readme_shows_every_command():
    shown = {a[1] for b in BLOCKS for a in b if is_mtp(a)}
    assert {*TRAINERS, "data", "generate", "bench", "tune", "pipeline", "serve", "export", "datastore"} <= shown


def test_the_readme_is_a_short_manual_that_hands_each_topic_to_its_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)
    for page in PAGES:
        assert (REPO / "docs" / f"{page}.md").is_file(), page
        assert f"(docs/{page}.md" in "\n".join(lines), page


def test_the_docs_link_only_to_files_that_exist():
    """Every relative link of the README, docs/, CONTRIBUTING.md and benchmarks/RESULTS.md names a file or
    folder of the repository (results the docs cite must not be removed from under them)."""
    pages = [*DOCS, REPO / "CONTRIBUTING.md", REPO / "benchmarks" / "RESULTS.md"]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            assert path.exists() and REPO in (path, *path.parents), (page.name, target)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("readme") / "tiny4", n_layers=4, max_seq_len=1024)


@pytest.fixture(scope="module")
def shipped(model, tmp_path_factory):
    """What the tiny model ships, as the default model does (`Engine` resolves `auto` from it): an MTP
    adapter (its mask token), heads and a suffix datastore."""
    root = tmp_path_factory.mktemp("shipped")
    ids = write_examples(root / "examples.jsonl", 6)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MTP_CACHE_DIR", str(root / "cache"))
        assert main(train_args(model, "--examples", ids, "--out", root / "run", "--export", root / "adapter")) == 0
        heads = train_args(
            model, "--examples", ids, "--draft-vocab", "16", "--out", root / "heads", trainer="train-heads"
        )
        assert main(heads) == 0
        assert (
            main(["datastore", "build", "--data", str(ids), "--model", str(model), "--out", str(root / "datastore")])
            == 0
        )
    return root


@pytest.mark.parametrize(
    "block", BLOCKS, ids=[f"{page}: " + " | ".join(f"{Path(a[0]).name} {a[1]}" for a in b) for page, b in SHOWN]
)
def test_readme_block_runs(block, model, shipped, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # the docs' relative paths (data/..., runs/..., my-heads) land here
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MTP_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setitem(engine_module.SHIPPED, str(model), shipped)
    fake_data_dir(tmp_path / "data")

    def stop(*a, **k):
        raise StopBeforeLoad

    for i, argv in enumerate(block):
        if argv[0] == "cp":
            shutil.copytree(argv[-2], argv[-1])
            continue
        args = shrink(argv, model, tmp_path / f"out{i}", shipped)
        for a in args:  # nothing in the repository (its data set: a background job may be writing it)
            assert REPO not in Path(a.split(":", 1)[-1]).resolve().parents, args
        make_inputs(args)
        if args[0] == "serve":
            with monkeypatch.context() as m:
                m.setattr(engine_module.Engine, "load", stop)
                with pytest.raises(StopBeforeLoad):
                    main(args)
            continue
        code = main(args)
        stdout, err = capfd.readouterr()
        assert code == 0, (args, err[-2000:])
        check_outputs(args, stdout)


def test_the_limits_table_states_the_strategy_limits_the_parser_enforces():
    """The limits table's row for strategies (README.md or a page under docs/) names K's and tree N's
    largest values, each accepted by `Strategy.parse` and the next one refused (the row once said 32 for
    both; `tree:32` is refused)."""
    from mtp.core.decoding.strategy import Strategy, StrategyError

    row = next(
        line for page in DOCS for line in page.read_text().splitlines() if line.strip().startswith("| K of a strategy")
    )
    k_max, n_max = (int(x) for x in re.search(r"\|\s*(\d+) / (\d+) \(every front end\)", row).groups())
    assert "N of `tree:N`" in row
    for text, largest in (
        (f"verify:{k_max}", True),
        (f"static:{k_max}", True),
        (f"conf_adapt:0.9:{k_max}", True),
        (f"tree:{n_max}", True),
        (f"verify:{k_max + 1}", False),
        (f"tree:{n_max + 1}", False),
    ):
        if largest:
            Strategy.parse(text)
        else:
            with pytest.raises(StrategyError):
                Strategy.parse(text)
