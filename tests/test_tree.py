"""Token trees (`tree:N`, mtp.core.decoding.tree): the layout by hand, greedy tree decoding identical to plain
greedy for every tree proposer (mask groups included: tests/test_mask_tree.py has their own), the accepted
off-diagonal path's keys and values compacted exactly as a fresh prefill would hold them, ragged batches of
different trees and chains, and sampling that stays exact (the same draws as plain decoding for a seed, and
the right distribution where a naive sibling rule is not)."""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import SMALL_V, StubTree, mask_model, random_heads, require_smollm2, tiny_model

from mtp.core.decoding import tree
from mtp.core.decoding.decode import Sequence, _branch_layout, block_slack, decode_step, generate
from mtp.core.decoding.metrics import PHASES
from mtp.core.decoding.proposers import DraftRequest, Guesses, MaskProposer, PassView, PromptLookupProposer, Proposer
from mtp.core.decoding.proposers import heads as N
from mtp.core.decoding.sampling import SamplingParams, probs_from_logits
from mtp.core.decoding.strategy import Strategy, StrategyError
from mtp.core.runtime.cache import KVCache

PROMPT = [5, 17, 3, 44, 9, 5, 17, 3]


def model_and_proposer(which: str):
    """(model, proposer, prompt) for a tree proposer by name: lookup, random heads, or mask groups."""
    if which == "mask":
        return mask_model(vocab_size=SMALL_V), MaskProposer(), [t % SMALL_V for t in PROMPT]
    model = tiny_model(0)
    prop = (
        PromptLookupProposer() if which == "lookup" else N.HeadsProposer(model, random_heads(model, seed=0), "float32")
    )
    return model, prop, PROMPT


def params(n=24, **kw):
    return SamplingParams(max_new_tokens=n, **kw)


def test_layout_by_hand():
    # P = 1 pending token at cache length c = 4; nodes a (root child), b (child of a), x (root child)
    seq = Sequence([1, 2, 3, 4, 5], Strategy.parse("tree:3"), params(), PromptLookupProposer())
    seq.pending, seq.drafts = [9], Guesses([11, 12, 13], [1.0] * 3, None, [-1, 0, -1])
    slots = torch.tensor([[4, 5, 6, 7]])
    positions, attn = _branch_layout([seq], slots, [False])
    tree.apply_layout(positions, attn, 0, 4, 1, seq.drafts.parents)
    assert positions.tolist() == [[4, 5, 6, 5]]
    seen = [[j for j in range(8) if attn[0, r, j]] for r in range(4)]
    assert seen == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 7]]


def test_accept_walks_the_models_own_tokens():
    V = 6
    logits = torch.full((4, V), -5.0)  # rows: root, after node 0, after node 1, after node 2
    logits[0, 3] = 5  # root predicts 3: node 2 (the second child) holds it
    logits[3, 4] = 5  # after node 2 the model says 4: no child -> own token
    path, own = tree.accept(logits, [1, 2, 3], [-1, 0, -1], params(), None)
    assert path == [2] and own == 4
    logits[0] = -5.0
    logits[0, 0] = 5
    assert tree.accept(logits, [1, 2, 3], [-1, 0, -1], params(), None) == ([], 0)


def test_build_merges_shared_prefixes_within_the_budget():
    tokens, parents = tree.build([[1, 2, 3], [1, 2, 4], [5], [1, 6, 7]], budget=6)
    assert tokens == [1, 2, 3, 4, 5, 6] and parents == [-1, 0, 1, 1, -1, 0]
    assert tree.depths(parents) == [1, 2, 3, 3, 1, 2]
    with pytest.raises(ValueError, match="parents must precede"):
        tree.depths([0])


@pytest.mark.parametrize(
    "text, ok",
    [
        ("tree:1", True),
        ("tree:31", True),
        ("tree:0", False),
        ("tree:-1", False),
        ("tree:100000", False),
        ("tree:４", False),
        ("tree", False),
        ("tree:auto", True),
        ("tree:Auto", False),
        ("tree:auto:3", False),
    ],
)
def test_tree_strategy_parsing(text, ok):
    if ok:
        s = Strategy.parse(text)
        assert s.is_tree and s.lossless and s.verifies and str(s) == text
    else:
        with pytest.raises(StrategyError):
            Strategy.parse(text)


