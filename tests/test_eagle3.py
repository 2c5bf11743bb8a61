"""EAGLE-3 drafter: lossless under verify, training-time test == drafting, resume, export round trip,
a drafter that copies the target accepted every time, and bad input in one line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import AUX, committed_kv, committed_state, examples_of, random_drafter, save_drafter, tiny_model

from mtp.cli import main
from mtp.core.decoding import tree
from mtp.core.decoding.batching import Batch
from mtp.core.decoding.decode import Sequence, decode_step, generate
from mtp.core.decoding.proposers import REGISTRY, DraftRequest, PassView
from mtp.core.decoding.proposers.eagle3 import (
    CONFIG,
    WEIGHTS,
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Proposer,
    default_aux_layers,
    load_drafter,
    load_eagle3_proposer,
)
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.runtime.artifacts import ArtifactError
from mtp.core.runtime.cache import KVCache
from mtp.interop.vllm_export import export_vllm_eagle3
from mtp.training.eagle3_train import (
    TrainEagle3Config,
    batch_examples,
    draft_vocab_from,
    evaluate,
    extract_features,
    init_drafter,
    make_batch,
    train_eagle3,
    ttt_logits,
    ttt_loss,
)
from mtp.training.trainer import use_bf16


def greedy(model, prompt, strategy, proposer=None, n=24):
    return generate(model, prompt, strategy, SamplingParams(max_new_tokens=n), proposer=proposer)


def test_aux_layers_are_the_residual_streams(tiny):
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = tiny(tokens)
    logits, hidden, aux = tiny(tokens, aux_layers=(0, 1, 2))
    assert torch.equal(logits, plain) and hidden is None
    dim = tiny.config.dim
    assert torch.equal(aux[..., :dim], tiny.embed_tokens(tokens))
    x = tiny.embed_tokens(tokens)
    cos, sin = tiny.rope(torch.arange(9).expand(2, 9))
    mask = torch.ones(9, 9, dtype=torch.bool).tril().expand(2, 1, 9, 9)
    x = tiny.layers[0](x, cos, sin, mask)
    assert torch.allclose(aux[..., dim : 2 * dim], x, atol=1e-6)
    assert default_aux_layers(30) == [2, 15, 27]
    with pytest.raises(ValueError):
        tiny(tokens, aux_layers=(5,))


@pytest.mark.parametrize("strategy", ["verify:2", "verify:3", "verify:4", "verify:6", "tree:1", "tree:4", "tree:8"])
def test_greedy_chain_or_tree_with_eagle3_equals_ntp(strategy):
    """verify:K (at most K tokens a pass) and tree:N (at most N + 1) give ntp's tokens exactly."""
    model = tiny_model(3)
    proposer = Eagle3Proposer(model, random_drafter(model))
    most = int(strategy.split(":")[1]) + strategy.startswith("tree")
    for prompt in ([5, 17, 3], [44, 2, 9, 9, 81, 30]):
        ref = greedy(model, prompt, "ntp", n=30)
        got = greedy(model, prompt, strategy, proposer, n=30)
        assert torch.equal(torch.tensor(got.output), torch.tensor(ref.output))
        assert all(c <= most for c in got.stats.chunks)
    assert proposer.draft_calls > 0


def test_trained_drafter_is_lossless_and_accepts_drafts(tmp_path):
    model = tiny_model(3)
    exs = examples_of(model, n=12, new=30)
    feats = extract_features(model, exs, AUX, dtype=torch.float32)
    cfg = TrainEagle3Config(
        aux_layers=AUX, draft_vocab=97, steps=60, batch_size=4, save_every=100, lr=3e-3, val_fraction=0.0
    )
    train_eagle3(model, feats, cfg, tmp_path / "d", log=lambda m: None)
    proposer = load_eagle3_proposer(model, tmp_path / "d")
    accepted = 0
    for ex in exs[:4]:
        ref = greedy(model, ex.prompt_ids, "ntp", n=30)
        got = greedy(model, ex.prompt_ids, "verify:4", proposer, n=30)
        assert torch.equal(torch.tensor(got.output), torch.tensor(ref.output))
        accepted += sum(c - 1 for c in got.stats.chunks[1:])
    assert accepted > 0  # it learned something of its training answers


