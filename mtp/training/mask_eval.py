"""Held-out acceptance of a mask adapter on greedy text, without decoding.

For an answer the base model wrote greedily, `verify:K` with mask proposals emits, per pass after
prefix position p, the model's own next token plus the leading run of the K-1 mask proposals that
equal the text (the text *is* what greedy verification would accept). `tokens_per_pass` lays spans
of K-1 masks after every `stride`-th response position (the training layout, `distill.make_batch`,
ground truth as the target), reads the adapter's proposals in one split forward per batch, and
returns 1 + the mean leading run per answer: the same quantity `verify:K` measures by decoding,
estimated over positions instead of along one decode path. The MTP heads' `evaluate` is its twin.
"""

from __future__ import annotations

import torch

from mtp.training.data import Example
from mtp.training.distill import Span, forward_pair, make_batch


def spans_for(ex: Example, k: int, stride: int, seq_len: int) -> list[Span]:
    """Spans of k predictions (own token + k-1 masks) after response positions p = P-1, P-1+stride, ...
    that fit in the (cut) sequence: p + k <= N - 1."""
    n = min(len(ex.prompt_ids) + len(ex.response_ids), seq_len)
    return [Span(p, k) for p in range(len(ex.prompt_ids) - 1, n - k, stride)]


@torch.no_grad()
def tokens_per_pass(
    model, examples: list[Example], k: int = 4, stride: int = 4, seq_len: int = 512, batch_size: int = 4
) -> list[float | None]:
    """Per example: 1 + mean leading run of correct mask proposals (None if no span fits).
    `model` is a base Transformer with a gated adapter attached (see `mtp.core.runtime.adapter`)."""
    if k < 2 or stride < 1:
        raise ValueError("k must be >= 2 and stride >= 1")
    mask_id = model.config.mask_token_id
    out: list[float | None] = [None] * len(examples)
    todo = [(i, spans_for(ex, k, stride, seq_len)) for i, ex in enumerate(examples)]
    todo = [(i, s) for i, s in todo if s]
    for c in range(0, len(todo), batch_size):
        chunk = todo[c : c + batch_size]
        batch = make_batch(
            [examples[i] for i, _ in chunk], mask_id, 0, k, seq_len, None, spans_of=[s for _, s in chunk]
        )
        _, proposals, _ = forward_pair(model, model, None, batch, "ground-truth", True, False)
        correct = (proposals.cpu() == batch.gt_target) & batch.valid  # [B, L], L = spans * k per row
        B, L = correct.shape
        correct = correct.view(B, L // k, k)[..., 1:]  # [B, S, k-1]: the mask depths 2..k
        run = correct.long().cumprod(-1).sum(-1).float()  # [B, S] leading run of correct masks
        real = batch.valid.view(B, L // k, k)[..., 0]  # [B, S]
        for b, (i, _) in enumerate(chunk):
            out[i] = 1.0 + float(run[b][real[b]].mean())
    return out
