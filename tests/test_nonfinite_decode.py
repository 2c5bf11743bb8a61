"""W1: a proposer's NaN never reaches the accepted tokens. An inf in the mask embedding makes every mask
row non-finite: `verify` (branched and single-group masks) still emits exactly plain greedy's tokens; a
NaN in the LoRA weights makes ordinary positions non-finite too: decoding stops with one line instead of
emitting garbage."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from mtp.core.decoding.decode import NonFiniteError, finite_prefix, generate
from mtp.core.decoding.proposers import Guesses, make_proposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.runtime.adapter import add_adapters

PROMPT = [5, 17, 3, 44]


def adapted():
    model = tiny_model(0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in add_adapters(model, rank=4, alpha=8, mode="gated"):
            p.add_(torch.randn_like(p) * 0.2)
    return model


def params(n=24, **kw):
    return SamplingParams(max_new_tokens=n, **kw)


@pytest.mark.parametrize("proposer", ["mask", "mask-single"])
def test_an_inf_mask_embedding_is_a_rejected_guess(proposer):
    base, model = tiny_model(0), adapted()
    want = generate(base, PROMPT, "ntp", params=params()).output
    with torch.no_grad():
        model.embed_tokens.mask_row.fill_(float("inf"))  # every mask row's hidden state is NaN now
    seq = generate(model, PROMPT, "verify:4", params=params(), proposer=make_proposer(proposer))
    assert seq.output == want  # before the fix: 24 x token 0
    assert seq.stats.forward_passes == len(want)  # no guess survived, so one token per pass


def test_an_inf_mask_embedding_under_sampling_keeps_the_ntp_tokens_for_a_seed():
    model = adapted()
    with torch.no_grad():
        model.embed_tokens.mask_row.fill_(float("inf"))
    got = generate(model, PROMPT, "verify:4", params=params(temperature=0.8, seed=3)).output
    want = generate(model, PROMPT, "ntp", params=params(temperature=0.8, seed=3)).output  # same vocab
    assert got == want  # no draft at all: every token is the model's own sample, in the same order


def test_a_nan_lora_weight_stops_with_one_line_instead_of_garbage():
    model = adapted()
    with torch.no_grad():
        model.layers[0].self_attn.q_proj.lora_a[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="non-finite logits") as e:
        generate(model, PROMPT, "verify:4", params=params())
    assert "\n" not in str(e.value)
    assert generate(model, PROMPT, "ntp", params=params(4)).output  # ntp passes hold no masks: unaffected


def test_finite_prefix_cuts_at_the_first_nan():
    g = Guesses([3, 4, 5], [0.9, float("nan"), 0.8], None)
    assert finite_prefix(g).tokens == [3] and finite_prefix(g).confidences == [0.9]
    probs = torch.full((2, 4), 0.25)
    probs[1, 2] = float("nan")
    assert finite_prefix(Guesses([1, 2], [0.5, 0.5], probs)).probs.shape == (1, 4)
    ok = Guesses([1, 2], [0.5, 0.5], None)
    assert finite_prefix(ok) is ok