def test_sampled_verify_with_eagle3_runs_and_proposes_inside_the_draft_vocabulary():
    model = tiny_model(3)
    d = random_drafter(model, draft_vocab=40)
    proposer = Eagle3Proposer(model, d)
    allowed = set(d.draft_ids().tolist())
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=7)
    seq = generate(model, [5, 17, 3], "verify:4", params, proposer=proposer)
    assert len(seq.output) == 30
    view_state: dict = {}
    _, _, aux = model(torch.tensor([[5, 17, 3]]), aux_layers=AUX)
    g = proposer.propose(
        DraftRequest(
            PassView([5, 17, 3, 8], torch.zeros(0, 97), None, True, aux=aux[0], start=0, state=view_state),
            3,
            False,
            params,
            torch.Generator().manual_seed(0),
        )
    )
    assert set(g.tokens) <= allowed and g.probs.shape == (3, 97)
    assert torch.allclose(g.probs.sum(-1), torch.ones(3))
    outside = torch.ones(97, dtype=torch.bool)
    outside[list(allowed)] = False
    assert float(g.probs[:, outside].abs().sum()) == 0.0


def test_sampled_verify_keeps_the_target_distribution():
    """Rejection sampling with the drafter's proposals: the first token's law equals the model's."""
    model = tiny_model(4, vocab_size=8)
    proposer = Eagle3Proposer(model, random_drafter(model, draft_vocab=5, seed=2))
    prompt = [1, 2, 3]
    probs = torch.softmax(model(torch.tensor([prompt]))[0, -1].float(), -1)
    # the second token: after the first (drawn by the model) the drafter proposes, verify decides
    n, counts = 1500, torch.zeros(8, 8)
    for s in range(n):
        out = generate(
            model, prompt, "verify:3", SamplingParams(temperature=1.0, max_new_tokens=2, seed=s), proposer=proposer
        ).output
        counts[out[0], out[1]] += 1
    want = torch.zeros(8, 8)
    for a in range(8):
        want[a] = probs[a] * torch.softmax(model(torch.tensor([prompt + [a]]))[0, -1].float(), -1)
    tv = 0.5 * float((counts / n - want).abs().sum())
    assert tv < 0.1, tv


def test_training_time_test_matches_drafting():
    """Step j of the unrolled training pass = the (j+1)-th draft when the earlier drafts were right."""
    model = tiny_model(3)
    d = random_drafter(model, draft_vocab=97)
    seq = [5, 17, 3, 44, 2, 9, 9, 81, 30, 12, 1]
    _, _, aux = model(torch.tensor([seq]), aux_layers=AUX)
    batch = {"tokens": torch.tensor([seq]), "aux": aux}
    steps = 3
    with torch.no_grad():
        ttt = ttt_logits(d, model.embed_tokens, batch, steps)
    proposer = Eagle3Proposer(model, d)
    for p in (0, 3, 6):
        state: dict = {}
        h = proposer.ingest(
            PassView(seq[: p + 2], torch.zeros(0), None, True, aux=aux[0, : p + 1], start=0, state=state)
        )
        assert torch.allclose(d.logits(h)[0, 0], ttt[0][0, p], atol=1e-4)
        pk, pv = committed_kv(state)
        for j in range(1, steps):
            if p + j + 1 >= len(seq):
                break
            h, k, v = d.step(model.embed_tokens(torch.tensor([[seq[p + j + 1]]])), h, torch.tensor([[p + j]]), pk, pv)
            pk, pv = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
            assert torch.allclose(d.logits(h)[0, 0], ttt[j][0, p], atol=1e-4)


def test_batched_rows_keep_their_own_drafter_state():
    model = tiny_model(3)
    proposer = Eagle3Proposer(model, random_drafter(model))
    prompts = [[5, 17, 3], [44, 2, 9, 9, 81, 30], [7]]
    alone = [greedy(model, p, "verify:3", proposer, n=20).output for p in prompts]
    batch = Batch(model, None, rows=3, capacity=128)
    seqs = [Sequence(p, Strategy.parse("verify:3"), SamplingParams(max_new_tokens=20), proposer) for p in prompts]
    for s in seqs:
        batch.add(s)
    with torch.inference_mode():
        while not all(s.finished for s in seqs):
            batch.step()
    assert [s.output for s in seqs] == alone


