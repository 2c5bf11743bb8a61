"""Token trees from mask guesses (`tree:N` with `--proposer mask`): the groups' anchors and layout by hand,
a stub model with exact tokens (a sibling of the top-1 guess accepted, the next drafts read from the
group that followed the accepted node, no group -> no drafts, EOS and max_new_tokens inside the accepted
path), every group's logits equal to a separate plain pass, and real tiny models (deep and sibling paths
accepted, the committed KV a fresh prefill's, EOS inside a path) equal to `ntp`. Greedy, sampled,
`tree:auto` and ragged-batch equality live in tests/test_tree.py's parametrized tests, mask trees through
the pipeline's stages in tests/test_pipeline.py."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import SCRIPT_MASK as MASK
from helpers import SCRIPT_TARGET as TARGET
from helpers import SMALL_V, ScriptedModel, mask_model, mtp_tiny

from mtp.core.decoding import tree
from mtp.core.decoding.decode import Sequence, _branch_layout, decode_step, generate
from mtp.core.decoding.proposers import MAX_MASK_GROUPS, Guesses, MaskProposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.runtime.cache import KVCache

GARBAGE = 41


def wrong(p: int) -> int:
    return (TARGET[p] + 1) % 40


# a mask group's guesses by depth, for the token at position q: the top-1 at depth 1 is wrong, the truth second
GUESSES = [
    lambda q: [(wrong(q), 0.6), (TARGET[q], 0.35)],
    lambda q: [(TARGET[q], 0.9), (wrong(q), 0.05)],
    lambda q: [(TARGET[q], 0.9), (wrong(q), 0.05)],
]


class TreeStub(ScriptedModel):
    """Fixed logits that read the layout (litgpt-style stub): a real token at position p predicts
    TARGET[p+1] (certain). A mask finds its anchor (the last non-mask token it sees, at position pa) and
    its depth i (the masks it sees after the anchor), checks that its RoPE position is pa + 1 + i, and
    guesses GUESSES[i] for the token at pa + 2 + i (mask 0 stands in for the model's own next token) when
    the anchor holds the true token, GARBAGE after a wrong one: drafts read from any other group than
    the one after the accepted node would differ."""

    floor = -30.0

    def script(self, logits, tokens, positions, attn_mask, cache_positions):
        B, T = tokens.shape
        for b in range(B):
            for t in range(T):
                p = int(positions[b, t])
                if int(tokens[b, t]) != MASK:
                    logits[b, t, TARGET[p + 1]] = 0.0
                    continue
                seen = [u for u in range(t) if attn_mask is None or bool(attn_mask[b, t, int(cache_positions[b, u])])]
                anchor = max(u for u in seen if int(tokens[b, u]) != MASK)
                depth = sum(1 for u in seen if u > anchor)
                pa = int(positions[b, anchor])
                assert p == pa + 1 + depth, "a mask's RoPE position must follow its anchor's"
                on_path = int(tokens[b, anchor]) == TARGET[pa]
                for tok, prob in GUESSES[depth](pa + 2 + depth) if on_path else [(GARBAGE, 0.9)]:
                    logits[b, t, tok] = math.log(prob)


def run_tree_stub(strategy="tree:4", max_new=13, eos=(), branch=True, inspect=None):
    stub = TreeStub()
    seq, cache = stub.run(strategy, max_new, eos, branch, inspect)
    return seq, cache, stub


def test_groups_follow_the_root_and_the_likeliest_nodes():
    seq = Sequence([1, 2], Strategy.parse("tree:8"), SamplingParams(), MaskProposer())
    assert seq.group_size() == 3 and seq.mask_anchors() == [-1]  # no drafts: one group after the root
    seq.drafts = Guesses([5, 6, 7], [0.5, 0.2, 0.4], None, [-1, 0, -1])
    assert seq.groups() == 4 and seq.mask_anchors() == [-1, 0, 2, 1] and seq.n_appended() == 12
    # more nodes than groups: the likeliest get them
    seq.drafts = Guesses(list(range(10)), [0.01 * j for j in range(10)], None, [-1] * 10)
    assert seq.mask_anchors() == [-1, 9, 8, 7, 6, 5, 4, 3] and len(seq.mask_anchors()) == MAX_MASK_GROUPS
    single = Sequence([1, 2], Strategy.parse("tree:8"), SamplingParams(), MaskProposer(branch=False))
    single.drafts = Guesses([5, 6, 7], [0.5, 0.2, 0.4], None, [-1, 0, -1])
    assert single.mask_anchors() == [-1] and single.n_appended() == 3
    chain = Sequence([1, 2], Strategy.parse("verify:4"), SamplingParams(), MaskProposer())
    chain.drafts = Guesses([5, 6, 7], [1.0] * 3)
    assert chain.group_size() == 3 and chain.mask_anchors() == [2, -1, 0, 1]  # unchanged: after all, then 0, 1, 2
    assert Sequence([1], Strategy.parse("tree:1"), SamplingParams(), MaskProposer()).group_size() == 1


def test_group_layout_by_hand():
    """The docstring's example (mtp.core.decoding.tree): tree a->b, x; groups of 2 after the root and after b."""
    nodes = tree.with_groups([-1, 0, -1], [-1, 1], 2)
    assert nodes == [-1, 0, -1, -1, 3, 1, 5]
    c, P = 4, 1
    positions = torch.arange(c, c + 8).view(1, 8)
    attn = torch.arange(12).view(1, 1, 12) <= positions.unsqueeze(-1)
    tree.apply_layout(positions, attn, 0, c, P, nodes)
    assert positions.tolist() == [[c, c + 1, c + 2, c + 1, c + 1, c + 2, c + 3, c + 4]]
    seen = [[j - c for j in range(c, 12) if attn[0, r, j]] for r in range(8)]  # slots beyond the prefix
    assert seen == [[0], [0, 1], [0, 1, 2], [0, 3], [0, 4], [0, 4, 5], [0, 1, 2, 6], [0, 1, 2, 6, 7]]
    assert bool(attn[0, 1:, :c].all())  # everyone sees the committed prefix


def test_stub_accepts_a_sibling_and_drafts_from_the_group_after_it():
    """tree:4: depth 1 holds [wrong (0.6), true (0.35)], depth 2 the true token under both, so the
    model's own tokens walk node 1 (the sibling, not the top-1) then node 3; the next drafts come from
    the group after node 3 (positions 9, 10), and every later pass accepts 2 drafts the same way."""
    trees = []
    seq, cache, stub = run_tree_stub(inspect=lambda s: trees.append((list(s.drafts.tokens), list(s.drafts.parents))))
    assert seq.output == TARGET[5:18] and seq.stats.chunks == [1, 3, 3, 3, 3] and seq.missed_groups == 0
    # pass 1 (the prompt + the root's group) drafted from positions 6, 7; pass 2 from the group after node 3
    assert trees[0] == ([wrong(6), TARGET[6], TARGET[7], TARGET[7]], [-1, -1, 0, 1])
    assert trees[1] == ([wrong(9), TARGET[9], TARGET[10], TARGET[10]], [-1, -1, 0, 1])
    # pass 2's block: pending t5, the 4 nodes, groups after the root, node 0, node 2, node 1, node 3 (by confidence)
    assert stub.calls[1].tolist() == [[TARGET[5], wrong(6), TARGET[6], TARGET[7], TARGET[7]] + [MASK] * 15]
    assert stub.positions[1].tolist() == [[5, 6, 6, 7, 7, 6, 7, 8, 7, 8, 9, 8, 9, 10, 7, 8, 9, 8, 9, 10]]
    # committed: the prompt, then per later pass its pending token + the 2 accepted nodes (the masks never)
    assert cache.lengths[0] == 5 + 4 * 3


def test_stub_without_a_group_where_acceptance_stops_has_no_drafts_next_pass():
    """mask-single keeps the root's group only: a pass that accepts nodes stops where no group
    followed, so the next pass has nothing to check (counted), then proposes again from its root group."""
    seq, _, _ = run_tree_stub(branch=False)
    assert seq.output == TARGET[5:18]
    assert seq.stats.chunks == [1, 3, 1, 3, 1, 3, 1] and seq.missed_groups == 3


def test_stub_eos_and_max_new_tokens_inside_the_accepted_path():
    seq, _, _ = run_tree_stub(max_new=40, eos=[TARGET[7]])  # pass 2 accepts t6, t7 (EOS) and adds t8
    assert seq.output == TARGET[5:7] and seq.finish_reason == "stop"
    seq, _, _ = run_tree_stub(max_new=6)  # pass 3's t9, t10, t11 cut after t10
    assert seq.output == TARGET[5:11] and seq.stats.chunks == [1, 3, 2] and seq.finish_reason == "length"


@pytest.mark.parametrize("packed", [False, True])
def test_tree_mask_groups_equal_separate_passes(packed):
    """Every row of a tree pass with mask groups (gated adapter on) gives the logits of a plain pass
    over the prefix and that row's root path: nodes as if their path were the text, each group's masks
    as if they followed their anchor."""
    model = mtp_tiny(2)
    if packed:
        from mtp.core.runtime.model import pack_weights

        pack_weights(model)
    mid = model.config.mask_token_id
    prompt, pending = [5, 9, 2, 7, 1], [3]
    seq = Sequence(prompt, Strategy.parse("tree:4"), SamplingParams(), MaskProposer())
    seq.pending, seq.drafts = pending, Guesses([8, 4, 6, 2], [0.3, 0.6, 0.5, 0.1], None, [-1, -1, 1, 0])
    g, anchors, P, D = seq.group_size(), seq.mask_anchors(), 1, 4
    assert g == 3 and anchors == [-1, 1, 2, 0, 3]
    cache = KVCache.for_model(model, 1, 64)
    with torch.inference_mode():
        model(torch.tensor([prompt]), torch.arange(5).view(1, 5), cache=cache)
        cache.commit(0, 5)
        block = pending + seq.drafts.tokens + [mid] * seq.n_appended()
        slots = 5 + torch.arange(len(block)).view(1, -1)
        positions, attn = _branch_layout([seq], slots, [True])
        got = model(torch.tensor([block]), positions, cache=cache, attn_mask=attn, cache_positions=slots)[0]

        def path(j):  # node j's root path as tokens
            return [seq.drafts.tokens[a] for a in tree.ancestors(seq.drafts.parents, j)] if j >= 0 else []

        for j in range(-1, D):  # the root's row and every node's
            ref = model(torch.tensor([prompt + pending + path(j)]))[0, -1]
            torch.testing.assert_close(got[P + j], ref, rtol=1e-4, atol=1e-4)
        for q, a in enumerate(anchors):
            ref = model(torch.tensor([prompt + pending + path(a) + [mid] * g]))[0, -g:]
            first = P + D + g * q
            torch.testing.assert_close(got[first : first + g], ref, rtol=1e-4, atol=1e-4)


def record_paths(monkeypatch) -> list[list[int]]:
    paths: list[list[int]] = []
    real = tree.accept

    def accept(*a, **k):
        out = real(*a, **k)
        paths.append(out[0])
        return out

    monkeypatch.setattr(tree, "accept", accept)
    return paths


@pytest.mark.parametrize("n", [4, 8])
def test_small_model_accepts_deep_and_sibling_paths_and_commits_a_fresh_prefills_kv(n, monkeypatch):
    """A tiny model of 12 tokens: its masks' top-k is often right, so paths of 2+ nodes and siblings of
    the top-1 are accepted; a pass that stops where no group followed leaves the next one draftless; the
    output is `ntp`'s and the committed keys and values are what a fresh prefill of the text computes."""
    model = mask_model(0, vocab_size=SMALL_V)
    paths = record_paths(monkeypatch)
    missed = 0
    for seed in range(3):
        prompt = torch.randint(0, SMALL_V, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = generate(model, prompt, "ntp", SamplingParams(max_new_tokens=40)).output
        seq = Sequence(prompt, Strategy.parse(f"tree:{n}"), SamplingParams(max_new_tokens=40), MaskProposer())
        cache = KVCache.for_model(model, 1, 128)
        with torch.inference_mode():
            while not seq.finished:
                before = seq.missed_groups
                decode_step(model, cache, [seq], model.config.mask_token_id)
                if seq.missed_groups > before and not seq.finished:
                    assert seq.drafts.tokens == []  # no group after the accepted node: nothing to check next pass
            assert torch.equal(torch.tensor(seq.output), torch.tensor(want))
            L = cache.lengths[0]
            fresh = KVCache.for_model(model, 1, L + 1)
            model(torch.tensor([(prompt + want)[:L]]), torch.arange(L).view(1, L), cache=fresh)
        torch.testing.assert_close(cache.k[:, 0, :, :L], fresh.k[:, 0, :, :L], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache.v[:, 0, :, :L], fresh.v[:, 0, :, :L], rtol=1e-4, atol=1e-5)
        missed += seq.missed_groups
    assert any(len(p) >= 2 for p in paths) and any(p and p[0] != 0 for p in paths), paths
    assert missed > 0 or n < MAX_MASK_GROUPS  # tree:8 has a node without a group, and acceptance stopped there


@pytest.mark.parametrize("n", [1, 4, 8])
def test_small_model_eos_and_max_new_tokens_inside_an_accepted_path_equal_ntp(n):
    """EOS at an accepted draft's place (its token's first occurrence), and max_new_tokens ending there."""
    model = mask_model(0, vocab_size=SMALL_V)
    for seed in range(20):  # a prompt whose answer has such a draft (12 tokens repeat soon)
        prompt = torch.randint(0, SMALL_V, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        free = generate(model, prompt, f"tree:{n}", SamplingParams(max_new_tokens=40), MaskProposer())
        starts = [sum(free.stats.chunks[:i]) for i in range(len(free.stats.chunks))]
        inside = [s + 1 for s, c in zip(starts, free.stats.chunks) if c >= 2]  # accepted drafts' indices
        inside = [i for i in inside if free.output.index(free.output[i]) == i]
        if inside:
            break
    assert inside, "no accepted draft is its token's first occurrence"
    i = inside[0]
    eos = free.output[i]
    ref = generate(model, prompt, "ntp", SamplingParams(max_new_tokens=40), eos_ids=[eos])
    got = generate(model, prompt, f"tree:{n}", SamplingParams(max_new_tokens=40), MaskProposer(), eos_ids=[eos])
    assert got.output == ref.output == free.output[:i] and got.finish_reason == "stop"
    ref = generate(model, prompt, "ntp", SamplingParams(max_new_tokens=i + 1))
    got = generate(model, prompt, f"tree:{n}", SamplingParams(max_new_tokens=i + 1), MaskProposer())
    assert got.output == ref.output == free.output[: i + 1] and got.finish_reason == "length"


def test_tree_auto_prices_the_mask_groups():
    """`keep` pays for the masks a pass of n nodes appends: rows that were worth it alone may not be."""
    line = lambda q: 1 + 0.2 * q  # noqa: E731
    parents, confs = [-1, 0, 1], [0.9, 0.5, 0.1]
    # rows alone: 1.9/1.4 < 2.4/1.6 > 2.5/1.8; with 3 masks per group (1 + n groups): 1.9/2.6 > 2.4/3.4
    assert tree.keep(parents, confs, line) == [0, 1]
    assert tree.keep(parents, confs, line, appended=lambda n: 3 * (1 + n)) == [0]
