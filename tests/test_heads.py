"""MTP heads: the base model is untouched, `verify` with heads is lossless, a head that copies the
model's own next-token prediction is always accepted, the hidden-state cache round-trips, and an
interrupted training run resumes to exactly the weights of an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import random_heads, saved_heads, tiny_model

from mtp.cli import main as cli_main
from mtp.core.decoding.decode import generate
from mtp.core.decoding.proposers import heads as N
from mtp.core.decoding.sampling import SamplingParams
from mtp.training import heads_train as H
from mtp.training.data import Example
from mtp.training.trainer import STATE


def greedy(model, prompt, strategy, proposer=None, n=40):
    return generate(model, prompt, strategy, SamplingParams(max_new_tokens=n), proposer=proposer)


SIZES = [dict(blocks=0), dict(blocks=1, width=32), dict(blocks=1), dict(blocks=2)]


def test_sizes_and_shapes(tiny):
    n = {}
    for kw in SIZES:
        heads = random_heads(tiny, depths=2, **kw)
        h = torch.randn(5, 64)
        logits = heads(tiny, h, torch.randint(0, 97, (5, 2)))
        assert [tuple(x.shape) for x in logits] == [(5, 97), (5, 97)]
        n[N.HeadsConfig.for_model(tiny.config, 2, **kw).label()] = heads.n_params()
    # projection only: 2 * (2*dim*dim + 2 norms)
    assert n["linear x2"] == 2 * (2 * 64 * 64 + 2 * 64)
    assert n["linear x2"] < n["1 block @32 x2"] < n["1 block x2"] < n["2 blocks x2"]


def test_bad_sizes_fail_loudly(tiny):
    with pytest.raises(ValueError, match="depths"):
        N.HeadsConfig.for_model(tiny.config, depths=0)
    with pytest.raises(ValueError, match="width"):
        N.HeadsConfig.for_model(tiny.config, 1, blocks=1, width=65)
    with pytest.raises(ValueError, match="blocks"):
        H.TrainHeadsConfig(blocks=-1)


def test_base_logits_unchanged_with_heads_attached(tiny, tmp_path):
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    before = tiny(tokens)
    state = {k: v.clone() for k, v in tiny.state_dict().items()}
    proposer = N.load_heads_proposer(tiny, saved_heads(tiny, tmp_path, blocks=1))
    greedy(tiny, [1, 2, 3], "verify:4", proposer)
    assert torch.equal(tiny(tokens), before)
    assert state.keys() == tiny.state_dict().keys()
    assert all(torch.equal(v, tiny.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize("size", SIZES, ids=["linear", "narrow", "block", "2blocks"])
@pytest.mark.parametrize("k", [2, 4])
def test_greedy_verify_with_heads_equals_ntp(size, k):
    model = tiny_model(3)
    proposer = N.HeadsProposer(model, random_heads(model, depths=3, **size), readout_dtype="float32")
    for prompt in ([5, 17, 3], [44, 2, 9, 9, 81, 30]):
        ref = greedy(model, prompt, "ntp")
        got = greedy(model, prompt, f"verify:{k}", proposer)
        assert got.output == ref.output
        assert all(c <= min(k, 4) for c in got.stats.chunks)
    assert proposer.draft_calls > 0


def test_heads_see_the_hidden_state_of_the_last_accepted_position():
    """view.hidden must be the trunk's state at the position whose prediction is context[-1]."""
    model = tiny_model(3)

    class Spy(N.HeadsProposer):
        seen = []

        def propose(self, request):
            self.seen.append((list(request.view.context), request.view.hidden.clone()))
            return super().propose(request)

    spy = Spy(model, random_heads(model, depths=3), readout_dtype="float32")
    greedy(model, [5, 17, 3, 8], "verify:4", spy, n=20)
    assert len(spy.seen) > 3
    for context, hidden in spy.seen:
        _, h = model(torch.tensor([context[:-1]]), return_hidden=True)
        assert torch.allclose(hidden, h[0, -1], rtol=1e-4, atol=1e-4)