def test_greedy_tree_equals_plain_greedy_with_an_off_diagonal_path_and_compacts_the_cache():
    model = tiny_model(0)
    want = generate(model, PROMPT, "ntp", params=params(30)).output
    seq = Sequence(list(PROMPT), Strategy.parse("tree:5"), params(30), StubTree(want, len(PROMPT)))
    cache = KVCache.for_model(model, 1, len(PROMPT) + 30 + block_slack(seq.strategy.k))
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)
    assert seq.output == want
    assert seq.stats.forward_passes < len(want) / 2  # 3 accepted + 1 own token per pass, after the first
    # the committed keys and values are what a fresh prefill of the same tokens computes
    n = cache.lengths[0]
    fresh = KVCache.for_model(model, 1, n + 1)
    committed = (PROMPT + want)[:n]
    with torch.inference_mode():
        model(torch.tensor([committed]), torch.arange(n).view(1, n), cache=fresh)
    torch.testing.assert_close(cache.k[:, 0, :, :n], fresh.k[:, 0, :, :n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.v[:, 0, :, :n], fresh.v[:, 0, :, :n], rtol=1e-4, atol=1e-5)


def test_prune_keeps_the_prefix_with_the_most_tokens_per_second():
    line = lambda q: 1 + 0.1 * q  # noqa: E731  (t(q) = 1 + 0.1 q)
    # a chain 0.9, 0.5, 0.1: 1.9/1.2 < 2.4/1.3 > 2.5/1.4, so two nodes
    assert tree.prune([1, 2, 3], [-1, 0, 1], [0.9, 0.5, 0.1], line) == ([1, 2], [-1, 0], [0.9, 0.5])
    # the most confident first (a sibling before a weaker first child), re-indexed, order kept
    assert tree.prune([1, 2, 3], [-1, -1, 0], [0.2, 0.9, 0.1], line) == ([1, 2], [-1, -1], [0.2, 0.9])
    # rows that cost more than they promise: no drafts at all
    assert tree.prune([1, 2], [-1, 0], [0.3, 0.2], lambda q: q) == ([], [], [])
    assert tree.prune([], [], [], line) == ([], [], [])


def test_ranked_orders_by_confidence_and_stops_where_a_prefix_would_not_be_a_tree():
    # root children 0 (0.6) and 1 (0.6, a tie: index order), grandchildren 2 under 0 (0.3), 3 under 1 (0.5)
    assert tree.ranked([-1, -1, 0, 1], [0.6, 0.6, 0.3, 0.5]) == [0, 1, 3, 2]
    # a tie across depths: the shallower first; confidences above 1 count as 1, zero or less end the list
    assert tree.ranked([-1, 0, -1, 2], [1.4, 0.5, 0.5, 0.0]) == [0, 2, 1]
    # a child more confident than its parent (a proposer breaking the rule): cut before it
    assert tree.ranked([-1, 0, -1], [0.6, 0.9, 0.95]) == [2]
    assert tree.ranked([], []) == []
    # keep takes a prefix of that order: a flat pass time takes every positive node, ascending
    assert tree.keep([-1, -1, 0, 1], [0.6, 0.6, 0.3, 0.5], lambda q: 1.0) == [0, 1, 2, 3]


@pytest.mark.parametrize("cost, fewer_passes", [(lambda q: 1.0, True), (lambda q: 1.0 + 2 * q, False)])
def test_auto_tree_sizes_itself_by_the_pass_time_and_stays_exact(cost, fewer_passes):
    model = tiny_model(0)
    want = generate(model, PROMPT, "ntp", params=params(30)).output
    seq = Sequence(list(PROMPT), Strategy.parse("tree:auto"), params(30), StubTree(want, len(PROMPT)), pass_time=cost)
    cache = KVCache.for_model(model, 1, len(PROMPT) + 30 + block_slack(seq.strategy.k))
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)
    assert seq.output == want
    if fewer_passes:  # flat t(q): every node pays, as tree:5
        assert seq.stats.forward_passes < len(want) / 2
    else:  # t(q) = 1 + 2q: nodes at 0.5 never beat a plain pass (not with ms of bookkeeping added either)
        assert seq.stats.forward_passes == len(want) and max(seq.stats.blocks[1:]) == 1
    with pytest.raises(ValueError, match="pass times"):
        Sequence(list(PROMPT), Strategy.parse("tree:auto"), params(30), StubTree(want, len(PROMPT)))


