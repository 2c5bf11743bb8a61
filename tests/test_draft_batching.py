"""Rows of a pass that share the heads draft together (`Proposer.prepare` / `draft_prepared`): one head
and readout call per depth for the whole batch, and every row gets the guesses it would have drafted alone.

CPU GEMM kernels are not batch-invariant (a [1, dim] row and the same row inside a [4, dim] block may be
summed in another order, last-bit differences), so the exact draft-for-draft checks run the heads row by
row inside the batched call (`rowwise`): any difference left is a batching bug (wrong rows gathered, split
or grown). With the plain heads, decoding is still checked against `ntp` token for token."""

from __future__ import annotations

import pytest
import torch
from helpers import random_heads, tiny_model

from mtp.core.decoding import decode
from mtp.core.decoding.decode import Sequence, decode_step, generate
from mtp.core.decoding.proposers import DraftRequest, MergedProposer, PassView, PromptLookupProposer
from mtp.core.decoding.proposers import heads as N
from mtp.core.decoding.proposers.base import WrappedProposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.policy.calibration import CalibratedProposer, Calibration
from mtp.core.runtime.cache import KVCache

V = 97


def heads_proposer(model, depths=3, vocab=None, dtype="float32", seed=0):
    heads = random_heads(model, depths, seed=seed)
    heads.draft_vocab = vocab
    return N.HeadsProposer(model, heads, dtype)


def rowwise(prop: N.HeadsProposer) -> N.HeadsProposer:
    """`prop` with every head and the readout applied one row at a time (batch-invariant arithmetic);
    `prop.depth_calls` counts the head calls."""
    prop.depth_calls = 0
    for head in prop.heads.depths:

        def one_by_one(h, emb, f=head.forward):  # h, emb: [F, dim] -> [F, dim]
            prop.depth_calls += 1
            return torch.cat([f(h[j : j + 1], emb[j : j + 1]) for j in range(h.shape[0])])

        head.forward = one_by_one
    readout = prop.readout
    prop.readout = lambda h: torch.cat([readout(h[j : j + 1]) for j in range(h.shape[0])])  # [F, V]
    return prop


def views(model, n: int, seed: int = 0) -> list[PassView]:
    g = torch.Generator().manual_seed(seed)
    return [
        PassView(
            context=torch.randint(0, V, (3 + j,), generator=g).tolist(),
            mask_logits=torch.zeros(0, V),
            hidden=torch.randn(model.config.dim, generator=g) * 2,
            masks_valid=False,
        )
        for j in range(n)
    ]


# (tree?, n, sampling temperature) per row: trees of 1..12 nodes, chains shorter and longer than the depths
ASKS = [
    (True, 8, 0),
    (False, 3, 0),
    (True, 1, 0),
    (False, 1, 0),
    (True, 12, 0),
    (False, 7, 0),
    (True, 4, 0),
    (False, 3, 0.8),
    (False, 2, 0.8),
]


def ask(prop, view, tree, n, temp, seed):
    p = SamplingParams(temperature=temp) if temp else SamplingParams()
    return prop.propose(DraftRequest(view, n, tree, p, torch.Generator().manual_seed(seed) if temp else None))


@pytest.mark.parametrize("vocab", [None, torch.arange(5, 90, 2)], ids=["full-vocab", "draft-vocab"])
def test_batched_heads_draft_exactly_what_each_row_drafts_alone(vocab):
    model = tiny_model(1)
    alone, together = rowwise(heads_proposer(model, vocab=vocab)), rowwise(heads_proposer(model, vocab=vocab))
    vs = views(model, len(ASKS))
    want = [ask(alone, v, *a, seed=j) for j, (v, a) in enumerate(zip(vs, ASKS))]
    gens = [torch.Generator().manual_seed(j) if a[2] else None for j, a in enumerate(ASKS)]
    params = [SamplingParams(temperature=a[2]) if a[2] else SamplingParams() for a in ASKS]
    requests = [DraftRequest(v, n, tree, p, g) for v, (tree, n, _), p, g in zip(vs, ASKS, params, gens)]
    taken = [together.prepare(r) for r in requests]
    assert all(t == [together] for t in taken)
    together.draft_prepared()
    assert together.depth_calls == 3 and together.draft_calls == len(ASKS)  # one call per depth for all rows
    got = [together.propose(r) for r in requests]
    assert together.depth_calls == 3 and together.draft_calls == len(ASKS)  # answers handed out, not redrafted
    for w, g in zip(want, got):
        assert g.tokens == w.tokens and g.parents == w.parents and g.confidences == w.confidences
        assert (g.probs is None) == (w.probs is None) and (g.probs is None or torch.equal(g.probs, w.probs))
    assert any(g.probs is not None for g in got) and max(len(g.tokens) for g in got) == 12


