"""`mtp tune` prices lossless candidates by replaying them on the reference answers
(mtp.tune.simulate): for heads chains and trees, prompt-lookup trees and `tree:auto`, the replayed
passes (tokens emitted and fed per pass) are those a real decode records, pass for pass."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import AUX, examples_of, tiny_model

from mtp.core.decoding.decode import Sequence, block_slack, decode_step
from mtp.core.decoding.proposers import PromptLookupProposer
from mtp.core.decoding.proposers import heads as N
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.runtime.cache import KVCache
from mtp.tune.offline import Output, chain_pairs
from mtp.tune.simulate import can_replay, replay

PROMPTS = [[5, 17, 3, 44, 9, 5, 17, 3], [7, 7, 8, 9, 7, 7, 8], [60, 61, 62, 63, 60, 61]]
COST = lambda q: 1 + 0.05 * q  # noqa: E731


@dataclass
class Loaded:
    eos_ids: tuple = (2,)


class FakeEngine:
    """What `replay` needs of an Engine: the model, its EOS ids, a proposer by name, t(q)."""

    def __init__(self, model, proposers):
        self.model, self.loaded, self.proposers = model, Loaded(), proposers

    def proposer(self, name=None, wrap=None):
        p = self.proposers[name]
        return wrap(name, p) if wrap is not None else p

    def pass_time(self):
        return COST


def decoded(model, prompt, strategy, proposer, n=40):
    seq = Sequence(
        list(prompt),
        Strategy.parse(strategy),
        SamplingParams(max_new_tokens=n),
        proposer,
        eos_ids=(2,),
        pass_time=COST if strategy == "tree:auto" else None,
    )
    cache = KVCache.for_model(model, 1, len(prompt) + n + block_slack(seq.strategy.k))
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)
    return seq


@pytest.mark.parametrize(
    "strategy, which",
    [("verify:4", "heads"), ("tree:8", "heads"), ("tree:auto", "heads"), ("tree:4", "lookup"), ("verify:3", "lookup")],
)
def test_replayed_passes_are_the_decoded_ones(strategy, which):
    model = tiny_model(0)
    torch.manual_seed(0)
    heads = N.MTPHeads(N.HeadsConfig.for_model(model.config, 3)).eval().requires_grad_(False)
    prop = N.HeadsProposer(model, heads, "float32") if which == "heads" else PromptLookupProposer()
    engine = FakeEngine(model, {which: prop})
    refs, real = [], []
    for p in PROMPTS:
        ntp = decoded(model, p, "ntp", PromptLookupProposer())
        refs.append(Output(list(ntp.output), "", [], [], ntp.finish_reason))
        real.append(decoded(model, p, strategy, prop))
    stats = replay(engine, PROMPTS, refs, Strategy.parse(strategy), which, record=True)
    for out, seq in zip(stats.outputs, real):
        assert seq.output == out.ids  # lossless
        assert out.chunks == seq.stats.chunks and out.blocks == seq.stats.blocks
    assert stats.guesses > 0
    if strategy.startswith("verify"):
        assert any(chain_pairs(o) for o in stats.outputs)
    # the heads' answers kept across replays: the same passes, and the kept answers still charged
    memo: dict = {}
    first = replay(engine, PROMPTS, refs, Strategy.parse(strategy), which, memo=memo)
    again = replay(engine, PROMPTS, refs, Strategy.parse(strategy), which, memo=memo)
    for a, b, seq in zip(first.outputs, again.outputs, real):
        assert a.chunks == b.chunks == seq.stats.chunks and a.blocks == b.blocks
    assert any(memo.values()) == (which == "heads") and again.guesses == first.guesses
    if which == "heads":
        assert again.proposing_s >= 0.9 * first.proposing_s > 0


@pytest.mark.parametrize("strategy", ["verify:4", "tree:8"])
def test_replayed_eagle3_passes_are_the_decoded_ones(strategy, tmp_path):
    """EAGLE-3 reads the trunk's streams of what each pass committed: the teacher-forced pass's rows of
    those positions give it the same drafts, so the replay records the decode's chunks and blocks."""
    from mtp.core.decoding.proposers.eagle3 import Eagle3Proposer, load_drafter
    from mtp.training.eagle3_train import TrainEagle3Config, extract_features, train_eagle3

    model = tiny_model(3)
    feats = extract_features(model, examples_of(model, n=12, new=30), AUX, dtype=torch.float32)
    cfg = TrainEagle3Config(aux_layers=AUX, draft_vocab=97, steps=40, batch_size=4, lr=3e-3, val_fraction=0.0)
    train_eagle3(model, feats, cfg, tmp_path / "d", log=lambda m: None)
    drafter = load_drafter(model, tmp_path / "d")
    prop = Eagle3Proposer(model, drafter)
    engine = FakeEngine(model, {"eagle3": prop})
    prompts = [ex.prompt_ids for ex in examples_of(model, n=4, new=1, seed=0)]
    refs, real = [], []
    for p in prompts:
        ntp = decoded(model, p, "ntp", PromptLookupProposer())
        refs.append(Output(list(ntp.output), "", [], [], ntp.finish_reason))
        real.append(decoded(model, p, strategy, prop))
    stats = replay(engine, prompts, refs, Strategy.parse(strategy), "eagle3", hidden_cache={})
    for out, seq in zip(stats.outputs, real):
        assert seq.output == out.ids
        assert out.chunks == seq.stats.chunks and out.blocks == seq.stats.blocks
    chunks = [c for o in stats.outputs for c in o.chunks[1:]]
    assert max(chunks) > 1 and min(chunks) == 1  # drafts accepted and rejected: the test can tell


def test_only_context_hidden_and_stream_proposers_replay():
    assert can_replay("heads") and can_replay("lookup") and can_replay("heads+suffix+lookup") and can_replay("eagle3")
    assert not can_replay("mask") and not can_replay("mask-single")
    with pytest.raises(ValueError, match="only lossless"):
        replay(FakeEngine(tiny_model(0), {}), [], [], Strategy.parse("static:2"), "lookup")