def copy_target():
    """A 0-layer target that counts (token t -> t+1 mod 48) and a drafter built to do the same:
    fc shifts the token's embedding by one, the MLP shifts by one more per step, attention is off."""
    V, dim = 48, 64
    model = tiny_model(5, n_layers=0, vocab_size=V, dim=dim, intermediate_size=dim)
    with torch.no_grad():
        model.embed_tokens.weight.zero_()
        model.embed_tokens.weight[:, :V] = torch.eye(V)
        model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :V] = torch.eye(V).roll(-1, 1)  # row t' reads coordinate t'-1
    d = Eagle3Drafter(Eagle3Config.for_model(model.config, V, (0, 0, 0)))
    shift = torch.zeros(dim, dim)
    shift[:V, :V] = torch.eye(V).roll(1, 0)  # e_t -> e_{t+1}
    with torch.no_grad():
        for p in d.parameters():
            p.zero_() if p.dim() == 2 else p.fill_(1.0)
        d.fc.weight[:, :dim] = shift
        d.midlayer.mlp.gate_proj.weight.copy_(torch.eye(dim))
        d.midlayer.mlp.up_proj.weight.copy_(torch.eye(dim))
        d.midlayer.mlp.down_proj.weight.copy_((shift - torch.eye(dim)) / dim)  # r -> ~ shift(r)
        d.lm_head.weight[:, :V] = torch.eye(V)
    d.set_vocab(torch.arange(V))
    return model, d.eval()


@pytest.mark.parametrize("k", [2, 3, 4])
def test_copy_the_target_drafter_is_accepted_every_time(k):
    model, d = copy_target()
    proposer = Eagle3Proposer(model, d)
    n = 1 + 5 * k
    got = greedy(model, [3, 14, 15], f"verify:{k}", proposer, n=n)
    assert got.output == greedy(model, [3, 14, 15], "ntp", n=n).output == [(15 + i) % 48 for i in range(1, n + 1)]
    assert got.stats.chunks == [1] + [k] * 5


def test_conf_adapt_uses_drafter_confidence():
    model, d = copy_target()
    proposer = Eagle3Proposer(model, d)
    assert REGISTRY["eagle3"].asset == "eagle3" and proposer.has_confidence
    got = generate(model, [3, 14, 15], "conf_adapt:0.5:4", SamplingParams(max_new_tokens=13), proposer=proposer)
    assert got.output == greedy(model, [3, 14, 15], "ntp", n=13).output
    strict = generate(model, [3, 14, 15], "conf_adapt:1.0:4", SamplingParams(max_new_tokens=13), proposer=proposer)
    assert max(strict.stats.chunks) == 1 and max(got.stats.chunks) > 1


def small_run(model, feats, out, steps, on_step=None, resume=False):
    cfg = TrainEagle3Config(aux_layers=AUX, draft_vocab=50, steps=steps, batch_size=3, save_every=2, lr=1e-3)
    return train_eagle3(model, feats, cfg, out, resume=resume, log=lambda m: None, on_step=on_step)


def test_bf16_autocast_step_is_the_fp32_step_in_bf16():
    """--amp: under autocast the drafter's matmuls run in bf16 and give the fp32 loss and gradient
    to bf16 precision (the weights stay fp32)."""
    model = tiny_model(3)
    model.requires_grad_(False)
    exs = examples_of(model, n=4, new=20)
    feats = extract_features(model, exs, AUX, dtype=torch.float32)
    d = init_drafter(model, Eagle3Config.for_model(model.config, 97, AUX), torch.arange(97), 0)
    batch = make_batch(feats, torch.arange(4), model.device)
    grads, losses = [], []
    for amp in (False, True):
        d.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            assert ttt_logits(d, model.embed_tokens, batch, 2)[0].dtype == (torch.bfloat16 if amp else torch.float32)
            loss, _ = ttt_loss(d, model.embed_tokens, batch, 3)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in d.parameters()]))
    assert all(p.dtype == torch.float32 for p in d.parameters())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    assert float(torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)) > 0.99


def test_amp_choice():
    assert use_bf16("on", "cpu") and not use_bf16("off", "cuda")
    assert use_bf16("auto", "cuda")
    assert use_bf16("auto", "cpu") == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    with pytest.raises(ValueError, match="--amp must be one of auto, on, off"):
        use_bf16("bf16", "cpu")


