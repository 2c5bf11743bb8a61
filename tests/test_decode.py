"""The decoding loop: exact tokens with stub logits, lossless `verify` on real models, KV rollback,
EOS / stop strings inside accepted blocks, max_new_tokens, rejection sampling."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from helpers import SCRIPT_MASK as MASK
from helpers import SCRIPT_TARGET as TARGET
from helpers import Oracle, ScriptedModel, mask_model, tiny_model

from mtp.core.decoding.decode import Sequence, _branch_layout, decode_step, generate
from mtp.core.decoding.proposers import Guesses, MaskProposer, PromptLookupProposer
from mtp.core.decoding.sampling import SamplingParams, verify_drafts
from mtp.core.decoding.strategy import Strategy, StrategyError, expand_sweep
from mtp.core.runtime.cache import KVCache


class StubModel(ScriptedModel):
    """Fixed logits (litgpt-style): a real token at position p predicts TARGET[p+1]; the j-th mask
    after it predicts TARGET[p+1] when j <= `good_depth` (else a wrong token), with confidence
    `conf[j]`. Drafts are therefore accepted exactly up to `good_depth`."""

    def __init__(self, good_depth: int, conf=(0.99,) * 16):
        super().__init__()
        self.good_depth, self.conf = good_depth, conf

    def script(self, logits, tokens, positions, attn_mask, cache_positions):
        B, T = tokens.shape
        for b in range(B):
            depth = 0
            for t in range(T):
                p = int(positions[b, t])
                if int(tokens[b, t]) == MASK:
                    # a mask group (mtp.core.decoding.decode's branched layout) restarts where the positions step back
                    depth = depth + 1 if t > 0 and p == int(positions[b, t - 1]) + 1 else 1
                    good = depth <= self.good_depth
                    tok = TARGET[p + 1] if good else (TARGET[p + 1] + 1) % 40
                    c = self.conf[depth - 1]
                else:
                    depth, tok, c = 0, TARGET[p + 1], 0.999
                # two-way split so the top-1 probability is exactly c
                logits[b, t, tok] = 0.0
                logits[b, t, 45] = torch.log(torch.tensor((1 - c) / c))


def run_stub(strategy, good_depth, max_new=13, conf=(0.99,) * 16, eos=(), branch=True):
    stub = StubModel(good_depth, conf)
    seq, cache = stub.run(strategy, max_new, eos, branch)
    return seq, cache, stub


@pytest.mark.parametrize(
    "good_depth, branch, chunks",
    [
        (3, True, [1, 4, 4, 4]),  # always accepted: 3 drafts + the model's own token per pass
        (3, False, [1, 4, 4, 4]),
        (0, True, [1] * 13),  # never accepted
        # first draft accepted, second rejected: the mask group after draft 1 gives the next drafts
        (1, True, [1] + [2] * 6),
        # without branching the masks sat behind the rejected draft and saw a wrong prefix, so the next
        # pass has no drafts and only proposes again
        (1, False, [1, 2, 1, 2, 1, 2, 1, 2, 1]),
    ],
)
def test_verify_stub_exact(good_depth, branch, chunks):
    seq, cache, _ = run_stub("verify:4", good_depth, branch=branch)
    assert seq.output == TARGET[5:18]  # lossless whatever the proposals
    assert seq.stats.chunks == chunks
    assert seq.finish_reason == "length"


def test_verify_commits_only_accepted_positions():
    seq, cache, stub = run_stub("verify:3", good_depth=1, max_new=5, branch=False)
    # prefill: 5 prompt tokens + 2 masks -> commits the 5; a later pass commits pending + accepted drafts
    assert stub.calls[0].tolist() == [TARGET[:5] + [MASK, MASK]]
    assert stub.calls[1].tolist() == [[TARGET[5], TARGET[6], (TARGET[7] + 1) % 40, MASK, MASK]]
    # committed: prompt 5; [t5, t6] (pending + 1 accepted); [t7] (no drafts); [t8, t9]
    assert cache.lengths[0] == 5 + 2 + 1 + 2


def test_verify_branched_block_layout():
    seq, cache, stub = run_stub("verify:3", good_depth=1, max_new=5)
    wrong7 = (TARGET[7] + 1) % 40
    # pass 2: pending t5, drafts t6 and a wrong t7, then mask groups after both drafts, after none, after t6
    assert stub.calls[1].tolist() == [[TARGET[5], TARGET[6], wrong7] + [MASK] * 6]
    assert stub.positions[1].tolist() == [[5, 6, 7, 8, 9, 6, 7, 7, 8]]
    # one draft accepted -> the group after t6 proposed t8 (right) and a wrong t9: pass 3 checks them
    assert stub.calls[2].tolist()[0][:3] == [TARGET[7], TARGET[8], (TARGET[9] + 1) % 40]
    assert seq.output == TARGET[5:10] and seq.stats.chunks == [1, 2, 2]
    # committed: prompt 5; [t5, t6]; [t7, t8]
    assert cache.lengths[0] == 5 + 2 + 2


def test_static_emits_unverified_guesses_exactly():
    seq, _, _ = run_stub("static:3", good_depth=1, max_new=6)
    wrong = lambda p: (TARGET[p] + 1) % 40  # noqa: E731
    # each pass: the model's token, a right guess, a wrong guess; positions continue after them
    assert seq.output == [TARGET[5], TARGET[6], wrong(7), TARGET[8], TARGET[9], wrong(10)]
    assert seq.stats.chunks == [3, 3]


def test_conf_adapt_keeps_confident_prefix():
    seq, _, _ = run_stub("conf_adapt:0.9:4", good_depth=3, max_new=9, conf=(0.95, 0.5, 0.99))
    assert seq.stats.chunks == [2, 2, 2, 2, 1]  # model token + first mask; the second is unsure
    assert seq.output == TARGET[5:14]


def test_conf_adapt_emits_one_token_when_nothing_is_confident():
    seq, _, _ = run_stub("conf_adapt:0.9999", good_depth=3, max_new=4)
    assert seq.stats.chunks == [1, 1, 1, 1]


def test_eos_inside_accepted_block_ends_exactly_there():
    eos = TARGET[9]
    seq, _, _ = run_stub("verify:4", good_depth=3, max_new=40, eos=[eos])
    assert seq.output == TARGET[5:9] and seq.finish_reason == "stop"


def test_max_new_tokens_never_exceeded_mid_block():
    for n in (1, 2, 3, 6, 7):
        seq, _, _ = run_stub("static:4", good_depth=3, max_new=n)
        assert len(seq.output) == n and seq.finish_reason == "length"


def test_stop_string_inside_block_cuts_output():
    text = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # noqa: E731
    stub = StubModel(3)
    seq = Sequence(
        TARGET[:5],
        Strategy.parse("verify:4"),
        SamplingParams(max_new_tokens=30, stop=[text(TARGET[8:10])]),
        MaskProposer(),
        decode_text=text,
    )
    cache = KVCache(1, 1, 1, 64, 1)
    while not seq.finished:
        decode_step(stub, cache, [seq], MASK)
    assert seq.finish_reason == "stop"
    assert seq.output == TARGET[5:8] and seq.text == text(TARGET[5:8])


# --- real (tiny random) models: verify output == ntp output, token for token -----------------


@pytest.mark.parametrize("k", [2, 3, 4, 8])
@pytest.mark.parametrize("proposer", ["mask", "lookup"])
@pytest.mark.parametrize("weights", ["plain", "torch", "float32"])
def test_verify_equals_ntp_tiny(k, proposer, weights):
    model = mask_model()
    if weights != "plain":  # torch: oneDNN-packed; float32: the batch-invariant kernels
        from mtp.core.runtime.weights import attach

        attach(model, weights)
    prop = MaskProposer() if proposer == "mask" else PromptLookupProposer()
    for seed in range(3):
        prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = generate(model, prompt, "ntp", SamplingParams(max_new_tokens=40))
        out = generate(model, prompt, f"verify:{k}", SamplingParams(max_new_tokens=40), proposer=prop)
        assert torch.equal(torch.tensor(out.output), torch.tensor(ref.output))
        if proposer == "lookup":  # random tiny models loop, so lookup drafts do get accepted
            assert out.stats.forward_passes <= ref.stats.forward_passes


def test_batched_ragged_rows_equal_single_rows():
    model = mask_model(1)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [1, 2], [4, 4, 2, 9]]
    strategies = ["ntp", "verify:3", "static:2", "verify:4"]  # verify:4 with branched mask groups
    singles = [
        generate(
            model,
            p,
            s,
            SamplingParams(max_new_tokens=12),
            proposer=PromptLookupProposer() if s == "verify:3" else MaskProposer(),
        ).output
        for p, s in zip(prompts, strategies)
    ]
    cache = KVCache.for_model(model, 4, 64)
    seqs = [
        Sequence(
            p,
            Strategy.parse(s),
            SamplingParams(max_new_tokens=12),
            PromptLookupProposer() if s == "verify:3" else MaskProposer(),
            slot=i,
        )
        for i, (p, s) in enumerate(zip(prompts, strategies))
    ]
    with torch.inference_mode():
        while not all(s.finished for s in seqs):
            decode_step(model, cache, [s for s in seqs if not s.finished], model.config.mask_token_id)
    for s, ref in zip(seqs, singles):
        assert s.output == ref


def test_kv_rollback_then_rerun_matches_fresh_forward():
    model = tiny_model(3)
    tokens = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(4))
    cache = KVCache.for_model(model, 1, 32)
    model(tokens[:, :6], torch.arange(6).view(1, 6), cache=cache)
    cache.commit(0, 4)  # keep 4, reject positions 4-5
    other = torch.tensor([[3, 1, 4, 1, 5, 9]])
    got = model(other, torch.arange(4, 10).view(1, 6), cache=cache)  # re-run over the rejected slots
    cache.commit(0, 6)
    fresh = model(torch.cat([tokens[:, :4], other], 1))[:, 4:]
    torch.testing.assert_close(got, fresh, rtol=1e-5, atol=1e-5)
    assert cache.lengths[0] == 10
    cache.rollback(0, 2)
    assert cache.lengths[0] == 2
    with pytest.raises(ValueError):
        cache.rollback(0, 5)


def test_sampling_is_reproducible_with_seed():
    model = mask_model()
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=7, max_new_tokens=20)
    a = generate(model, [1, 2, 3], "verify:3", p).output
    b = generate(model, [1, 2, 3], "verify:3", p).output
    assert a == b and len(a) == 20


def test_rejection_sampling_preserves_target_distribution():
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(2, 6, generator=g) * 2
    q = torch.softmax(torch.randn(6, generator=g) * 2, -1)
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(p_logits[0], -1)
    counts = torch.zeros(6)
    n = 20000
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        a, own = verify_drafts(p_logits, [d], q.unsqueeze(0), params, g)
        counts[d if a == 1 else own] += 1
    assert (counts / n - p).abs().max() < 0.015


def test_strategy_parsing():
    assert Strategy.parse("conf_adapt:0.9") == Strategy("conf_adapt", 16, 0.9)
    assert Strategy.parse("conf_adapt:0.9:4").k == 4
    assert str(Strategy.parse("verify:4")) == "verify:4"
    assert [str(s) for s in expand_sweep("conf_adapt:0.99,0.9,static:1..3")] == [
        "conf_adapt:0.99",
        "conf_adapt:0.9",
        "static:1",
        "static:2",
        "static:3",
    ]
    for bad in [
        "",
        "fast",
        "verify",
        "verify:0",
        "static:-1",
        "conf_adapt:0",
        "conf_adapt:1.5",
        "verify:x",
        "conf_adapt:0.9:0",
        "ntp:3",
    ]:
        with pytest.raises(StrategyError):
            Strategy.parse(bad)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_verify_equals_ntp_smollm2(smollm2, k):
    ids = smollm2.encode("List the first ten prime numbers, separated by commas.")
    ref = smollm2.generate(ids, "ntp", SamplingParams(max_new_tokens=48))
    smollm2.config.proposer = "lookup"
    try:
        out = smollm2.generate(ids, f"verify:{k}", SamplingParams(max_new_tokens=48))
    finally:
        smollm2.config.proposer = "mask"
    assert out.token_ids == ref.token_ids
    assert out.summary["forward_passes"] <= ref.summary["forward_passes"]


@pytest.mark.parametrize("weights", ["plain", "torch", "float32"])
def test_branched_mask_groups_equal_separate_passes(weights):
    """Group a of a branched verify pass gives the logits the masks would give right after draft a
    (on the batch-invariant kernels, `float32`: the same bits)."""
    model = mask_model(2)
    if weights != "plain":
        from mtp.core.runtime.weights import attach

        attach(model, weights)
    tol = dict(rtol=0, atol=0) if weights == "float32" else dict(rtol=1e-4, atol=1e-4)
    mid = model.config.mask_token_id
    prompt, pending, drafts, g = [5, 9, 2, 7, 1], [3], [8, 4, 6], 3
    cache = KVCache.for_model(model, 1, 64)
    with torch.inference_mode():
        model(torch.tensor([prompt]), torch.arange(5).view(1, 5), cache=cache)
        cache.commit(0, 5)
        seq = Sequence(prompt, Strategy.parse("verify:4"), SamplingParams(), MaskProposer())
        seq.pending, seq.drafts = pending, Guesses(drafts, [1.0] * len(drafts))
        assert seq.n_appended() == g * 4 and seq.groups() == 4
        block = pending + drafts + [mid] * seq.n_appended()
        slots = 5 + torch.arange(len(block)).view(1, -1)
        positions, attn = _branch_layout([seq], slots, [True])
        got = model(torch.tensor([block]), positions, cache=cache, attn_mask=attn, cache_positions=slots)[0]
        for a in range(4):  # a accepted drafts; a == 3: the group right after the drafts
            first = 4 + (0 if a == 3 else g * (1 + a))
            ref = model(torch.tensor([prompt + pending + drafts[:a] + [mid] * g]))[0, -g:]
            torch.testing.assert_close(got[first : first + g], ref, **tol)
        # the draft rows are the plain causal pass's rows
        ref = model(torch.tensor([prompt + pending + drafts]))[0, 5:]
        torch.testing.assert_close(got[:4], ref, **tol)


# --- seeded sampling: lossless strategies draw ntp's samples, draw for draw (issue 64, S1) -----------


def _capped(model, prompt, strategy, params, proposer, caps):
    """Decode alone with the block size capped pass by pass from `caps` (None: uncapped), as the
    server's adaptive policy caps K."""
    seq = Sequence(prompt, Strategy.parse(strategy), params, proposer)
    cache = KVCache.for_model(model, 1, len(prompt) + params.max_new_tokens + 64)
    with torch.inference_mode():
        for cap in caps:
            if seq.finished:
                break
            seq.k_override = cap
            decode_step(model, cache, [seq], model.config.mask_token_id)
    return seq


