"""The online correction of a tree row's confidences (`tree.trusted`, `tree.record_trust`): what
`tree:auto` prices a node at, and what a tree row's `expected` (the `--profile` prediction) promises."""

from __future__ import annotations

import pytest

from mtp.core.decoding import tree


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