def test_resume_after_kill_equals_uninterrupted(tmp_path):
    model = tiny_model(3)
    feats = extract_features(model, examples_of(model, n=8, new=12), AUX, dtype=torch.float32)
    small_run(model, feats, tmp_path / "full", 6)

    def kill(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        small_run(model, feats, tmp_path / "cut", 6, on_step=kill)
    assert not (tmp_path / "cut" / CONFIG).exists()
    small_run(model, feats, tmp_path / "cut", 6, resume=True)
    a, b = load_drafter(model, tmp_path / "full"), load_drafter(model, tmp_path / "cut")
    for (n1, t1), (n2, t2) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1
    with pytest.raises(ValueError, match="already holds"):
        small_run(model, feats, tmp_path / "full", 6)


def test_length_grouped_batches_cover_the_epoch_and_pad_less():
    g = torch.Generator().manual_seed(0)
    n, bs = 1003, 8
    lengths = torch.randint(20, 500, (n + 7,), generator=g)  # indexed by example id
    train = torch.randperm(n + 7, generator=g)[:n]  # the training ids: not 0..n-1
    per_epoch = n // bs
    epoch0 = [batch_examples(train, s, bs, seed=1, lengths=lengths) for s in range(per_epoch)]
    seen = torch.cat(epoch0)
    assert len(seen) == len(set(seen.tolist())) == per_epoch * bs and set(seen.tolist()) <= set(train.tolist())
    epoch1 = torch.cat([batch_examples(train, per_epoch + s, bs, seed=1, lengths=lengths) for s in range(per_epoch)])
    assert len(set(epoch1.tolist())) == per_epoch * bs and not torch.equal(epoch1, seen)  # a new order each epoch
    assert torch.equal(batch_examples(train, 5, bs, 1, lengths), epoch0[5])  # resume sees the same batch

    def padded_share(batches):
        return sum(int(lengths[b].sum()) for b in batches) / sum(int(lengths[b].max()) * len(b) for b in batches)

    plain = [batch_examples(train, s, bs, seed=1) for s in range(per_epoch)]
    assert padded_share(plain) < 0.75 < 0.95 < padded_share(epoch0)


def test_draft_vocabulary_counts_answers_only(tiny):
    feats = {
        "tokens": torch.tensor([9, 9, 1, 2, 2, 9, 3, 3, 3]),
        "offsets": torch.tensor([0, 5, 9]),
        "prompt_len": torch.tensor([2, 1]),
    }
    assert draft_vocab_from(feats, torch.tensor([0, 1]), 2).tolist() == [2, 3]
    d = init_drafter(tiny, Eagle3Config.for_model(tiny.config, 2, AUX), torch.tensor([2, 3]), 0)
    assert d.draft_ids().tolist() == [2, 3] and d.d2t.tolist() == [2, 2] and d.t2d.sum() == 2
    b = make_batch({**feats, "aux": torch.zeros(9, 3)}, torch.tensor([1, 0]), "cpu", bucket=1)
    assert b["tokens"].tolist() == [[9, 3, 3, 3, 0], [9, 9, 1, 2, 2]] and b["length"].tolist() == [4, 5]
    b = make_batch({**feats, "aux": torch.zeros(9, 3)}, torch.tensor([1, 0]), "cpu", bucket=4)
    assert b["tokens"].tolist() == [[9, 3, 3, 3, 0, 0, 0, 0], [9, 9, 1, 2, 2, 0, 0, 0]]
    assert b["length"].tolist() == [4, 5] and b["aux"].shape == (2, 8, 3)


def test_shape_bucket_padding_changes_neither_loss_nor_gradient():
    """Batches are padded to a multiple of SHAPE_BUCKET (few shapes for the bf16 kernels' caches);
    the padded tail is past every length, so the loss, the accuracies and the gradient are those of
    the tight batch."""
    model = tiny_model(3)
    model.requires_grad_(False)
    exs = examples_of(model, n=3, new=11)
    feats = extract_features(model, exs, AUX, dtype=torch.float32)
    d = init_drafter(model, Eagle3Config.for_model(model.config, 97, AUX), torch.arange(97), 0)
    results = []
    for bucket in (1, 16):
        batch = make_batch(feats, torch.arange(3), model.device, bucket=bucket)
        d.zero_grad()
        loss, accs = ttt_loss(d, model.embed_tokens, batch, 3)
        loss.backward()
        results.append(
            (
                batch["tokens"].shape[1],
                float(loss.detach()),
                accs,
                torch.cat([p.grad.flatten() for p in d.parameters()]),
            )
        )
    (t1, l1, a1, g1), (t16, l16, a16, g16) = results
    assert t1 % 16 != 0 and t16 % 16 == 0 and t16 > t1
    assert l16 == pytest.approx(l1, rel=1e-5) and a16 == a1
    torch.testing.assert_close(g16, g1, rtol=1e-4, atol=1e-6)
    # held-out numbers do not depend on how much padding a batch carries
    one, three = (evaluate(d, model.embed_tokens, feats, torch.arange(3), 3, batch_size=b) for b in (1, 3))
    assert one == three


def test_export_then_reload_proposes_exactly_the_same(tmp_path):
    model = tiny_model(3, n_layers=3)  # vLLM fuses layers below the last: 0, 1, 2 of 3
    d = save_drafter(model, tmp_path / "d")
    export_vllm_eagle3(tmp_path / "d", tmp_path / "vllm")
    cfg = json.loads((tmp_path / "vllm" / CONFIG).read_text())
    assert cfg["target_num_hidden_layers"] == 3
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert cfg["draft_vocab_size"] == 60 and cfg["target_hidden_size"] == 64
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "vllm" / WEIGHTS)))
    assert {
        "fc.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "lm_head.weight",
        "d2t",
        "norm.weight",
    } <= names and not any(n.startswith("embed") for n in names)
    back = load_drafter(model, tmp_path / "vllm")
    for (n1, t1), (n2, t2) in zip(d.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1

    class Spy(Eagle3Proposer):
        def propose(self, request):
            g = super().propose(request)
            self.seen.append(list(g.tokens))
            return g

    a, b = Spy(model, d), Spy(model, back)
    a.seen, b.seen = [], []
    for p in ([5, 17, 3], [44, 2, 9]):
        greedy(model, p, "verify:4", a)
        greedy(model, p, "verify:4", b)
    assert a.seen == b.seen and len(a.seen) > 4
    # a second export may replace the first; a non-mtp folder is never overwritten
    export_vllm_eagle3(tmp_path / "d", tmp_path / "vllm")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="refusing"):
        export_vllm_eagle3(tmp_path / "d", tmp_path / "other")


