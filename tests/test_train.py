"""Self-distillation training: the mask layout (exact), the split forward against the one-pass
layout, the loss variants, bit-for-bit resume, DDP under torchrun, and the `mtp train` CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import (
    MTP,
    cli_env,
    distill_cfg,
    make_tiny_model_dir,
    prompts_file,
    random_examples,
    tiny_model,
    train_args,
    write_examples,
)
from safetensors.torch import load_file

from mtp.core.runtime.adapter import add_adapters
from mtp.training.data import Example
from mtp.training.distill import (
    Span,
    batch_indices,
    build_layout,
    distill_loss,
    forward_pair,
    make_batch,
    train,
)


def test_layout_exact():
    # N=5 ground-truth tokens; span A after p=1 predicting k=3 (2 masks); span B after p=3, k=2 (1 mask)
    pos, attn, rows, depth, span_of, feeds = build_layout(5, [Span(1, 3), Span(3, 2)])
    #                t0 t1 t2 t3 t4 a1 a2 b1
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],  # t0
            [1, 1, 0, 0, 0, 0, 0, 0],  # t1
            [1, 1, 1, 0, 0, 0, 0, 0],  # t2
            [1, 1, 1, 1, 0, 0, 0, 0],  # t3
            [1, 1, 1, 1, 1, 0, 0, 0],  # t4: ground truth never sees a mask
            [1, 1, 0, 0, 0, 1, 0, 0],  # a1: prefix t0..t1, itself
            [1, 1, 0, 0, 0, 1, 1, 0],  # a2: prefix, a1 (causal within its span)
            [1, 1, 1, 1, 0, 0, 0, 1],  # b1: prefix t0..t3, never span A
        ],
        dtype=torch.bool,
    )
    assert torch.equal(attn, want)
    assert pos.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]  # j-th mask after p sits at p + j
    assert rows.tolist() == [1, 5, 6, 3, 7]  # depth 1 is the last prefix token itself
    assert depth.tolist() == [1, 2, 3, 1, 2]
    assert span_of.tolist() == [0, 0, 0, 1, 1]
    assert feeds.tolist() == [5, 6, -1, 7, -1]  # the proposal at depth j is fed at mask j


def test_batch_columns():
    exs = [Example([10, 11], [12, 13, 14]), Example([20, 21], [22, 23, 24, 25, 26])]
    b = make_batch(exs, 97, n_spans=1, k_max=3, seq_len=64, gen=torch.Generator().manual_seed(0))
    assert b.n_gt == 7  # ground truth padded to the longest; masks start at column 7
    assert b.tokens[0, :5].tolist() == [10, 11, 12, 13, 14] and b.tokens[1, :7].tolist() == [20, 21, 22, 23, 24, 25, 26]
    for i in range(2):
        m = int((b.tokens[i, 7:] == 97).sum())
        assert m >= 1 and b.attn[i, 7 : 7 + m, 5 if i == 0 else 7 : 7].sum() == 0  # masks never see padding
        d1 = b.out_index[i, 0]
        assert b.depth[i, 0] == 1 and int(d1) < 7 and b.positions[i, 7] == d1 + 1
        assert b.gt_target[i, 0] == b.tokens[i, d1 + 1]


def _step(split, teacher, seed=0, amp=False):
    model = tiny_model(0)
    torch.manual_seed(seed)
    params = add_adapters(model, rank=4, alpha=8)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.1)
    batch = make_batch(random_examples(3), model.config.mask_token_id, 3, 6, 64, torch.Generator().manual_seed(1))
    s, proposals, t = forward_pair(model, model, None, batch, teacher, split, amp)
    loss, agree = distill_loss(s, t, batch, teacher, proposals)
    loss.backward()
    return loss.detach(), [p.grad for p in params], proposals[batch.valid]


@pytest.mark.parametrize("teacher", ["hard", "soft", "ground-truth"])
def test_split_forward_equals_one_pass_layout(teacher):
    loss_a, grads_a, prop_a = _step(False, teacher)
    loss_b, grads_b, prop_b = _step(True, teacher)
    assert torch.equal(prop_a, prop_b)
    torch.testing.assert_close(loss_a, loss_b)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-4)
    assert grads_a[0].abs().sum() > 0  # the mask embedding row is trained


@pytest.mark.parametrize("split", [False, True])
def test_bf16_autocast_step_is_the_fp32_step_in_bf16(split):
    """`mtp train --amp on`: the forward in bf16 gives the fp32 loss and gradients to bf16 precision."""
    loss_a, grads_a, _ = _step(split, "ground-truth")
    loss_b, grads_b, _ = _step(split, "ground-truth", amp=True)
    assert float(loss_b) == pytest.approx(float(loss_a), rel=2e-2)
    ga, gb = torch.cat([g.flatten() for g in grads_a]), torch.cat([g.flatten() for g in grads_b])
    assert not torch.equal(ga, gb)  # it did run in bf16
    assert float(torch.nn.functional.cosine_similarity(ga, gb, dim=0)) > 0.98


def test_loss_variants_differ():
    losses = {t: float(_step(True, t)[0]) for t in ("hard", "soft", "ground-truth")}
    assert len(set(losses.values())) == 3, losses


def test_hard_teacher_weights_by_proposal_prefix():
    """Depth-1 weight is 1; deeper entries weigh prod P_T(y'_<d): a hand-built example."""
    from mtp.training.distill import Batch

    s = torch.log(torch.tensor([[[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]]))
    t = torch.log(
        torch.tensor([[[0.5, 0.5, 0.0 + 1e-9, 0.0 + 1e-9], [0.1, 0.2, 0.7, 0.0 + 1e-9], [0.1, 0.1, 0.1, 0.7]]])
    )
    b = Batch(
        tokens=None,
        positions=None,
        attn=None,
        out_index=None,
        valid=torch.ones(1, 3, dtype=torch.bool),
        depth=torch.tensor([[1, 2, 3]]),
        span_start=torch.zeros(1, 3, dtype=torch.long),
        feeds=None,
        gt_target=torch.zeros(1, 3, dtype=torch.long),
        n_gt=0,
        n_tokens=0,
    )
    proposals = s.argmax(-1)  # [0, 1, 0]
    loss, agree = distill_loss(s, t, b, "hard", proposals)
    logp = torch.log_softmax(s, -1)[0]
    w = [1.0, 0.5, 0.5 * 0.2]  # P_T(y'_1 = 0) = 0.5, P_T(y'_2 = 1) = 0.2
    want = -(w[0] * logp[0, 0] + w[1] * logp[1, 2] + w[2] * logp[2, 3]) / 3
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    assert agree[0].tolist() == [True, False, False]


class Killed(BaseException):
    """A hard kill (SIGKILL) between checkpoints: nothing gets a chance to save."""


def kill_after(n):
    def on_step(step):
        if step >= n:
            raise Killed

    return on_step


def test_resume_is_bit_for_bit(tmp_path):
    exs = random_examples()
    train(distill_cfg(tmp_path / "full"), tiny_model(0), exs, progress=False)
    with pytest.raises(Killed):  # killed after step 3; the last checkpoint is step 2
        train(distill_cfg(tmp_path / "cut"), tiny_model(0), exs, progress=False, on_step=kill_after(3))
    assert json.loads((tmp_path / "cut" / "trainer_state.json").read_text())["step"] == 2
    state = train(distill_cfg(tmp_path / "cut", resume=True), tiny_model(0), exs, progress=False)
    assert state["step"] == 4
    for name in ("adapter.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(tmp_path / "full" / name)), load_file(str(tmp_path / "cut" / name))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    first = load_file(str(tmp_path / "full" / "adapter.safetensors"))
    assert first["embed_tokens.mask_row"].ne(tiny_model(0).embed_tokens.weight.mean(0)).any()


def test_seeded_runs_are_identical_and_seeds_differ(tmp_path):
    exs = random_examples()
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        train(distill_cfg(tmp_path / name, steps=2, seed=seed), tiny_model(0), exs, progress=False)
    a, b, c = (load_file(str(tmp_path / n / "adapter.safetensors")) for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_resume_guards(tmp_path):
    exs = random_examples()
    train(distill_cfg(tmp_path / "r", steps=2), tiny_model(0), exs, progress=False)
    with pytest.raises(ValueError, match="already holds a training run"):
        train(distill_cfg(tmp_path / "r", steps=2), tiny_model(0), exs, progress=False)
    with pytest.raises(ValueError, match="--resume: rank was 16"):
        train(distill_cfg(tmp_path / "r", steps=3, rank=8, resume=True), tiny_model(0), exs, progress=False)
    with pytest.raises(ValueError, match="no checkpoint"):
        train(distill_cfg(tmp_path / "none", resume=True), tiny_model(0), exs, progress=False)


def test_train_errors(tmp_path):
    with pytest.raises(ValueError, match="no example fits --seq-len 5"):
        train(distill_cfg(tmp_path / "x", seq_len=5), tiny_model(0), random_examples(), progress=False)
    with pytest.raises(ValueError, match="exceeds the model's context window"):
        train(distill_cfg(tmp_path / "x", seq_len=10_000), tiny_model(0), random_examples(), progress=False)
    assert not (tmp_path / "x").exists()


def test_batch_indices_cover_each_epoch_once():
    seen = [i for s in range(4) for r in range(2) for i in batch_indices(s, 8, 1, 0, r, 2)]
    assert sorted(seen) == list(range(8))


def test_plain_and_full_modes_train(tmp_path):
    for mode in ("plain", "full"):
        state = train(
            distill_cfg(tmp_path / mode, steps=2, mode=mode), tiny_model(0), random_examples(), progress=False
        )
        assert state["step"] == 2 and state["history"][-1]["loss"] > 0


# --- CLI: the tiny model as a HF directory with a word-level tokenizer ------------------------------


def test_cli_end_to_end(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    data = prompts_file(tmp_path, n=6)
    out = tmp_path / "adapter"
    self_generate = ["--self-generate", "--max-new-tokens", "12"]
    cmd = MTP + train_args(
        model_dir, "--data", data, *self_generate, "--out", out, "--export", tmp_path / "ship", "--amp", "on", steps=3
    )
    r = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "trained 3 steps" in r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["meta"]["step"] == 3 and cfg["meta"]["training"]["teacher"] == "hard"
    assert cfg["meta"]["training"]["amp"] is True
    ship = load_file(str(tmp_path / "ship" / "adapter.safetensors"))
    assert all(v.dtype == torch.float16 for v in ship.values())
    assert sorted(p.name for p in (tmp_path / "ship").iterdir()) == ["adapter.safetensors", "config.json"]
    gen = MTP + ["generate", "w1 w2 w3", "--model", str(model_dir), "--adapter", str(tmp_path / "ship")]
    gen += ["--strategy", "conf_adapt:0.5:4", "--max-new-tokens", "8", "--json"]
    r = subprocess.run(gen, capture_output=True, text=True, env=cli_env(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["strategy"] == "conf_adapt:0.5:4"
    # bad input: one line, exit 2, nothing written
    bad = MTP + train_args(
        model_dir, "--data", tmp_path / "test.jsonl", *self_generate, "--out", tmp_path / "bad", steps=3
    )
    r = subprocess.run(bad, capture_output=True, text=True, env=cli_env(tmp_path), timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "test split" in r.stderr
    assert not (tmp_path / "bad").exists()


def test_torchrun_two_processes_gloo(tmp_path):
    """DDP on CPU: two processes, each its own share of every batch, replicas identical at the end."""
    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    ex_path = write_examples(tmp_path / "examples.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mtp.cli"]
    cmd += train_args(model_dir, "--examples", ex_path, "--save-every", "2", "--out", tmp_path / "ddp", steps=3)
    r = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 processes, replicas in sync: True" in r.stderr
    state = json.loads((tmp_path / "ddp" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["settings"]["world"] == 2