def copy_head_model():
    """A 0-layer model: the next token depends on the current token only, so a head that maps
    (h, embed(t)) -> embed(t) predicts exactly what the model will predict after t."""
    model = tiny_model(5, n_layers=0)
    heads = random_heads(model, depths=3)
    dim = model.config.dim
    with torch.no_grad():
        for head in heads.depths:
            head.proj.weight.zero_()
            head.proj.weight[:, dim:] = torch.eye(dim)  # take the token half only
            head.norm_e.weight.copy_(model.norm.weight.new_ones(dim))
    return model, heads


@pytest.mark.parametrize("k", [2, 3, 4])
def test_copy_head_is_always_accepted(k):
    model, heads = copy_head_model()
    proposer = N.HeadsProposer(model, heads, readout_dtype="float32")
    n = 1 + 5 * k  # the prompt's pass emits 1 token, every later pass k
    got = greedy(model, [3, 14, 15], f"verify:{k}", proposer, n=n)
    assert got.output == greedy(model, [3, 14, 15], "ntp", n=n).output
    assert got.stats.chunks == [1] + [k] * 5


def test_conf_adapt_uses_head_confidence():
    model, heads = copy_head_model()
    proposer = N.HeadsProposer(model, heads, readout_dtype="float32")
    everything = greedy(model, [3, 14, 15], "conf_adapt:0.000001:4", proposer, n=13)
    assert everything.stats.chunks == [4, 4, 4, 1]  # own token + 3 guesses, every pass
    assert everything.output == greedy(model, [3, 14, 15], "ntp", n=13).output  # copy head: right guesses
    nothing = greedy(model, [3, 14, 15], "conf_adapt:1.0:4", proposer, n=6)
    assert nothing.stats.chunks == [1] * 6


def test_sampled_verify_with_heads_runs():
    model = tiny_model(3)
    proposer = N.HeadsProposer(model, random_heads(model, depths=2), readout_dtype="float32")
    params = SamplingParams(temperature=0.8, seed=1, max_new_tokens=30)
    a = generate(model, [1, 2, 3], "verify:3", params, proposer=proposer)
    b = generate(
        model, [1, 2, 3], "verify:3", SamplingParams(temperature=0.8, seed=1, max_new_tokens=30), proposer=proposer
    )
    assert len(a.output) == 30 and a.output == b.output


def test_heads_refuse_another_base_model(tmp_path):
    path = saved_heads(tiny_model(0), tmp_path)
    with pytest.raises(ValueError, match="another base model"):
        N.load_heads(tiny_model(1), path)
    with pytest.raises(ValueError, match="no config.json"):
        N.load_heads(tiny_model(0), tmp_path)


def test_draft_vocabulary_keeps_verify_lossless_and_round_trips(tmp_path):
    from mtp.core.runtime.artifacts import write_dir_atomic

    model = tiny_model(3)
    heads = random_heads(model, depths=3)
    heads.draft_vocab = torch.tensor([2, 5, 11, 17, 23, 40, 41, 60, 77, 90])
    write_dir_atomic(tmp_path / "h", N.heads_files(heads, model))
    assert json.loads((tmp_path / "h" / N.CONFIG).read_text())["draft_vocab"] == 10
    proposer = N.load_heads_proposer(model, tmp_path / "h", readout_dtype="float32")
    assert torch.equal(proposer.vocab, heads.draft_vocab)
    drafted = []
    orig = proposer.propose

    def spy(request):
        g = orig(request)
        drafted.extend(g.tokens)
        if g.probs is not None:  # sampling: full-vocabulary distributions, zero outside the vocabulary
            assert g.probs.shape[-1] == 97 and float(g.probs.sum(-1).min()) > 0.999
            outside = torch.ones(97, dtype=torch.bool)
            outside[heads.draft_vocab] = False
            assert float(g.probs[:, outside].sum()) == 0.0
        return g

    proposer.propose = spy
    for prompt in ([5, 17, 3], [44, 2, 9, 9, 81, 30]):
        assert greedy(model, prompt, "verify:4", proposer).output == greedy(model, prompt, "ntp").output
    assert drafted and set(drafted) <= set(heads.draft_vocab.tolist())
    sampled = generate(
        model, [1, 2, 3], "verify:3", SamplingParams(temperature=0.8, seed=1, max_new_tokens=20), proposer=proposer
    )
    assert len(sampled.output) == 20