def test_bad_drafters_fail_in_one_line(tmp_path):
    model = tiny_model(3, n_layers=3)
    save_drafter(model, tmp_path / "d")
    with pytest.raises(ArtifactError, match="another base model"):
        load_drafter(tiny_model(4), tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / CONFIG).read_text())
    save_drafter(model, tmp_path / "v")
    (tmp_path / "v" / CONFIG).write_text(json.dumps({**cfg, "vocab_size": 50}))
    with pytest.raises(ArtifactError, match="vocabulary"):
        load_drafter(model, tmp_path / "v")
    # a model whose MTP adapter appended <mtp_mask> as its last id still takes a drafter of the base vocabulary
    d = random_drafter(model)
    d.set_vocab(torch.arange(60))  # never the last id
    save_drafter(model, tmp_path / "m", d)
    cfg_m = json.loads((tmp_path / "m" / CONFIG).read_text())
    (tmp_path / "m" / CONFIG).write_text(json.dumps({**cfg_m, "vocab_size": model.config.vocab_size - 1}))
    with pytest.raises(ArtifactError, match="vocabulary"):
        load_drafter(model, tmp_path / "m")  # no mask token: one id short is a wrong vocabulary
    model.config.mask_token_id = model.config.vocab_size - 1
    assert load_drafter(model, tmp_path / "m").config.vocab_size == model.config.vocab_size - 1
    model.config.mask_token_id = None
    save_drafter(model, tmp_path / "c")
    raw = (tmp_path / "c" / WEIGHTS).read_bytes()
    (tmp_path / "c" / WEIGHTS).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ArtifactError, match="safetensors"):
        load_drafter(model, tmp_path / "c")
    with pytest.raises(ArtifactError, match="safetensors"):
        export_vllm_eagle3(tmp_path / "c", tmp_path / "x")
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "heads.safetensors").write_bytes(b"")
    with pytest.raises(ArtifactError, match="no format"):
        export_vllm_eagle3(tmp_path / "h", tmp_path / "x")