def knows(truth: list[int], prompt_len: int) -> Oracle:
    """Drafts the continuation it is told (`truth`, after a prompt of `prompt_len` tokens), every third
    pass with its second guess wrong: under sampling, drafts that match the model's samples."""
    return Oracle(truth, prompt_len, wrong_every=3, name="knows")


@pytest.mark.parametrize("proposer", ["mask", "lookup", "knows"])
def test_seeded_lossless_sampling_equals_ntp_draw_for_draw(proposer):
    """Under a seed, `verify:K` and `tree:N` emit exactly ntp's sampled tokens whatever K, and also when
    K changes from pass to pass (the server's adaptive caps), alone or batched with other rows: a draft
    is accepted iff it equals the model's own sample at its position, drawn as ntp draws it."""
    model = mask_model()
    caps = [None, 1, 3, 2, None, 1, 4, 2] * 10
    multi = 0  # passes that emitted more than one token: drafts were really accepted
    for seed in range(2):
        prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        params = SamplingParams(temperature=0.8, top_k=40, seed=5 + seed, max_new_tokens=30)
        ref = generate(model, prompt, "ntp", params).output
        make = {"mask": MaskProposer, "lookup": PromptLookupProposer, "knows": partial(knows, ref, len(prompt))}
        for strategy in ("verify:3", "verify:6", "tree:5"):
            out = generate(model, prompt, strategy, params, proposer=make[proposer]())
            assert out.output == ref, (seed, strategy)
            multi += sum(c > 1 for c in out.stats.chunks)
            capped = _capped(model, prompt, strategy, params, make[proposer](), caps)
            assert capped.output == ref, (seed, strategy, "capped")
    assert multi > 0 or proposer != "knows"
    # batched: the same seeded request beside other rows (another seed, other strategies) in one cache
    prompt = [5, 6, 7, 5, 6, 7, 5]
    params = [SamplingParams(temperature=0.8, seed=s, max_new_tokens=30) for s in (5, 6, 5)]
    refs = [generate(model, prompt, "ntp", p).output for p in params]
    cache = KVCache.for_model(model, 3, 128)
    make = {"mask": MaskProposer, "lookup": PromptLookupProposer}.get(proposer)
    seqs = [
        Sequence(prompt, Strategy.parse(s), p, make() if make else knows(ref, len(prompt)), slot=i)
        for i, (s, p, ref) in enumerate(zip(["verify:4", "verify:3", "tree:4"], params, refs))
    ]
    with torch.inference_mode():
        while not all(s.finished for s in seqs):
            decode_step(model, cache, [s for s in seqs if not s.finished], model.config.mask_token_id)
    assert [s.output for s in seqs] == refs
    assert refs[0] != refs[1]  # the seed is used: the check can fail


