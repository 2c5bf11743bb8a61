"""The suffix proposer (mtp.core.decoding.proposers.suffix): matches on a toy corpus by hand, frequency trees,
greedy `tree:N` and `verify:K` with it identical to plain greedy, and datastores that are refused
(another model, empty, corrupt, missing)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import tiny_model

from mtp.core.decoding.decode import generate
from mtp.core.decoding.proposers import DraftRequest, PassView
from mtp.core.decoding.proposers.suffix import (
    Datastore,
    SuffixProposer,
    build_datastore,
    frequent_tree,
    load_suffix_proposer,
)
from mtp.core.decoding.sampling import SamplingParams

CORPUS = [[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [2, 3, 7], [8, 8, 8]]


def test_longest_suffix_matches_by_hand():
    store = Datastore.from_answers(CORPUS)
    assert len(store) == 16
    n, conts = store.continuations([7, 2, 3, 4], depth=2)  # "2 3 4" occurs twice: the 3-gram wins
    assert n == 3 and sorted(conts) == [[5], [6]]
    n, conts = store.continuations([0, 0, 2, 3], depth=3)  # "0 2 3" nowhere; "2 3" three times
    assert n == 2 and sorted(conts) == [[4, 5], [4, 6], [7]]
    assert store.continuations([5, 9], 2) == (1, [[2, 3]])  # "5 9" spans two answers: only "9" matches
    assert store.continuations([42], 2) == (0, [])
    assert store.continuations([8, 8], 4) == (2, [[8]])  # continuations stop at the answer's end


def test_frequent_tree_keeps_the_most_travelled_nodes():
    tokens, parents, shares = frequent_tree([[4, 5], [4, 6], [4, 5], [7]], budget=3)
    assert tokens == [4, 7, 5] and parents == [-1, -1, 0]  # depth by depth; [4, 6] (one in four) left out
    assert shares == [0.75, 0.25, 0.5]


def params(n=30):
    return SamplingParams(max_new_tokens=n)


@pytest.mark.parametrize("strategy", ["tree:8", "verify:4"])
def test_suffix_decoding_equals_plain_greedy(strategy):
    model = tiny_model(0)
    prompt = [5, 17, 3, 44, 9]
    want = generate(model, prompt, "ntp", params=params()).output
    store = Datastore.from_answers([want[3:20], want[10:], [1, 2, 3]])  # the model's own answer, in pieces
    seq = generate(model, prompt, strategy, params=params(), proposer=SuffixProposer(store))
    assert seq.output == want
    assert seq.stats.forward_passes < len(want) * 0.6


def test_the_proposal_includes_the_context_itself():
    prop = SuffixProposer(None)
    view = PassView(context=[1, 2, 3, 9, 1, 2], mask_logits=torch.zeros(0, 1), hidden=None, masks_valid=False)
    g = prop.propose(DraftRequest(view, 4, True))
    assert g.tokens[:2] == [3, 9] and g.parents[:2] == [-1, 0]


def test_saved_datastores_load_and_bad_ones_are_refused(tmp_path):
    model, other = tiny_model(0), tiny_model(1)
    build_datastore(CORPUS, model, {"shards": ["train-00001.jsonl.gz"]}, tmp_path / "ds")
    prop = load_suffix_proposer(model, tmp_path / "ds")
    assert len(prop.store) == 16 and prop.store.meta["shards"] == ["train-00001.jsonl.gz"]
    with pytest.raises(ValueError, match="another model"):
        load_suffix_proposer(other, tmp_path / "ds")
    with pytest.raises(ValueError, match="not a datastore"):
        load_suffix_proposer(model, tmp_path / "missing")
    with pytest.raises(ValueError, match="no answers"):
        build_datastore([[], []], model)
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    (tmp_path / "ds" / "config.json").write_text(json.dumps({**cfg, "format": "x"}))
    with pytest.raises(ValueError, match="not an mtp datastore"):
        load_suffix_proposer(model, tmp_path / "ds")


def test_a_datastore_of_another_vocabulary_is_refused(tmp_path):
    model = tiny_model(0)
    big = Datastore(np.array([5, 6, model.config.vocab_size + 3, -1]))
    big.save(tmp_path / "ds")  # no model given: no hash to compare, the vocabulary check still holds
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        load_suffix_proposer(model, tmp_path / "ds")


def test_merged_proposers_join_their_trees_and_stay_lossless():
    from mtp.core.decoding.proposers import PromptLookupProposer, check_proposer
    from mtp.core.decoding.proposers.merged import MergedProposer

    model = tiny_model(0)
    prompt = [5, 17, 3, 44, 9, 5, 17]
    want = generate(model, prompt, "ntp", params=params()).output
    store = Datastore.from_answers([want[8:]])
    merged = MergedProposer([SuffixProposer(store), PromptLookupProposer()])
    assert merged.name == "suffix+lookup"
    view = PassView(context=[1, 2, 3, 9, 1, 2], mask_logits=torch.zeros(0, 1), hidden=None, masks_valid=False)
    g = merged.propose(DraftRequest(view, 6, True))
    assert g.tokens[:2] == [3, 9] and len(g.tokens) == len(set(zip(g.tokens, g.parents)))  # shared prefixes once
    for strategy in ("tree:8", "verify:4"):
        assert generate(model, prompt, strategy, params=params(), proposer=merged).output == want
    for bad, words in [
        ("heads+nope", "unknown proposer"),
        ("mask+lookup", "cannot be merged"),
        ("lookup+lookup", "each part once"),
        ("lookup+", "malformed"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_proposer(bad)
