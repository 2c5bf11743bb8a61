"""The online correction of a tree row's confidences (`tree.trusted`, `tree.record_trust`): what
`tree:auto` prices a node at, and what a tree row's `expected` (the `--profile` prediction) promises."""

from __future__ import annotations

import pytest
import torch

from mtp.core import tree


def test_no_record_keeps_the_confidences_clipped_and_monotone():
    parents, conf = [-1, 0, 0, 1], [0.9, 1.4, 0.2, 0.95]
    assert tree.trusted(parents, conf, []) == [0.9, 0.9, 0.2, 0.9]  # 1.4 -> 1 -> its parent's 0.9


def test_a_proposer_that_over_promises_is_priced_down_per_depth():
    trust: list = []
    parents = [-1, 0, 1]  # a chain of three nodes, each promised with confidence 1
    for _ in range(10):  # the first node accepted every other pass, never deeper
        tree.record_trust(trust, parents, [1.0, 1.0, 1.0], 1)
    for _ in range(10):
        tree.record_trust(trust, parents, [1.0, 1.0, 1.0], 0)
    assert trust == [[20.0, 10.0], [20.0, 0.0], [20.0, 0.0]]
    got = tree.trusted(parents, [1.0, 1.0, 1.0], trust)
    assert got == pytest.approx([12 / 22, 2 / 22, 2 / 22])
    # a tree of these nodes is now expected to confirm ~1.73 tokens a pass, not 4
    assert 1 + sum(got) == pytest.approx(1 + 16 / 22)


def test_keep_with_trusted_confidences_drafts_fewer_nodes():
    trust: list = []
    parents, conf = [-1, 0, 1, 2], [1.0, 1.0, 1.0, 1.0]
    for _ in range(30):
        tree.record_trust(trust, parents, conf, 0)  # never accepted

    def pass_time(q):  # a second row costs 30 % of a pass
        return 1.0 + 0.3 * (q - 1)

    assert len(tree.keep(parents, conf, pass_time)) == 4  # raw: every node pays
    assert tree.keep(parents, tree.trusted(parents, conf, trust), pass_time) == []  # believed: none does


def test_tree_auto_drafts_about_twice_what_its_trees_kept():
    from conftest import tiny_model
    from mtp.core.cache import KVCache
    from mtp.core.decode import Sequence, block_slack, decode_step
    from mtp.core.proposers import PromptLookupProposer
    from mtp.core.sampling import SamplingParams
    from mtp.core.strategy import Strategy

    assert [tree.auto_budget(24, k) for k in (None, 0.0, 2.6, 11.0, 30.0)] == [24, 2, 8, 24, 24]
    assert tree.mean_kept(None, 4) == 4.0 and tree.mean_kept(4.0, 0) == 3.0

    asked = []

    class Recording(PromptLookupProposer):
        def propose(self, request):
            asked.append(request.n)
            return super().propose(request)

    model = tiny_model(0)
    prompt = [5, 17, 3, 44, 9, 5, 17, 3, 44, 9, 5, 17]

    def run(strategy, proposer, pass_time=None):
        seq = Sequence(
            prompt, Strategy.parse(strategy), SamplingParams(max_new_tokens=30), proposer, pass_time=pass_time
        )
        cache = KVCache.for_model(model, 1, len(prompt) + 30 + block_slack(seq.strategy.k))
        with torch.inference_mode():
            while not seq.finished:
                decode_step(model, cache, [seq], None)
        return seq

    auto = run("tree:auto", Recording(), pass_time=lambda q: 1 + 0.5 * q)  # rows dear: few nodes kept
    assert auto.output == run("ntp", PromptLookupProposer()).output
    assert asked[0] == 24 and len(asked) > 3 and max(asked[1:]) < 24