def test_cli_bad_input_is_one_line(tiny_hf_dir, tmp_path, capsys):
    from mtp.core.runtime import loading

    model = loading.load(str(tiny_hf_dir)).model
    save_drafter(model, tmp_path / "good", random_drafter(model, draft_vocab=500))
    other = tiny_model(9, vocab_size=49152)
    save_drafter(other, tmp_path / "other", random_drafter(other, draft_vocab=500))
    base = [
        "generate",
        "--model",
        str(tiny_hf_dir),
        "--adapter",
        "none",
        "--proposer",
        "eagle3",
        "--strategy",
        "verify:3",
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
        "hello",
    ]
    assert main(base + ["--eagle3", str(tmp_path / "good")]) == 0
    capsys.readouterr()
    for bad, needle in ((tmp_path / "other", "another base model"), (tmp_path / "missing", "not found")):
        assert main(base + ["--eagle3", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("mtp: error:") and needle in err, err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    assert (
        main(
            ["export", "--format", "vllm-eagle3", "--drafter", str(tmp_path / "good"), "--out", str(tmp_path / "mine")]
        )
        == 2
    )
    assert (
        main(
            [
                "train-eagle3",
                "--model",
                str(tiny_hf_dir),
                "--examples",
                str(tmp_path / "x.jsonl"),
                "--out",
                str(tmp_path / "mine"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("mtp: error:") for e in err)
    # --resume with nothing to resume fails before the examples are read (a feature pass can take hours)
    assert (
        main(
            [
                "train-eagle3",
                "--model",
                str(tiny_hf_dir),
                "--examples",
                str(tmp_path / "x.jsonl"),
                "--out",
                str(tmp_path / "new"),
                "--resume",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--resume: no checkpoint in" in err and "drop --resume" in err, err


def test_cli_train_export_generate(tiny_hf_dir, tmp_path, capsys):
    ids = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12]]
    with open(tmp_path / "ex.jsonl", "w") as f:
        for p in ids:
            f.write(json.dumps({"prompt_ids": p, "response_ids": p[::-1] * 3}) + "\n")
    out = tmp_path / "drafter"
    assert (
        main(
            [
                "train-eagle3",
                "--model",
                str(tiny_hf_dir),
                "--examples",
                str(tmp_path / "ex.jsonl"),
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--draft-vocab",
                "16",
                "--val-fraction",
                "0",
                "--cache-dir",
                str(tmp_path / "cache"),
                "--threads",
                "1",
                "--amp",
                "on",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads((out / CONFIG).read_text())["meta"]["train"]["amp"] is True  # the run records its compute
    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_hf_dir),
                "--adapter",
                "none",
                "--proposer",
                "eagle3",
                "--eagle3",
                str(out),
                "--strategy",
                "verify:3",
                "--max-new-tokens",
                "6",
                "--threads",
                "1",
                "hi",
            ]
        )
        == 0
    )
    capsys.readouterr()
    # a 2-layer trunk has no three distinct layers below its last: vLLM could not feed this drafter
    assert main(["export", "--format", "vllm-eagle3", "--drafter", str(out), "--out", str(tmp_path / "v")]) == 2
    assert "ascending" in capsys.readouterr().err


def test_vllm_peers_are_named_and_skipped_with_a_hint_without_vllm(monkeypatch, tmp_path):
    from mtp.eval.peers import make_peer, parse_baselines

    monkeypatch.setenv("MTP_VLLM_PYTHON", str(tmp_path / "no-python"))
    assert parse_baselines("vllm,vllm-ngram,vllm-eagle3:d") == ["vllm", "vllm-ngram", "vllm-eagle3:d"]
    for bad in ("vllm:x", "sglang"):
        with pytest.raises(ValueError, match="unknown baseline"):
            parse_baselines(bad)
    with pytest.raises(ValueError, match="needs its drafter folder: vllm-eagle3:DIR"):
        parse_baselines("vllm-eagle3")
    peer = make_peer("vllm-eagle3:d")
    assert peer.name == "vllm-eagle3:d" and peer.arg == "d" and "make vllm" in peer.missing()
    assert make_peer("vllm-ngram").speculative_config()["method"] == "ngram"


@pytest.mark.slow
def test_smollm2_eagle3_verify_equals_ntp(smollm2):
    """The real model, default layers 2/15/27: lossless with a fresh (untrained) drafter."""
    model = smollm2.model
    vocab = torch.arange(1000)
    d = init_drafter(model, Eagle3Config.for_model(model.config, len(vocab)), vocab, seed=0)
    assert d.config.aux_layers == [2, 15, 27]
    proposer = Eagle3Proposer(model, d)
    ids = smollm2.encode("What is 12 times 7?")
    ref = generate(model, ids, "ntp", SamplingParams(max_new_tokens=24), eos_ids=smollm2.loaded.eos_ids)
    got = generate(
        model, ids, "verify:4", SamplingParams(max_new_tokens=24), proposer=proposer, eos_ids=smollm2.loaded.eos_ids
    )
    assert torch.equal(torch.tensor(got.output), torch.tensor(ref.output))


@pytest.mark.slow
def test_smollm2_shipped_drafter_verify_equals_ntp(smollm2):
    """The shipped EAGLE-3 drafter through `--proposer eagle3` (the default 'auto' finds it): lossless on
    the real model, and it does propose: more than one token per pass on a math answer. An engine
    loaded for another proposer (the mask adapter, whose <mtp_mask> extends the vocabulary by one)
    loads the drafter and the heads on first use, so one run can compare them all."""
    from mtp.core.engine import SHIPPED, Engine, EngineConfig

    engine = Engine.load(EngineConfig(adapter="none", proposer="eagle3"))
    assert engine.asset_dirs.get("eagle3") == SHIPPED["smollm2-135m"] / "eagle3"
    ids = engine.encode("Tom has 3 boxes of 12 apples. How many apples does he have?")
    params = SamplingParams(max_new_tokens=32)
    ref = smollm2.generate(ids, "ntp", params)
    got = engine.generate(ids, "verify:4", params)
    assert got.token_ids == ref.token_ids
    assert got.summary["tokens_per_forward"] > 1.2
    mixed = Engine.load(EngineConfig(adapter="auto"))  # proposer: mask
    assert mixed.asset_dirs == {}
    for name in ("eagle3", "heads", "mask"):
        seq = mixed.new_sequence(ids, "verify:4", params, name)
        for _ in mixed.stream(seq):
            pass
        assert mixed.result(seq).token_ids == ref.token_ids, name
    assert set(mixed.asset_dirs) == {"eagle3", "heads"}


# ---- token trees (`tree:N`, mtp.core.decoding.tree) ---------------------------------------------------------


def branching_copy_target(scale=0.5):
    """copy_target with a drafter still always right but only ~half sure (logits scaled down), so the
    best trees branch at depth 1 and the accepted path runs off the diagonal, and with live attention,
    so its KV depends on the features it was fed."""
    model, d = copy_target()
    g = torch.Generator().manual_seed(0)
    a = d.midlayer.self_attn
    with torch.no_grad():
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
            lin.weight.normal_(std=0.02, generator=g)
        d.lm_head.weight.mul_(scale)
    return model, d


def assert_state_is_the_committed_prefix(model, proposer, seq, n):
    want = committed_state(model, proposer, seq.prompt_ids + seq.output, n)
    got = seq.proposer_state
    assert got["len"] == want["len"] == n
    for a, b in zip(committed_kv(got), committed_kv(want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["h"], want["h"], rtol=1e-4, atol=1e-4)


def test_eagle3_tree_is_the_most_probable_paths_and_leaves_the_state_alone():
    model, d = branching_copy_target()
    proposer = Eagle3Proposer(model, d)
    prompt = [3, 14, 15]
    committed = committed_state(model, proposer, prompt + [16], 3)
    state, kept = dict(committed), committed_kv(committed)[0].clone()
    t = proposer.propose(
        DraftRequest(PassView(prompt + [16], torch.zeros(0), None, True, start=3, state=state), 8, True)
    )
    # the right chain 17, 18, 19 ... at ~0.5, 0.25, 0.12; depth 1's runners-up join once the chain gets less likely
    assert len(t.tokens) == 8 and t.tokens[0] == 17 and 0.4 < t.confidences[0] < 0.6
    assert t.parents.count(-1) > 1 and tree.depths(t.parents)[:2] == [1, 1]
    assert all(c <= t.confidences[p] + 1e-9 for c, p in zip(t.confidences, t.parents) if p >= 0)
    chain = [t.tokens[j] for j in tree.ancestors(t.parents, max(range(8), key=lambda j: tree.depths(t.parents)[j]))]
    assert chain == list(range(17, 17 + len(chain))) and len(chain) >= 3
    assert state["len"] == 3 and torch.equal(committed_kv(state)[0], kept)  # the scratch KV stayed scratch


def test_eagle3_tree_node_confidence_is_its_path_drafted_as_a_chain():
    """Tree attention inside the drafter: every node's confidence equals the probability of its root
    path computed one token at a time with plain causal steps (what `propose` would do on that path)."""
    model = tiny_model(3)
    d = random_drafter(model, draft_vocab=97)
    d.lm_head.weight.mul_(3)  # more decisive: deeper trees
    proposer = Eagle3Proposer(model, d)
    context = [44, 2, 9, 9, 81, 30]
    committed = committed_state(model, proposer, context, 5)
    t = proposer.propose(
        DraftRequest(PassView(context, torch.zeros(0), None, True, start=5, state=dict(committed)), 12, True)
    )
    assert len(t.tokens) == 12 and max(tree.depths(t.parents)) >= 3
    for j in range(12):
        (pk, pv), h, p = committed_kv(committed), committed["h"], 1.0
        for depth, node in enumerate(tree.ancestors(t.parents, j), 1):
            tok = t.tokens[node]
            p *= float(torch.softmax(d.logits(h)[0, 0], -1)[int((d.draft_ids() == tok).nonzero())])
            if node != j:
                h, k, v = d.step(model.embed_tokens(torch.tensor([[tok]])), h, torch.tensor([[4 + depth]]), pk, pv)
                pk, pv = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        assert abs(t.confidences[j] - p) < 1e-4 * max(p, 1e-3), (j, t.confidences[j], p)


def test_eagle3_tree_drafter_state_follows_the_accepted_path_only(monkeypatch):
    """After every tree pass the drafter's KV equals feeding the committed tokens alone: a rejected
    branch's entries (or features gathered from the wrong block rows) would show up here."""
    paths = []
    accept = tree.accept

    def spy(*args):
        path, own = accept(*args)
        paths.append(path)
        return path, own

    monkeypatch.setattr(tree, "accept", spy)
    model, d = branching_copy_target()
    proposer = Eagle3Proposer(model, d)
    prompt = [3, 14, 15]
    seq = Sequence(prompt, Strategy.parse("tree:8"), SamplingParams(max_new_tokens=30), proposer)
    cache = KVCache.for_model(model, 1, 64)
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)
            if not seq.finished:  # (a last pass may cut its tokens at max_new_tokens)
                assert_state_is_the_committed_prefix(model, proposer, seq, cache.lengths[0])
    assert seq.output == greedy(model, prompt, "ntp", n=30).output
    assert any(len(p) > 1 and p != list(range(len(p))) for p in paths), paths  # deep and off the diagonal


def test_ragged_batch_of_eagle3_trees_equals_ntp_and_keeps_each_rows_state():
    model = tiny_model(3)
    proposer = Eagle3Proposer(model, random_drafter(model))
    prompts = [[5, 17, 3], [44, 2, 9, 9, 81, 30], [7]]
    wants = [greedy(model, p, "ntp", n=20).output for p in prompts]
    seqs = [
        Sequence(p, Strategy.parse(s), SamplingParams(max_new_tokens=20), proposer, slot=i)
        for i, (p, s) in enumerate(zip(prompts, ["tree:6", "tree:2", "verify:3"]))
    ]
    cache = KVCache.for_model(model, 3, 64)
    with torch.inference_mode():
        while not all(s.finished for s in seqs):
            live = [s for s in seqs if not s.finished]
            decode_step(model, cache, live, None)
            for s in live:
                if not s.finished:
                    assert_state_is_the_committed_prefix(model, proposer, s, cache.lengths[s.slot])
    assert [s.output for s in seqs] == wants


@pytest.mark.parametrize("strategy", ["tree:4", "tree:auto"])
def test_eagle3_tree_follows_its_sequence_through_capped_and_sized_passes(strategy):
    """A scheduler's cap to K = 1 (no drafts) still feeds the drafter what the pass committed, and
    `tree:auto` keeps a prefix of its nodes: both stay equal to ntp."""
    model = tiny_model(3)
    proposer = Eagle3Proposer(model, random_drafter(model))
    seq = Sequence(
        [5, 17, 3],
        Strategy.parse(strategy),
        SamplingParams(max_new_tokens=30),
        proposer,
        pass_time=lambda q: 1 + 0.05 * q,
    )
    cache = KVCache.for_model(model, 1, 128)
    with torch.inference_mode():
        while not seq.finished:
            seq.k_override = 1 if seq.stats.forward_passes % 3 == 1 else None
            decode_step(model, cache, [seq], None)
    assert seq.output == greedy(model, [5, 17, 3], "ntp", n=30).output


def test_sampled_eagle3_tree_makes_the_same_draws_as_plain_sampling():
    model = tiny_model(3)
    proposer = Eagle3Proposer(model, random_drafter(model))
    for seed in range(5):
        p = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=seed)
        want = generate(model, [5, 17, 3], "ntp", p).output
        assert generate(model, [5, 17, 3], "tree:6", p, proposer=proposer).output == want
