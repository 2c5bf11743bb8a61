"""Training and artifact defects a hostile user found (numbered as in the probe's report): each test
reproduces one and checks the fix: a one-line error (exit 2 on the CLI) before any work, nothing lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    distill_cfg,
    make_tiny_model_dir,
    one_line_error,
    random_drafter,
    random_examples,
    run_cli,
    save_drafter,
    saved_heads,
    tiny_model,
    write_examples,
)
from safetensors.torch import load_file, save_file

from mtp.core.decoding.proposers import heads as N
from mtp.core.decoding.proposers.eagle3 import WEIGHTS as DRAFTER_WEIGHTS
from mtp.core.decoding.proposers.eagle3 import default_aux_layers, load_drafter
from mtp.core.runtime.adapter import add_adapters, load_adapter, save_adapter
from mtp.core.runtime.artifacts import MARKER, ArtifactError
from mtp.interop.vllm_export import export_vllm_eagle3
from mtp.training.distill import train
from mtp.training.trainer import DivergedError

TINY_ARGS = ["--steps", "2", "--batch-size", "2", "--threads", "1"]
TRAIN_ARGS = TINY_ARGS + ["--k-max", "3", "--spans", "1", "--seq-len", "32"]


@pytest.fixture(scope="module")
def word_model_4(tmp_path_factory):
    """A 4-layer tiny model (vLLM's default EAGLE-3 layers 2, 4 // 2, 4 - 3 collide on it)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("word4") / "tiny4", n_layers=4)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def examples_file(tmp_path, name="examples.jsonl"):
    return write_examples(tmp_path / name, 6)


def poison(model, value):
    """A hook for `train(on_step=...)`: puts `value` into one LoRA element after step 3."""

    def on_step(step):
        if step == 3:
            with torch.no_grad():
                model.layers[0].self_attn.q_proj.lora_b[0, 0] = value

    return on_step


# ---- D2. --export must not be --out, inside it, or around it ------------------------------------
@pytest.mark.parametrize("out, export", [("r", "r"), ("r", "r/export"), ("r/run", "r")])
def test_d2_export_overlapping_out_is_refused_before_training(word_model, tmp_path, capsys, out, export):
    code, _, err = run_cli(
        [
            "train",
            "--model",
            word_model,
            "--examples",
            examples_file(tmp_path),
            *TRAIN_ARGS,
            "--out",
            tmp_path / out,
            "--export",
            tmp_path / export,
        ],
        capsys,
    )
    one_line_error(code, err, "apart from --out")
    assert not (tmp_path / "r").exists()


def test_d2_export_over_a_run_keeps_its_checkpoint(word_model, tmp_path, capsys):
    run = tmp_path / "r"
    args = ["train", "--model", word_model, "--examples", examples_file(tmp_path), *TRAIN_ARGS, "--out", run]
    assert run_cli(args, capsys)[0] == 0
    code, _, err = run_cli(args[:-2] + ["--steps", "3", "--out", run, "--export", run, "--resume"], capsys)
    one_line_error(code, err, "apart from --out")
    assert json.loads((run / "trainer_state.json").read_text())["step"] == 2
    assert (run / "optimizer.safetensors").exists()
    with pytest.raises(ValueError, match="apart from --out"):  # the library refuses it too
        train(distill_cfg(run, export=str(run / "sub")), tiny_model(0), random_examples(), progress=False)


# ---- D4. a save removes only the work folders mtp itself made ------------------------------------
def user_folders(tmp_path, name):
    made = []
    for folder in (f".{name}.old", f".{name}.tmp-mine", f".{name}.old-mine"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "thesis.txt").write_text("mine")
        made.append(tmp_path / folder)
    return made


def test_d4_saves_and_resume_keep_user_folders_named_like_temps(tmp_path):
    model = tiny_model(0)
    add_adapters(model, rank=2)
    mine = user_folders(tmp_path, "a")
    save_adapter(model, tmp_path / "a")  # the first save
    save_adapter(model, tmp_path / "a")  # a replacing save
    mine += user_folders(tmp_path, "run")
    train(distill_cfg(tmp_path / "run", steps=2), tiny_model(0), random_examples(), progress=False)
    train(distill_cfg(tmp_path / "run", steps=3, resume=True), tiny_model(0), random_examples(), progress=False)
    assert all((d / "thesis.txt").read_text() == "mine" for d in mine)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["a", "run"]
    assert len(list(tmp_path.iterdir())) == 2 + len(mine)  # and nothing of mtp's was left behind


KILL = """
import os, sys
from mtp.core.runtime.artifacts import write_dir_atomic
real, where = os.replace, sys.argv[2]
def replace(src, dst):
    if where == "write" or ".old-" in str(dst):  # during the write / between the two renames
        if where != "write":
            real(src, dst)
        os._exit(9)
    real(src, dst)
os.replace = replace
write_dir_atomic(sys.argv[1], {"x.json": {"v": 2}}, kind=lambda p: True)
"""


@pytest.mark.parametrize("where", ["write", "rename"])
def test_d4_a_killed_save_is_cleaned_up_and_resume_recovers(tmp_path, where):
    run = tmp_path / "run"
    train(distill_cfg(run, steps=2), tiny_model(0), random_examples(), progress=False)
    r = subprocess.run([sys.executable, "-c", KILL, str(run), where], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    left = sorted(p for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left and all((p / MARKER).is_file() for p in left)  # marked work folders of the killed save
    assert run.exists() == (where == "write")
    state = train(distill_cfg(run, steps=3, resume=True), tiny_model(0), random_examples(), progress=False)
    assert state["step"] == 3 and [p.name for p in tmp_path.iterdir()] == ["run"]


# ---- W1. NaN / inf weights are refused: when training, saving, exporting and loading --------------
def test_w1_training_stops_at_nonfinite_weights_and_keeps_the_last_good_checkpoint(tmp_path):
    model = tiny_model(0)
    with pytest.raises(DivergedError, match=r"^step 4: tensor \S+ holds NaN or inf .*checkpoint \(step 2\)"):
        train(
            distill_cfg(tmp_path / "run", steps=6, save_every=2),
            model,
            random_examples(),
            progress=False,
            on_step=poison(model, float("nan")),
        )
    assert json.loads((tmp_path / "run" / "trainer_state.json").read_text())["step"] == 2
    for f in ("adapter.safetensors", "optimizer.safetensors"):
        assert all(
            bool(torch.isfinite(t).all())
            for t in load_file(str(tmp_path / "run" / f)).values()
            if t.is_floating_point()
        )
    load_adapter(tiny_model(0), tmp_path / "run")


def test_w1_float16_export_overflow_is_refused(tmp_path):
    model = tiny_model(0)
    with pytest.raises(ArtifactError, match="lora_b: a value of magnitude 1e[+]05 does not fit torch.float16"):
        train(
            distill_cfg(tmp_path / "run", steps=3, export=str(tmp_path / "ship")),
            model,
            random_examples(),
            progress=False,
            on_step=poison(model, 1e5),
        )  # finite in float32, inf in float16
    assert not (tmp_path / "ship").exists()
    load_adapter(tiny_model(0), tmp_path / "run")  # the float32 run is intact


def test_w1_a_nonfinite_tensor_is_never_written(tmp_path):
    model = tiny_model(0)
    add_adapters(model, rank=2)
    save_adapter(model, tmp_path / "a", {"v": 1})
    with torch.no_grad():
        model.embed_tokens.mask_row[3] = float("inf")
    with pytest.raises(ArtifactError, match="adapter.safetensors: tensor embed_tokens.mask_row holds NaN or inf"):
        save_adapter(model, tmp_path / "a", {"v": 2})
    assert json.loads((tmp_path / "a" / "config.json").read_text())["meta"] == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def corrupt(path: Path, name: str, value: float) -> None:
    """Rewrite one element of tensor `name` in safetensors file `path` (bypassing mtp's writer)."""
    tensors = load_file(str(path))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = value
    save_file(tensors, str(path))


@pytest.mark.parametrize(
    "name, value", [("layers.1.mlp.down_proj.lora_a", float("nan")), ("embed_tokens.mask_row", float("inf"))]
)
def test_w1_adapter_with_nan_or_inf_is_refused_at_load(tmp_path, name, value):
    model = tiny_model(0)
    add_adapters(model, rank=2)
    save_adapter(model, tmp_path / "a")
    corrupt(tmp_path / "a" / "adapter.safetensors", name, value)
    fresh = tiny_model(0)
    with pytest.raises(ValueError, match=rf"a/adapter.safetensors: tensor {name} holds NaN or inf"):
        load_adapter(fresh, tmp_path / "a")
    assert not getattr(fresh, "has_adapters", False)


def test_w1_heads_and_drafter_with_nan_are_refused_at_load_and_export(tmp_path):
    model = tiny_model(0)
    heads = saved_heads(model, tmp_path)
    corrupt(heads / N.WEIGHTS, "depths.1.proj.weight", float("nan"))
    with pytest.raises(ValueError, match="heads.safetensors: tensor depths.1.proj.weight holds NaN or inf"):
        N.load_heads(model, heads)
    model3 = tiny_model(3, n_layers=3)
    save_drafter(model3, tmp_path / "d", random_drafter(model3))
    corrupt(tmp_path / "d" / DRAFTER_WEIGHTS, "midlayer.self_attn.o_proj.weight", float("-inf"))
    with pytest.raises(ArtifactError, match="model.safetensors: tensor midlayer.self_attn.o_proj.weight holds"):
        load_drafter(model3, tmp_path / "d")
    with pytest.raises(ArtifactError, match="refusing to export"):
        export_vllm_eagle3(tmp_path / "d", tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()


# ---- T5. learning rates and token ids that are not numbers a trainer can use ---------------------
TRAINERS = {"train": TRAIN_ARGS, "train-heads": TINY_ARGS, "train-eagle3": TINY_ARGS}


@pytest.mark.parametrize("lr", ["1e38", "inf", "nan", "0", "-0.001", "11"])
def test_t5_bad_learning_rates_are_one_line(word_model, tmp_path, capsys, lr):
    ex = examples_file(tmp_path)
    for name, args in TRAINERS.items():
        code, _, err = run_cli(
            [name, *args, "--model", word_model, "--examples", ex, "--lr", lr, "--out", tmp_path / "o"], capsys
        )
        one_line_error(code, err, "--lr must be a finite number in (0, 10]")
    assert not (tmp_path / "o").exists()


def test_t5_an_infinite_token_id_never_crashes_a_trainer(word_model, tmp_path, capsys):
    bad = tmp_path / "inf.jsonl"
    bad.write_text('{"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 1e400]}\n')  # 1e400 parses as inf
    for name, args in TRAINERS.items():
        code, _, err = run_cli([name, *args, "--model", word_model, "--examples", bad, "--out", tmp_path / "o"], capsys)
        assert code == 2 and err.strip().splitlines()[-1].startswith("mtp: error:"), err
        assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


# ---- W9. EAGLE-3 layers: distinct, and a default vLLM can feed on small trunks --------------------
def test_w9_repeated_aux_layers_are_refused(word_model_4, tmp_path, capsys):
    code, _, err = run_cli(
        [
            "train-eagle3",
            "--model",
            word_model_4,
            "--examples",
            examples_file(tmp_path),
            *TINY_ARGS,
            "--aux-layers",
            "2,2,2",
            "--out",
            tmp_path / "d",
        ],
        capsys,
    )
    one_line_error(code, err, "names a layer twice")
    assert not (tmp_path / "d").exists()


def test_w9_default_layers_are_distinct_and_exportable(word_model_4, tmp_path, capsys):
    assert default_aux_layers(30) == [2, 15, 27] and default_aux_layers(4) == [0, 2, 3]
    for n in range(3, 64):
        a = default_aux_layers(n)
        assert len(a) == 3 and 0 <= a[0] < a[1] < a[2] < n, (n, a)
    out = tmp_path / "d"
    assert (
        run_cli(
            [
                "train-eagle3",
                "--model",
                word_model_4,
                "--examples",
                examples_file(tmp_path),
                *TINY_ARGS,
                "--draft-vocab",
                "16",
                "--val-fraction",
                "0",
                "--cache-dir",
                tmp_path / "c",
                "--out",
                out,
            ],
            capsys,
        )[0]
        == 0
    )
    code, _, err = run_cli(["export", "--format", "vllm-eagle3", "--drafter", out, "--out", tmp_path / "v"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "v" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [0, 2, 3]


# ---- W2. `mtp train-heads --examples` (the README's command) -------------------------------------
def test_w2_train_heads_reads_examples(word_model, tmp_path, capsys):
    ex = examples_file(tmp_path, "answers.jsonl")
    out = tmp_path / "heads"
    code, stdout, err = run_cli(
        [
            "train-heads",
            "--model",
            word_model,
            "--examples",
            ex,
            *TINY_ARGS,
            "--draft-vocab",
            "16",
            "--cache-dir",
            tmp_path / "c",
            "--out",
            out,
        ],
        capsys,
    )
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "heads.safetensors"]
    assert json.loads((out / "config.json").read_text())["meta"]["data"] == "answers.jsonl"
    for extra in ([], ["--data", ex]):  # neither source, or both
        code, _, err = run_cli(
            [
                "train-heads",
                "--model",
                word_model,
                *extra,
                *(["--examples", ex] if extra else []),
                "--out",
                tmp_path / "h2",
            ],
            capsys,
        )
        one_line_error(code, err, "exactly one of --data FILE or --examples FILE")


# ---- Issue 47 D1. `mtp train --out` holds only this run: an adapter without a checkpoint is kept --
def folder_bytes(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def train_args(word_model, tmp_path, *more, steps=2):
    return [
        "train",
        "--model",
        word_model,
        "--examples",
        tmp_path / "examples.jsonl",
        *TRAIN_ARGS,
        "--steps",
        steps,
        *more,
    ]


def exported_run(word_model, tmp_path, capsys) -> None:
    """A finished run in tmp_path/run (2 steps) with its float16 copy in tmp_path/ship."""
    examples_file(tmp_path)
    code, _, err = run_cli(
        train_args(word_model, tmp_path, "--out", tmp_path / "run", "--export", tmp_path / "ship"), capsys
    )
    assert code == 0, err


def plain_adapter(path: Path) -> Path:
    """An adapter as shipped (`save_adapter`: config.json + adapter.safetensors, no checkpoint)."""
    model = tiny_model(0)
    add_adapters(model, rank=2)
    save_adapter(model, path, {"v": 1})
    return path


def test_47_d1_train_out_never_replaces_an_adapter_without_a_checkpoint(word_model, tmp_path, capsys):
    exported_run(word_model, tmp_path, capsys)
    for target in (tmp_path / "ship", plain_adapter(tmp_path / "plain")):
        before = folder_bytes(target)
        for resume in ([], ["--resume"]):
            code, _, err = run_cli(train_args(word_model, tmp_path, "--out", target, *resume), capsys)
            one_line_error(code, err, str(target), "no training checkpoint")
            assert folder_bytes(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["examples.jsonl", "plain", "run", "ship"]


def test_47_d1_train_out_takes_a_new_or_empty_folder_or_resumes_its_checkpoint(word_model, tmp_path, capsys):
    exported_run(word_model, tmp_path, capsys)
    (tmp_path / "empty").mkdir()
    assert run_cli(train_args(word_model, tmp_path, "--out", tmp_path / "empty"), capsys)[0] == 0
    code, _, err = run_cli(train_args(word_model, tmp_path, "--out", tmp_path / "run"), capsys)  # no --resume
    one_line_error(code, err, "already holds a training run", "--resume")
    code, _, err = run_cli(train_args(word_model, tmp_path, "--out", tmp_path / "new", "--resume"), capsys)
    one_line_error(code, err, "--resume: no checkpoint")
    assert not (tmp_path / "new").exists()
    code, _, err = run_cli(train_args(word_model, tmp_path, "--out", tmp_path / "run", "--resume", steps=3), capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "trainer_state.json").read_text())["step"] == 3


def test_47_d1_export_replaces_only_this_runs_own_copy(word_model, tmp_path, capsys):
    exported_run(word_model, tmp_path, capsys)
    resume = ["--out", tmp_path / "run", "--resume"]
    code, _, err = run_cli(train_args(word_model, tmp_path, *resume, "--export", tmp_path / "ship", steps=3), capsys)
    assert code == 0, err  # its own copy: refreshed
    assert json.loads((tmp_path / "ship" / "config.json").read_text())["meta"]["step"] == 3
    other = tmp_path / "other"  # another run, and its copy: not this run's to replace; nor a plain adapter
    code, _, err = run_cli(
        train_args(word_model, tmp_path, "--out", other, "--export", tmp_path / "other-ship"), capsys
    )
    assert code == 0, err
    for target in (tmp_path / "other-ship", other, plain_adapter(tmp_path / "plain")):
        before = folder_bytes(target)
        code, _, err = run_cli(train_args(word_model, tmp_path, *resume, "--export", target, steps=4), capsys)
        one_line_error(code, err, "--export", str(target))
        assert folder_bytes(target) == before
    assert json.loads((tmp_path / "run" / "trainer_state.json").read_text())["step"] == 3  # nothing trained


# ---- Issue 47: flags that contradict the adapter continued (--init-adapter) or the checkpoint (--resume)
def no_model_load(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mtp.cli.train.Engine.load", no_load)


SHAPE_FLAGS = [
    (["--rank", "8"], "rank 4"),
    (["--alpha", "3"], "alpha 32"),
    (["--mode", "plain"], "mode gated"),
    (["--targets", "q,v"], "targets q,k,v,o,gate,up,down"),
    (["--lora-layers", "1:2"], "lora_layers 0:2"),
]


@pytest.mark.parametrize("flags, have", SHAPE_FLAGS)
def test_47_init_adapter_flags_that_contradict_it_fail_before_the_model_loads(
    word_model, tmp_path, capsys, monkeypatch, flags, have
):
    src = tmp_path / "src"
    model = tiny_model(0)
    add_adapters(model, rank=4)
    save_adapter(model, src, {"v": 1})
    examples_file(tmp_path)
    no_model_load(monkeypatch)
    code, _, err = run_cli(
        train_args(word_model, tmp_path, "--init-adapter", src, *flags, "--out", tmp_path / "o"), capsys
    )
    one_line_error(code, err, " ".join(flags), "--init-adapter", f"({have})")
    assert not (tmp_path / "o").exists()


OTHER_FLAGS = [
    (["--seq-len", "48"], "seq_len 32"),
    (["--lr", "0.01"], "lr 0.0005"),
    (["--seed", "3"], "seed 0"),
    (["--k-max", "4"], "k_max 3"),
]


@pytest.mark.parametrize("flags, have", SHAPE_FLAGS + OTHER_FLAGS)
def test_47_resume_flags_that_contradict_the_checkpoint_fail_before_the_model_loads(
    word_model, tmp_path, capsys, monkeypatch, flags, have
):
    examples_file(tmp_path)
    run = tmp_path / "run"
    assert run_cli(train_args(word_model, tmp_path, "--rank", "4", "--out", run), capsys)[0] == 0
    before = folder_bytes(run)
    no_model_load(monkeypatch)
    code, _, err = run_cli(
        train_args(word_model, tmp_path, "--rank", "4", *flags, "--out", run, "--resume", steps=3), capsys
    )
    one_line_error(code, err, "--resume", " ".join(flags), f"({have})", str(run))
    assert folder_bytes(run) == before


def test_47_resume_takes_the_adapter_shape_the_flags_leave_out(word_model, tmp_path, capsys):
    examples_file(tmp_path)
    run = tmp_path / "run"
    code, _, err = run_cli(
        train_args(word_model, tmp_path, "--rank", "4", "--lora-layers", "1:2", "--out", run), capsys
    )
    assert code == 0, err
    code, _, err = run_cli(train_args(word_model, tmp_path, "--out", run, "--resume", steps=3), capsys)
    assert code == 0, err  # rank 4 and layers 1:2 from the checkpoint: nothing contradicts it
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["settings"]["rank"] == 4 and state["settings"]["lora_layers"] == [1, 2]