def test_every_pass_times_itself_outside_the_forward_pass():
    """`DecodeStats.outside_s`: one positive time per pass (what `mtp bench --profile` adds to t(q))."""
    model = tiny_model(0)
    want = generate(model, PROMPT, "ntp", params=params(20)).output
    seq = Sequence(list(PROMPT), Strategy.parse("tree:5"), params(20), StubTree(want, len(PROMPT)))
    cache = KVCache.for_model(model, 1, len(PROMPT) + 20 + block_slack(seq.strategy.k))
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)
    assert seq.output == want
    assert len(seq.stats.outside_s) == seq.stats.forward_passes and min(seq.stats.outside_s) > 0
    # split by phase (metrics.PHASES), the parts summing to the whole
    assert [len(p) for p in seq.stats.phase_s] == [len(PHASES)] * seq.stats.forward_passes
    assert all(sum(p) == pytest.approx(o) and min(p) >= 0 for p, o in zip(seq.stats.phase_s, seq.stats.outside_s))
    last = seq.stats.outside_s[-8:]
    assert seq.bookkeeping_s() == pytest.approx(sum(last) / len(last))


def test_auto_tree_prices_the_bookkeeping_of_a_pass():
    """Every pass pays the loop around its forward pass whatever the tree's size, so a row whose
    bookkeeping is dear keeps nodes a free loop would not: rates (1 + 0.5 n) / (t(1 + n) + b)."""
    model = tiny_model(0)
    want = generate(model, PROMPT, "ntp", params=params(12)).output
    cost = lambda q: 1.0 + q  # noqa: E731  plain 1 / 2, one node 1.5 / 3: a tie that bookkeeping breaks
    seq = Sequence(list(PROMPT), Strategy.parse("tree:auto"), params(12), StubTree(want, len(PROMPT)), pass_time=cost)
    assert seq.bookkeeping_s() == 0.0  # nothing measured yet
    seq.stats.phase_s = [(0.1, 0.1, 0.2, 0.1)] * 3  # as if its passes had spent half a second each outside
    assert seq.bookkeeping_s() == 0.5
    cache = KVCache.for_model(model, 1, len(PROMPT) + 12 + block_slack(seq.strategy.k))
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)
    assert seq.output == want
    assert max(seq.stats.blocks[1:]) > 1  # nodes kept: with b = 0 the tie keeps none (the test above)


@pytest.mark.parametrize("which", ["lookup", "heads", "mask"])
def test_auto_tree_equals_plain_greedy_for_every_tree_proposer(which):
    model, prop, prompt = model_and_proposer(which)
    want = generate(model, prompt, "ntp", params=params(40)).output
    seq = Sequence(list(prompt), Strategy.parse("tree:auto"), params(40), prop, pass_time=lambda q: 1 + 0.05 * q)
    cache = KVCache.for_model(model, 1, len(prompt) + 40 + block_slack(seq.strategy.k))
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], model.config.mask_token_id)
    assert seq.output == want
    assert seq.stats.forward_passes < len(want)  # some nodes were worth their rows (and accepted)