def test_draft_vocab_from_counts_targets():
    ahead = torch.tensor([[7, 1], [7, 2], [3, -1], [7, 0], [3, 4], [9, 1], [-1, -1]])
    feats = {"ahead": ahead}
    assert H.draft_vocab_from(feats, torch.arange(7), 2).tolist() == [3, 7]  # 7 x3, 3 x2, 9 x1
    assert H.draft_vocab_from(feats, torch.arange(7), 10).tolist() == [3, 7, 9]
    assert H.draft_vocab_from(feats, torch.tensor([0, 5]), 1).tolist() == [7]  # tie 7/9: lower id


def examples():
    g = torch.Generator().manual_seed(0)
    return [
        Example(
            torch.randint(0, 97, (int(p),), generator=g).tolist(), torch.randint(0, 97, (int(r),), generator=g).tolist()
        )
        for p, r in [(4, 9), (7, 3), (2, 14), (5, 1), (3, 20), (6, 12)]
    ]


def test_feature_rows_and_targets(tiny):
    exs = examples()
    feats = H.extract_features(tiny, exs, batch_size=4)
    ex = exs[0]
    seq = ex.prompt_ids + ex.response_ids
    rows = (feats["example"] == 0).nonzero().squeeze(1)
    assert len(rows) == len(ex.response_ids)  # last prompt token .. last but one response token
    _, hidden = tiny(torch.tensor([seq]), return_hidden=True)
    P = len(ex.prompt_ids)
    assert torch.allclose(feats["hidden"][rows], hidden[0, P - 1 : len(seq) - 1], rtol=1e-4, atol=1e-4)
    assert feats["ahead"][rows[0]].tolist() == seq[P : P + N.MAX_AHEAD + 1]
    assert feats["ahead"][rows[-1]].tolist() == [seq[-1]] + [-1] * N.MAX_AHEAD
    assert feats["hidden"].shape == (sum(len(e.response_ids) for e in exs), 64)


def test_hidden_state_cache_round_trip(tiny, tmp_path):
    exs = examples()
    feats, path = H.cached_features(tiny, exs, tmp_path)
    assert path.exists() and path.suffix == ".json"  # the index of the cached blocks

    class NoTrunk:  # a second call must read the cache, never run the trunk
        def __getattr__(self, name):
            return getattr(tiny, name)

        def __call__(self, *a, **k):
            raise AssertionError("trunk ran although the features were cached")

    again, path2 = H.cached_features(NoTrunk(), exs, tmp_path)
    assert path2 == path and again.keys() == feats.keys()
    assert all(torch.equal(again[k], feats[k]) for k in feats)
    other, path3 = H.cached_features(tiny, exs[:-1], tmp_path)  # other data -> other file
    assert path3 != path


def test_bf16_features_are_cached_apart_and_stay_close(tiny, tmp_path):
    """--amp extracts under bf16 autocast: its own cache key (never mixed with fp32 blocks), the same
    rows and targets, hidden states within bf16 rounding of the fp32 ones."""
    exs = examples()
    fp32, path = H.cached_features(tiny, exs, tmp_path)
    bf16, path_bf16 = H.cached_features(tiny, exs, tmp_path, amp=True)
    assert path_bf16 != path
    assert torch.equal(bf16["ahead"], fp32["ahead"]) and torch.equal(bf16["example"], fp32["example"])
    assert bf16["hidden"].dtype == torch.float32 and not torch.equal(bf16["hidden"], fp32["hidden"])
    rel = (bf16["hidden"] - fp32["hidden"]).norm() / fp32["hidden"].norm()
    assert rel < 0.05


def train_cfg(**kw):
    return H.TrainHeadsConfig(
        **{
            **dict(
                depths=2, blocks=1, width=32, steps=8, batch_size=16, lr=3e-3, save_every=3, val_fraction=0.2, warmup=2
            ),
            **kw,
        }
    )