def test_matched_verification_accepts_a_draft_with_its_probability():
    """Deterministic drafts are matched against the model's own sample: accepted with probability
    p(d) (rejection sampling's min(1, p/q) for a one-hot q), and the emitted token is distributed as p."""
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(2, 6, generator=g) * 2
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(p_logits[0], -1)
    d = int(p.argmax())
    n, hits = 10000, 0
    counts = torch.zeros(6)
    for _ in range(n):
        a, own = verify_drafts(p_logits, [d], None, params, g)
        hits += a
        counts[d if a == 1 else own] += 1
    assert abs(hits / n - float(p[d])) < 0.02
    assert (counts / n - p).abs().max() < 0.02


def test_argmax_is_torchs_argmax_on_every_kind_of_row():
    """`sampling.argmax` (numpy on CPU float32 rows) picks what torch.argmax picks: the first of equal
    maxima, a NaN as the largest, all -inf rows, random rows of a large vocabulary, one row or many."""
    from mtp.core.decoding.sampling import argmax

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, nan, 3.0, nan], [2.0, 5.0, 5.0, -inf], [-inf] * 4, [0.0, -0.0, 0.0, -1.0]])
    big = torch.randn(7, 49152, generator=torch.Generator().manual_seed(0)).round(decimals=1)  # many ties
    for x in (rows, big, big[3], big[:, :100].t().contiguous()):
        got = argmax(x)
        assert got.dtype == torch.long and torch.equal(got, torch.argmax(x, -1))