class OracleChain(Proposer):
    """A merge part named like a real one: the next two true tokens as a chain (0.9, 0.8)."""

    name = "heads"

    def __init__(self, truth: list[int], prompt_len: int):
        self.truth, self.prompt_len = truth, prompt_len

    def propose(self, request):
        if not request.tree:
            return Guesses.none()
        done = len(request.view.context) - self.prompt_len
        return Guesses(self.truth[done : done + 2], [0.9, 0.8], None, [-1, 0])


class OracleFirstOnly(OracleChain):
    """The other part: the first true token with a wrong child, and a wrong sibling (confidence 1,
    weighted 0.3 as lookup)."""

    name = "lookup"

    def propose(self, request):
        if not request.tree:
            return Guesses.none()
        done = len(request.view.context) - self.prompt_len
        t0, t1 = self.truth[done : done + 2]
        return Guesses([t0, (t1 + 1) % 90, (t0 + 1) % 90], [1.0] * 3, None, [-1, 0, -1])


@pytest.mark.parametrize("strategy", ["tree:6", "tree:auto", "verify:3"])
def test_merged_tree_credits_each_accepted_token_to_every_part_that_drafted_it(strategy):
    """Every pass after the first accepts [t0, t1]: t0 drafted by both parts, t1 by 'heads' only, so
    each part is credited in full for the tokens it drafted (not split): heads 2 per pass, lookup 1."""
    from mtp.core.decoding import metrics
    from mtp.core.decoding.proposers import MergedProposer

    model = tiny_model(0)
    truth = generate(model, PROMPT, "ntp", params=params(40)).output
    merged = MergedProposer([OracleChain(truth, len(PROMPT)), OracleFirstOnly(truth, len(PROMPT))])
    seq = Sequence(list(PROMPT), Strategy.parse(strategy), params(30), merged, pass_time=lambda q: 1.0)
    cache = KVCache.for_model(model, 1, len(PROMPT) + 30 + block_slack(seq.strategy.k))
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)
    assert seq.output == truth[:30]
    # passes: 1 token (the prompt's), then 3 per pass (2 drafts + the model's own) up to 28, then the two
    # drafts of the 11th pass fill the 30 (its own token is cut): 10 passes with 2 accepted drafts each
    assert seq.stats.chunks == [1] + [3] * 9 + [2]
    assert seq.stats.accepted_from == [[]] + [[("heads", "lookup"), ("heads",)]] * 10
    assert metrics.accepted_by_proposer(seq.stats.accepted_from) == {"heads": 20, "lookup": 10}
    assert metrics.accepted_share(seq.stats.accepted_from) == {"heads": 1.0, "lookup": 0.5}
    if strategy.startswith("tree"):  # t0: heads 0.9 and lookup 1 (x their weights, at most 1 each) agree:
        # 1 - (1 - c_heads)(1 - c_lookup); t1 0.8 x heads' weight; lookup's wrong child and sibling its weight
        # each. Believed as the row's record says (tree.trusted): after n passes, depth d promised p_d n and
        # delivered n: p_1 = the agreed t0 plus lookup's sibling, p_2 = t1 plus lookup's child
        from mtp.core.decoding.proposers.merged import WEIGHTS

        wh, wl = WEIGHTS["heads"], WEIGHTS["lookup"]
        p1 = 1 - (1 - min(wh * 0.9, 1.0)) * (1 - min(wl, 1.0)) + wl
        p2 = min(wh * 0.8, 1.0) + wl
        believed = [1 + p1 * (n + 2) / (p1 * n + 2) + p2 * (n + 2) / (p2 * n + 2) for n in range(10)]
        assert seq.stats.expected == pytest.approx([1.0] + believed)
    else:
        assert seq.stats.expected == []


def test_a_single_proposer_is_credited_under_its_own_name():
    from mtp.core.decoding import metrics

    model = tiny_model(0)
    truth = generate(model, PROMPT, "ntp", params=params(40)).output
    seq = generate(model, PROMPT, "tree:4", params=params(30), proposer=OracleChain(truth, len(PROMPT)))
    assert metrics.accepted_by_proposer(seq.stats.accepted_from) == {"heads": 20}