def test_resume_after_interruption_matches_uninterrupted_run(tiny, tmp_path):
    feats = H.extract_features(tiny, examples())
    H.train_heads(tiny, feats, train_cfg(), tmp_path / "a", log=lambda m: None)

    def crash(step):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        H.train_heads(tiny, feats, train_cfg(), tmp_path / "b", log=lambda m: None, on_step=crash)
    saved = json.loads((tmp_path / "b" / H.CHECKPOINT / STATE).read_text())
    assert saved["step"] == 5
    with pytest.raises(ValueError, match="--resume"):  # no silent overwrite
        H.train_heads(tiny, feats, train_cfg(), tmp_path / "b", log=lambda m: None)
    with pytest.raises(ValueError, match="other --depths"):
        H.train_heads(tiny, feats, train_cfg(depths=3), tmp_path / "b", resume=True, log=lambda m: None)
    metrics = H.train_heads(tiny, feats, train_cfg(), tmp_path / "b", resume=True, log=lambda m: None)
    a, b = N.load_heads(tiny, tmp_path / "a"), N.load_heads(tiny, tmp_path / "b")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not (tmp_path / "b" / H.CHECKPOINT).exists()  # finished: only config + weights remain
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [N.CONFIG, N.WEIGHTS]
    assert len(metrics["val_acc_by_depth"]) == 2 and metrics["val_tokens_per_pass"] >= 1


def test_training_on_given_rows_equals_training_on_a_copy_of_them(tiny, tmp_path):
    """train_heads(rows=...) trains on those rows of the features (repeats included) without copying
    them: the same weights as training on a materialised copy that holds out nothing."""
    feats = H.extract_features(tiny, examples())
    rows = (feats["example"] != 2).nonzero().squeeze(1)
    rows = torch.cat([rows, rows[feats["example"][rows] == 4]])  # answer 4 seen twice as often
    copy = {k: v[rows] for k, v in feats.items()}
    cfg = train_cfg(val_fraction=0.0, draft_vocab=20)
    H.train_heads(tiny, copy, cfg, tmp_path / "copy", log=lambda m: None)
    H.train_heads(tiny, feats, cfg, tmp_path / "rows", log=lambda m: None, rows=rows)
    a, b = N.load_heads(tiny, tmp_path / "copy"), N.load_heads(tiny, tmp_path / "rows")
    assert torch.equal(a.draft_vocab, b.draft_vocab)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    other = train_cfg(val_fraction=0.0, draft_vocab=20, seed=1)
    H.train_heads(tiny, feats, other, tmp_path / "seed1", log=lambda m: None, rows=rows)
    c = N.load_heads(tiny, tmp_path / "seed1")
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


@pytest.mark.parametrize("bf16", [False, True])
def test_evaluate_with_a_draft_vocabulary_equals_masking_the_full_logits(tiny, bf16):
    """evaluate scores only the draft vocabulary's rows of the output head; the result equals scoring
    the full logits with every other token masked out (what the proposer can draft)."""
    feats = H.extract_features(tiny, examples())
    rows = torch.arange(len(feats["hidden"]))
    heads = random_heads(tiny, depths=3)
    heads.draft_vocab = H.draft_vocab_from(feats, rows, 12)
    full = N.bf16_readout(tiny) if bf16 else (lambda h: tiny.lm_head(tiny.norm(h)))  # noqa: E731
    got = H.evaluate(heads, tiny, feats, rows, N.bf16_readout(tiny) if bf16 else None, batch_size=7)
    with torch.no_grad():
        logits = heads(tiny, feats["hidden"], feats["ahead"][:, :3], full)
    outside = torch.ones(tiny.config.vocab_size, dtype=torch.bool)
    outside[heads.draft_vocab] = False
    ok = torch.stack(
        [lg.masked_fill(outside, float("-inf")).argmax(-1) == feats["ahead"][:, d + 1] for d, lg in enumerate(logits)],
        1,
    )
    valid = feats["ahead"][:, 1:4] >= 0
    acc = ((ok & valid).sum(0).float() / valid.sum(0).clamp(min=1)).tolist()
    full_rows = valid.all(1)
    lead = torch.cumprod((ok & valid).long(), 1).sum(1)[full_rows].float().mean()
    assert got["val_acc_by_depth"] == [round(a, 4) for a in acc]
    assert got["val_tokens_per_pass"] == round(1 + float(lead), 4)
    assert 0 < sum(acc) and got["val_rows"] == len(rows)


