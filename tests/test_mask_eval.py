"""Held-out acceptance of a mask adapter on text (`mtp.training.mask_eval`): exact on texts built
from the adapter's own mask proposals."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from mtp.core.runtime.adapter import add_adapters
from mtp.training.data import Example
from mtp.training.mask_eval import spans_for, tokens_per_pass


def test_spans_fit_the_sequence():
    ex = Example([1, 2, 3, 4], [5, 6, 7, 8, 9, 10])  # N = 10, prompt ends at p = 3
    assert [(s.p, s.k) for s in spans_for(ex, 4, 2, 512)] == [(3, 4), (5, 4)]  # p + k <= N - 1
    assert [s.p for s in spans_for(ex, 4, 2, 8)] == [3]  # cut at seq_len 8 first
    assert spans_for(Example([1, 2, 3], [4, 5]), 4, 1, 512) == []


def test_tokens_per_pass_counts_the_leading_run_of_mask_proposals():
    model = tiny_model(0)
    torch.manual_seed(1)
    for p in add_adapters(model, rank=4, alpha=8):
        torch.nn.init.normal_(p, std=0.3)
    mask = model.config.mask_token_id
    prompt = [5, 6, 7, 8]
    # the adapter's three mask proposals after the prompt: masks see only the prefix, not token p+1
    ids = torch.tensor([prompt + [mask] * 3])
    with torch.no_grad():
        logits = model(ids, torch.arange(7).view(1, 7))[0, 4:7]
    logits[:, mask] = float("-inf")
    m1, m2, m3 = logits.argmax(-1).tolist()

    def other(t):  # a different ordinary token
        return next(x for x in range(2, 90) if x not in (t, mask))

    texts = [
        Example(prompt, [9, m1, m2, m3, 10]),  # every mask proposal right: 1 + 3
        Example(prompt, [9, m1, m2, other(m3), 10]),  # the third wrong: 1 + 2
        Example(prompt, [9, m1, other(m2), m3, 10]),  # the second wrong stops the run: 1 + 1
        Example(prompt, [9, other(m1), m2, m3, 10]),  # the first wrong: 1 + 0
        Example(prompt, [9, 10]),
    ]  # no span fits
    got = tokens_per_pass(model, texts, k=4, stride=100, batch_size=2)
    assert got == [4.0, 3.0, 2.0, 1.0, None]
    with pytest.raises(ValueError):
        tokens_per_pass(model, texts, k=1)