@pytest.mark.parametrize("which", ["lookup", "heads", "mask"])
@pytest.mark.parametrize("n", [1, 4, 8, 12])
def test_greedy_tree_equals_plain_greedy_for_every_tree_proposer(which, n):
    model, prop, prompt = model_and_proposer(which)
    want = generate(model, prompt, "ntp", params=params(40)).output
    seq = generate(model, prompt, f"tree:{n}", params=params(40), proposer=prop)
    assert torch.equal(torch.tensor(seq.output), torch.tensor(want))


def test_heads_tree_holds_the_chain_and_its_alternatives():
    model = tiny_model(0)
    prop = N.HeadsProposer(model, random_heads(model, seed=0), "float32")
    view = PassView(
        context=PROMPT, mask_logits=torch.zeros(0, 1), hidden=torch.randn(model.config.dim), masks_valid=False
    )
    chain = prop.propose(DraftRequest(view, 3, False, params()))
    t = prop.propose(DraftRequest(view, 9, True))
    assert len(t.tokens) == 9 and tree.depths(t.parents) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    # the best path by cumulative probability starts with the chain's first (greedy) guess
    assert t.tokens[0] == chain.tokens[0]


def test_ragged_batch_of_different_trees_equals_plain_greedy():
    """Trees from lookup, heads and mask groups (branched and mask-single) beside chains (lookup, and
    mask groups after every prefix), different prompt lengths, in one pass each step."""
    model = mask_model(vocab_size=SMALL_V)
    heads = N.HeadsProposer(model, random_heads(model, seed=0), "float32")
    rows = [
        (PROMPT, "tree:6", PromptLookupProposer()),
        ([7, 7, 8, 9, 7, 7], "tree:2", heads),
        ([30, 31, 32, 30, 31], "verify:3", PromptLookupProposer()),
        ([3, 1, 4, 1, 5, 9, 2, 6], "tree:8", MaskProposer()),
        ([2, 7], "verify:4", MaskProposer()),
        ([11, 0, 11, 0, 11], "tree:4", MaskProposer(branch=False)),
        ([6, 5, 4], "tree:3", MaskProposer()),
    ]
    rows = [([t % SMALL_V for t in p], s, prop) for p, s, prop in rows]
    wants = [generate(model, p, "ntp", params=params(20)).output for p, _, _ in rows]
    seqs = [Sequence(list(p), Strategy.parse(s), params(20), prop, slot=i) for i, (p, s, prop) in enumerate(rows)]
    cache = KVCache.for_model(model, len(rows), 128)
    with torch.inference_mode():
        while not all(s.finished for s in seqs):
            live = [s for s in seqs if not s.finished]
            decode_step(model, cache, live, model.config.mask_token_id)
    assert [s.output for s in seqs] == wants
    assert max(c for s in seqs[3:] for c in s.stats.chunks) >= 3  # mask rows accepted paths of 2 drafts


@pytest.mark.parametrize("which", ["lookup", "mask"])
def test_sampled_tree_makes_the_same_draws_as_plain_sampling(which):
    model, prop, prompt = model_and_proposer(which)
    accepted = 0
    for seed in range(5):
        p = params(24, temperature=0.9, top_p=0.95, seed=seed)
        want = generate(model, prompt, "ntp", params=p).output
        got = generate(model, prompt, "tree:6", params=p, proposer=prop)
        assert got.output == want
        accepted += len(want) - got.stats.forward_passes
    assert accepted > 0 or which == "lookup"  # mask: drafts were accepted, the draws went through the tree


def naive_accept(logits, tokens, parents, p, gen):
    """A wrong rule for comparison: accept a child whenever the model gives it probability >= u for one
    uniform draw u (per-sibling speculative acceptance without the residual correction)."""
    children = collections.defaultdict(list)
    for j, par in enumerate(parents):
        children[par].append(j)
    probs = probs_from_logits(logits, p)
    node, row, path = -1, 0, []
    while True:
        u = float(torch.rand((), generator=gen))
        hit = next((j for j in children[node] if u < float(probs[row, tokens[j]])), None)
        if hit is None:
            return path, int(torch.multinomial(probs[row], 1, generator=gen))
        path.append(hit)
        node, row = hit, 1 + hit