def test_draft_vocabulary_loss_is_the_softmax_over_it(tiny):
    """Training on a draft vocabulary: with every token in it, the same loss as the full readout; with
    a smaller one, the cross-entropy over just its rows, targets outside it left out."""
    feats = H.extract_features(tiny, examples())
    heads = random_heads(tiny, depths=2)
    rows = torch.arange(len(feats["hidden"]))
    full = lambda h: tiny.lm_head(tiny.norm(h))  # noqa: E731
    everything = torch.arange(tiny.config.vocab_size)
    a, _ = H.heads_loss(heads, tiny, feats, rows, full)
    b, _ = H.heads_loss(heads, tiny, feats, rows, full, everything)
    torch.testing.assert_close(a, b)
    vocab = H.draft_vocab_from(feats, rows, 10)
    small = lambda h: tiny.lm_head(tiny.norm(h))[:, vocab]  # noqa: E731
    loss, accs = H.heads_loss(heads, tiny, feats, rows, small, vocab)
    logits = heads(tiny, feats["hidden"], feats["ahead"][:, :2], small)
    want = []
    for d, lg in enumerate(logits, start=1):
        target = feats["ahead"][:, d]
        hit = torch.isin(target, vocab)
        want.append(torch.nn.functional.cross_entropy(lg[hit], torch.searchsorted(vocab, target[hit])))
    torch.testing.assert_close(loss, torch.stack(want).mean())
    assert all(0 <= x <= 1 for x in accs)


def test_training_learns_a_learnable_target(tiny):
    """Responses where token t is always followed by (t + 1) % 97: depth 1 should learn it."""
    g = torch.Generator().manual_seed(1)
    exs = []
    for _ in range(12):
        start = int(torch.randint(0, 97, (1,), generator=g))
        exs.append(Example([start], [(start + i) % 97 for i in range(1, 30)]))
    feats = H.extract_features(tiny, exs)
    rows, _ = H.split_rows(feats, 0.0, 0)
    cfg = train_cfg(depths=1, blocks=0, steps=150, batch_size=64, lr=1e-2, warmup=5, val_fraction=0.0)
    heads = N.MTPHeads(N.HeadsConfig.for_model(tiny.config, 1))
    before = H.evaluate(heads, tiny, feats, rows, None)["val_acc_by_depth"][0]
    torch.manual_seed(0)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        loss, _ = H.heads_loss(heads, tiny, feats, H.batch_rows(rows, step, cfg.batch_size, 0), None)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = H.evaluate(heads, tiny, feats, rows, None)["val_acc_by_depth"][0]
    assert before < 0.2 and after > 0.9


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert cli_main(["train-heads", "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtp: error:") and "\n" not in err
    assert cli_main(["train-heads", "--data", "x.jsonl", "--out", "o", "--depths", "0"]) == 2
    assert "--depths" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_shipped_heads_verify_equals_ntp(smollm2):
    """Lossless on the real model through the engine's `--proposer heads` path (the shipped heads),
    and the shipped heads do propose: more than one token per pass on a math answer."""
    from mtp.core.engine import SHIPPED, Engine, EngineConfig

    with pytest.raises(ValueError, match="another base model"):
        N.load_heads(tiny_model(0), SHIPPED["smollm2-135m"] / "heads")
    engine = Engine.load(EngineConfig(adapter="none", proposer="heads"))
    assert engine.heads_dir == SHIPPED["smollm2-135m"] / "heads"
    ids = engine.encode("Tom has 3 boxes of 12 apples. How many apples does he have?")
    params = SamplingParams(max_new_tokens=32)
    ref = smollm2.generate(ids, "ntp", params)
    got = engine.generate(ids, "verify:3", params)
    assert got.token_ids == ref.token_ids
    assert got.summary["tokens_per_forward"] > 1.2