class Recording(WrappedProposer):
    """Every tree / chain the inner proposer hands out, in order."""

    def __init__(self, inner, log):
        super().__init__(inner)
        self.log = log

    def propose(self, request):
        g = self.inner.propose(request)
        self.log.append((g.tokens, g.parents, g.confidences))
        return g


PROMPTS = [
    [5, 17, 3],
    [44, 2, 9, 9, 81, 30],
    [7, 7, 8, 9, 7, 7, 8],
    [1, 2],
    [30, 31, 32, 30, 31, 32, 30],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3],
]
STRATEGIES = ["tree:8", "verify:4", "tree:4", "verify:3", "tree:8", "verify:4"]
PROPOSERS = ["heads", "heads", "heads+lookup", "heads+lookup", "heads+lookup", "heads"]


def row_proposer(shared, which, log):
    """What the engine and the server build per row: the shared heads (alone or in a merge with lookup,
    calibrated), wrapped per row."""
    p = Recording(shared, log)
    if which == "heads+lookup":
        p = CalibratedProposer(
            MergedProposer([p, PromptLookupProposer()]),
            None,
            Calibration.from_json([{"temperature": 1.5, "bias": 0.1}] * 8),
        )
    return p


def decode_rows(shared, rows, n=24, params=None):
    """Decode `rows` (prompt, strategy, proposer name) together, ragged; (sequences, logs, clock: the
    seconds the loop timed in each proposer, by name)."""
    logs, clock = [[] for _ in rows], {}
    seqs = [
        Sequence(
            list(p),
            Strategy.parse(s),
            params or SamplingParams(max_new_tokens=n),
            row_proposer(shared, w, logs[i]),
            slot=i,
        )
        for i, (p, s, w) in enumerate(rows)
    ]
    cache = KVCache.for_model(shared.model, len(rows), 128)
    with torch.inference_mode():
        while not all(s.finished for s in seqs):
            decode_step(shared.model, cache, [s for s in seqs if not s.finished], None)
    for s in seqs:
        clock[s.proposer.name] = clock.get(s.proposer.name, 0.0) + sum(s.stats.proposing_s)
    return seqs, logs, clock


def per_row(prop: N.HeadsProposer) -> N.HeadsProposer:
    """`prop` taking no request: every row drafts in its own `propose` call, as before batching."""
    prop.prepare = lambda request: []
    return prop


def test_a_ragged_batch_of_trees_and_chains_drafts_and_decodes_as_each_row_alone():
    """The same ragged batch decoded twice, its rows drafting together and then each alone: the same
    drafts pass by pass (the trunk's hidden states depend on the batch, so the reference is the batch
    drafting per row, not each prompt decoded by itself), and both are `ntp`'s output."""
    model = tiny_model(3)
    rows = list(zip(PROMPTS, STRATEGIES, PROPOSERS))
    together = rowwise(heads_proposer(model))
    seqs, logs, clock = decode_rows(together, rows)
    alone = per_row(rowwise(heads_proposer(model)))
    seqs_alone, logs_alone, _ = decode_rows(alone, rows)
    passes = max(s.stats.forward_passes for s in seqs)
    assert together.depth_calls <= 3 * passes < alone.depth_calls  # one head call per depth per pass
    for i, (prompt, _, _) in enumerate(rows):
        want = generate(model, prompt, "ntp", SamplingParams(max_new_tokens=24)).output
        assert seqs[i].output == seqs_alone[i].output == want
        assert logs[i] == logs_alone[i] and seqs[i].stats.chunks == seqs_alone[i].stats.chunks
    assert max(c for s in seqs for c in s.stats.chunks) >= 2
    assert set(clock) == {"heads", "heads+lookup"} and all(v > 0 for v in clock.values())