def test_sampling_distribution_is_exact_where_a_naive_sibling_rule_is_not():
    """The first emitted token's empirical distribution over 4,000 draws against the exact one."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.6, 1.2, 0.5, -1.0], [0.0] * 5, [0.0] * 5])  # root row, then each node's row
    p = params(4, temperature=1.0)
    exact = torch.softmax(logits[0], -1)
    tokens, parents = [0, 1], [-1, -1]  # two siblings: the two likeliest tokens
    n = 4000

    def first_tokens(rule):
        gen = torch.Generator().manual_seed(1)
        counts = torch.zeros(5)
        for _ in range(n):
            path, own = rule(logits, tokens, parents, p, gen)
            counts[tokens[path[0]] if path else own] += 1
        return counts / n

    def tv(freq):
        return float((freq - exact).abs().sum() / 2)

    ours, naive = tv(first_tokens(tree.accept)), tv(first_tokens(naive_accept))
    # 4,000 draws: the sampling noise in total variation is ~0.02; the naive rule is off by ~0.3
    assert ours < 0.03 and naive > 0.15, (ours, naive)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "x", "--strategy", "tree:8"],
        ["generate", "x", "--strategy", "tree:8", "--proposer", "mask-single"],
        ["bench", "--data", "prompts:P", "--strategies", "tree:8", "--out", "O"],
        ["bench", "--data", "prompts:P", "--strategies", "tree:8@mask", "--out", "O"],
    ],
)
def test_tree_with_the_mask_proposer_passes_every_check_before_loading(argv, tmp_path, capsys, monkeypatch):
    """`tree:N` with the mask proposers (once refused in one line) gets through every front end's checks
    to the model load (`mtp pipeline`: tests/test_mask_tree.py runs its stages)."""
    from mtp.cli import main
    from mtp.core import engine
    from mtp.core.runtime import loading

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    argv = [
        a.replace("P", str(prompts)).replace("O", str(tmp_path / "o")) if a in ("prompts:P", "O") else a for a in argv
    ]

    def reached(*a, **k):
        raise ValueError("reached the model load")

    monkeypatch.setattr(engine.Engine, "load", reached)
    monkeypatch.setattr(loading, "load", reached)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reached the model load" in err, err


@pytest.fixture(scope="module")
def smollm2_engines():
    """SmolLM2 engines by proposer (shipped heads and datastore), loaded once per module."""
    require_smollm2()
    from mtp.core.engine import Engine, EngineConfig

    made = {}

    def get(proposer):
        if proposer not in made:  # the mask proposer: the shipped adapter
            made[proposer] = Engine.load(
                EngineConfig(adapter="auto" if proposer == "mask" else "none", proposer=proposer)
            )
        return made[proposer]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "proposer,strategy",
    [
        ("heads", "tree:8"),
        ("lookup", "tree:8"),
        ("suffix", "tree:8"),
        ("mask", "tree:8"),
        ("heads+suffix+lookup", "tree:16"),
        ("heads+suffix+lookup", "tree:auto"),
    ],
)
def test_greedy_trees_equal_ntp_on_smollm2(smollm2_engines, proposer, strategy):
    """On the real model, every tree proposer (mask: with the shipped adapter) and the merge: greedy tree
    output is `ntp`'s token for token (a maths answer and a request that repeats its prompt), in fewer passes."""
    engine = smollm2_engines(proposer)
    for prompt in (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "Repeat this list twice: apple, pear, plum, cherry, fig.",
    ):
        ids = engine.encode(prompt)
        ref = engine.generate(ids, "ntp", SamplingParams(max_new_tokens=32))
        out = engine.generate(ids, strategy, SamplingParams(max_new_tokens=32))
        assert out.token_ids == ref.token_ids, (proposer, strategy, prompt)
        assert out.summary["forward_passes"] < ref.summary["forward_passes"]
