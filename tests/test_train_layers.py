"""`mtp train --lora-layers FROM:TO` (LoRA on the upper layers only: the backward pass stops at layer
FROM) and `--init-adapter DIR` (a new run starting from an adapter's weights), on tiny random models."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from helpers import (
    MTP,
    cli_env,
    distill_cfg,
    make_tiny_model_dir,
    random_examples,
    tiny_model,
    train_args,
    write_examples,
)
from safetensors.torch import load_file

from mtp.cli import main as cli_main
from mtp.core.decoding.decode import generate
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.runtime import adapter
from mtp.core.runtime.adapter import add_adapters, load_adapter
from mtp.training import trainer as trainer_mod
from mtp.training.distill import distill_loss, forward_pair, make_batch, train


def _grad_flow(layers, split, teacher, n_layers=4):
    """One training step's forward and backward on a tiny model with LoRA on `layers`: which blocks'
    outputs autograd recorded (requires_grad), and the names of the parameters that got a gradient."""
    model = tiny_model(0, n_layers=n_layers)
    torch.manual_seed(0)
    params = add_adapters(model, rank=4, alpha=8, layers=layers)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.1)
    recorded = {}
    for i, block in enumerate(model.layers):
        block.register_forward_hook(lambda m, a, out, i=i: recorded.setdefault(i, []).append(out.requires_grad))
    batch = make_batch(random_examples(3), model.config.mask_token_id, 3, 6, 64, torch.Generator().manual_seed(1))
    s, proposals, t = forward_pair(model, model, None, batch, teacher, split, False)
    distill_loss(s, t, batch, teacher, proposals)[0].backward()
    graded = {n for n, p in model.named_parameters() if p.grad is not None}
    return {i: any(v) for i, v in recorded.items()}, graded, len(params)


@pytest.mark.parametrize("split,teacher", [(True, "hard"), (True, "ground-truth"), (False, "hard")])
def test_backward_stops_at_the_first_adapted_layer(split, teacher):
    flows, graded, n_params = _grad_flow((2, 4), split, teacher)
    # autograd records nothing below layer 2: those blocks' outputs need no gradient, so no backward runs there
    assert flows == {0: False, 1: False, 2: True, 3: True}
    assert graded and all(
        n.startswith(("layers.2.", "layers.3.")) and n.endswith((".lora_a", ".lora_b")) for n in graded
    )
    assert len(graded) == n_params == 2 * 7 * 2  # A and B of 7 projections in 2 layers; no mask row
    # control: LoRA on every layer trains the mask row, and so every block is in the graph
    flows, graded, _ = _grad_flow(None, split, teacher)
    assert all(flows.values()) and "embed_tokens.mask_row" in graded and any(n.startswith("layers.0.") for n in graded)


def test_lora_layers_run_trains_upper_layers_and_decodes_like_ntp(tmp_path):
    model = tiny_model(0)
    state = train(
        distill_cfg(tmp_path / "run", steps=3, lora_layers=(1, 2), export=str(tmp_path / "ship")),
        model,
        random_examples(),
        progress=False,
    )
    assert state["step"] == 3
    saved = load_file(str(tmp_path / "run" / "adapter.safetensors"))
    assert {k.split(".")[1] for k in saved if k.startswith("layers.")} == {"1"}  # nothing on layer 0
    probe = tiny_model(0)
    add_adapters(probe, rank=16, layers=(1, 2))
    assert torch.equal(saved["embed_tokens.mask_row"], probe.embed_tokens.mask_row)  # frozen at its initial value
    conf = json.loads((tmp_path / "ship" / "config.json").read_text())
    assert conf["layers"] == [1, 2] and conf["meta"]["training"]["lora_layers"] == [1, 2]
    fresh = tiny_model(0)
    load_adapter(fresh, tmp_path / "ship")
    assert [type(b.self_attn.q_proj).__name__ for b in fresh.layers] == ["Linear", "LoRALinear"]
    prompt, params = [5, 17, 3, 44], SamplingParams(max_new_tokens=24)
    want = generate(tiny_model(0), prompt, "ntp", params=params).output
    seq = generate(fresh, prompt, "verify:4", params=params)
    assert seq.output == want  # lossless: the unadapted lower layers ignore the gate


def test_init_adapter_starts_from_exactly_the_source(tmp_path, monkeypatch):
    train(
        distill_cfg(tmp_path / "src", steps=2, rank=4, lora_layers=(1, 2)),
        tiny_model(0),
        random_examples(),
        progress=False,
    )
    src = load_file(str(tmp_path / "src" / "adapter.safetensors"))
    at_start = {}

    def capture(self, resume=False, on_step=None):  # the trainer's weights before its first step
        at_start.update(self.files_fn()[adapter.WEIGHTS])
        assert not self.opt.state  # a fresh optimizer
        return self.state

    with monkeypatch.context() as m:
        m.setattr(trainer_mod.Trainer, "run", capture)
        train(
            distill_cfg(tmp_path / "a", rank=4, lora_layers=(1, 2), init_adapter=str(tmp_path / "src")),
            tiny_model(0),
            random_examples(),
            progress=False,
        )
    assert at_start.keys() == src.keys() and all(torch.equal(at_start[k], src[k]) for k in src)
    # a real run: new steps from the source's weights, the source recorded in the run's config
    state = train(
        distill_cfg(tmp_path / "b", steps=2, seed=5, rank=4, lora_layers=(1, 2), init_adapter=str(tmp_path / "src")),
        tiny_model(0),
        random_examples(),
        progress=False,
    )
    assert state["step"] == 2
    conf = json.loads((tmp_path / "b" / "config.json").read_text())
    assert conf["meta"]["training"]["init_adapter"] == str(tmp_path / "src")
    assert conf["meta"]["training"]["init_from"]["step"] == 2 and conf["layers"] == [1, 2]


def test_init_adapter_refusals(tmp_path):
    train(distill_cfg(tmp_path / "src", steps=1, rank=4), tiny_model(0), random_examples(), progress=False)
    with pytest.raises(ValueError, match="trained on another base model"):
        train(
            distill_cfg(tmp_path / "a", rank=4, init_adapter=str(tmp_path / "src")),
            tiny_model(1),
            random_examples(),
            progress=False,
        )
    with pytest.raises(ValueError, match=r"^--rank 8 conflicts with --init-adapter .* \(rank 4\)"):
        train(
            distill_cfg(tmp_path / "a", rank=8, init_adapter=str(tmp_path / "src")),
            tiny_model(0),
            random_examples(),
            progress=False,
        )
    with pytest.raises(ValueError, match=r"^--lora-layers 1:2 conflicts with --init-adapter .* \(lora_layers 0:2\)"):
        train(
            distill_cfg(tmp_path / "a", rank=4, lora_layers=(1, 2), init_adapter=str(tmp_path / "src")),
            tiny_model(0),
            random_examples(),
            progress=False,
        )
    assert not (tmp_path / "a").exists()


# --- CLI -------------------------------------------------------------------------------------------


def test_cli_lora_layers_and_init_adapter(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    base = MTP + train_args(model_dir, "--examples", write_examples(tmp_path / "examples.jsonl"))
    run = lambda *a: subprocess.run(base + list(a), capture_output=True, text=True, env=cli_env(tmp_path), timeout=120)
    r = run("--lora-layers", "1:", "--rank", "4", "--out", str(tmp_path / "upper"), "--export", str(tmp_path / "ship"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ship" / "config.json").read_text())["layers"] == [1, 2]
    out = {}
    for strategy, adapter_dir in (("ntp", "none"), ("verify:4", str(tmp_path / "ship"))):
        g = subprocess.run(
            MTP
            + [
                "generate",
                "w1 w2 w3",
                "--model",
                str(model_dir),
                "--adapter",
                adapter_dir,
                "--strategy",
                strategy,
                "--max-new-tokens",
                "16",
                "--json",
            ],
            capture_output=True,
            text=True,
            env=cli_env(tmp_path),
            timeout=120,
        )
        assert g.returncode == 0, g.stderr
        out[strategy] = json.loads(g.stdout)["token_ids"]
    assert out["verify:4"] == out["ntp"]
    # a new run from that adapter: its shape (rank 4, layers 1:2) comes along without flags
    r = run("--init-adapter", str(tmp_path / "ship"), "--out", str(tmp_path / "next"))
    assert r.returncode == 0, r.stderr
    conf = json.loads((tmp_path / "next" / "config.json").read_text())
    assert conf["rank"] == 4 and conf["layers"] == [1, 2]
    assert conf["meta"]["training"]["init_from"]["path"] == str((tmp_path / "ship").resolve())
    r = run("--init-adapter", str(tmp_path / "ship"), "--rank", "8", "--out", str(tmp_path / "bad"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--rank 8 conflicts" in r.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--lora-layers", "1:1"], "must satisfy 0 <= FROM < TO"),
        (["--lora-layers", "0:3"], "(the model has 2 layers)"),
        (["--lora-layers", "2:"], "must satisfy 0 <= FROM < TO"),
        (["--lora-layers", "one:two"], "expected FROM:TO"),
        (["--lora-layers", "0:2", "--mode", "full"], "needs --mode gated or plain"),
        (["--init-adapter", "nowhere"], "adapter directory not found"),
    ],
)
def test_cli_bad_layers_fail_before_the_model_loads(tmp_path, monkeypatch, capsys, flags, message):
    model_dir = make_tiny_model_dir(tmp_path / "tiny")

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mtp.cli.train.Engine.load", no_load)
    rc = cli_main(
        [
            "train",
            "--model",
            str(model_dir),
            "--examples",
            str(write_examples(tmp_path / "examples.jsonl")),
            "--out",
            str(tmp_path / "out"),
            *flags,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().count("\n") == 0 and message in err, err
    assert not (tmp_path / "out").exists()