def test_sampled_chains_draw_as_each_row_alone():
    """Seeded sampling: each row's generator makes the same draws whether its row drafts alone or not."""
    model = tiny_model(3)
    rows = [(p, "verify:4", "heads") for p in PROMPTS[:4]]
    params = [SamplingParams(temperature=0.9, seed=seed, max_new_tokens=20) for seed in range(4)]

    def run(shared):
        logs = [[] for _ in rows]
        seqs = [
            Sequence(list(p), Strategy.parse(s), params[i], row_proposer(shared, w, logs[i]), slot=i)
            for i, (p, s, w) in enumerate(rows)
        ]
        cache = KVCache.for_model(model, len(rows), 128)
        with torch.inference_mode():
            while not all(s.finished for s in seqs):
                decode_step(model, cache, [s for s in seqs if not s.finished], None)
        return [s.output for s in seqs], logs

    assert run(rowwise(heads_proposer(model))) == run(per_row(rowwise(heads_proposer(model))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_plain_heads_decode_equals_ntp(dtype):
    """The heads as they run (batched matmuls, not batch-invariant): greedy output is still `ntp`'s."""
    model = tiny_model(2)
    shared = heads_proposer(model, dtype=dtype, seed=4)
    seqs, _, clock = decode_rows(shared, list(zip(PROMPTS, STRATEGIES, PROPOSERS)), n=30)
    for s, p in zip(seqs, PROMPTS):
        assert s.output == generate(model, p, "ntp", SamplingParams(max_new_tokens=30)).output
    assert shared.draft_calls > 0 and clock["heads"] > 0


def test_rows_share_the_batched_draft_time_evenly():
    """The loop's clock: a draft batched over rows is charged to them in equal shares, and each row's
    own `propose` call (which then hands out its answer) on top of its share."""
    model = tiny_model(1)
    shared = heads_proposer(model)
    seqs = [Sequence([1, 2], Strategy.parse("tree:8"), SamplingParams(), shared, slot=i) for i in range(3)]
    vs = views(model, 3)
    shares = decode._draft_together(seqs, [DraftRequest(v, 8, True) for v in vs])
    assert shares[0] == shares[1] == shares[2] > 0 and sum(shares) >= shared.draft_s > 0
    assert shared.draft_calls == 3
    drafted = decode._draft(seqs, vs)
    assert shared.draft_calls == 6  # drafted together once more, none drafted again by the rows' calls
    assert all(d.seconds > 0 and d.count == len(d.guesses) == 8 for d in drafted)


def test_unbatchable_requests_are_left_to_the_row():
    """No hidden state, nothing to draft, or sampling without a generator of its own: not taken."""
    model = tiny_model(1)
    prop = heads_proposer(model)
    v = views(model, 1)[0]
    no_hidden = PassView(context=[1, 2], mask_logits=torch.zeros(0, V), hidden=None, masks_valid=False)
    hot = SamplingParams(temperature=0.7)
    gen = torch.Generator().manual_seed(0)
    assert prop.prepare(DraftRequest(no_hidden, 8, True)) == []
    assert prop.prepare(DraftRequest(v, 0, False)) == [] and prop.prepare(DraftRequest(v, 0, True)) == []
    assert prop.prepare(DraftRequest(v, 3, False, hot, None)) == []
    assert prop.prepare(DraftRequest(v, 3, False, hot, gen)) == [prop]
    assert prop.prepare(DraftRequest(views(model, 2)[1], 3, False, hot, gen)) == []  # its generator is taken
