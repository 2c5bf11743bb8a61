"""How predictable the target task is: the model's per-token entropy and top-1 probability on its own
greedy answers, per prompt category, and the share of answer tokens whose top-1 probability reaches
each τ (a token below τ ends a ConfAdapt block even when every guess after it would be right).

Measured teacher-forced: one forward pass over prompt + answer per item, reading the distribution
that predicted each answer token. Categories come from the prompts file's `category` field (GSM8K
items are one category, `gsm8k`).
"""

from __future__ import annotations

import math

import torch

from mtp.core.runtime.cache import KVCache

TAUS = (0.5, 0.8, 0.9, 0.95, 0.99)


def forward_over(model, ids: list[int], **outputs):
    """One forward pass over `ids` from an empty cache, as a prefill computes it; `outputs` asks the
    model for more (return_hidden=True, aux_layers=...). Returns the model's outputs, batch of one."""
    n = len(ids)
    with torch.inference_mode():
        return model(
            torch.tensor([ids], device=model.device),
            torch.arange(n, device=model.device).view(1, n),
            cache=KVCache.for_model(model, 1, n),
            **outputs,
        )


def teacher_forced(model, prompt_ids: list[int], answer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass over prompt + answer: (logits [A, V] of the distributions that predicted the A
    answer tokens, the mask token excluded as in decoding; the last layer's hidden states [P + A, dim])."""
    ids = list(prompt_ids) + list(answer_ids)
    logits, hidden = forward_over(model, ids, return_hidden=True)
    with torch.inference_mode():
        logits = logits.float()[0, len(prompt_ids) - 1 : len(ids) - 1]
        mask_id = model.config.mask_token_id
        if mask_id is not None and mask_id < logits.shape[-1]:
            logits[:, mask_id] = float("-inf")  # never a prediction, as in decoding
        return logits.cpu(), hidden[0].cpu()


def token_stats(logits: torch.Tensor) -> tuple[list[float], list[float]]:
    """(entropy in nats, top-1 probability) of each row of answer logits [A, V]."""
    with torch.inference_mode():
        logp = torch.log_softmax(logits, -1)
        entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
        return entropy.tolist(), logp.max(-1).values.exp().tolist()


def report(
    model, items: list[dict], prompts: list[list[int]], answers: list[list[int]], hidden: dict | None = None
) -> dict:
    """Per category (and `all`): items, answer tokens, mean entropy, mean top-1 probability and the
    share of tokens with top-1 probability >= each τ of TAUS. `hidden`, if given, keeps each prompt's
    hidden states by index (what `mtp.tune.simulate.replay` reads: one teacher-forced pass serves both)."""
    groups: dict[str, list[tuple[list[float], list[float]]]] = {}
    for j, (it, p, a) in enumerate(zip(items, prompts, answers)):
        if not a:
            stats = ([], [])
        else:
            logits, h = teacher_forced(model, p, a)
            stats = token_stats(logits)
            if hidden is not None:
                hidden[j] = h
        groups.setdefault(it.get("category", "all"), []).append(stats)
    if len(groups) > 1:
        groups["all"] = [s for g in list(groups.values()) for s in g]
    out = {}
    for cat, rows in groups.items():
        ent = [e for r in rows for e in r[0] if math.isfinite(e)]
        top = [t for r in rows for t in r[1]]
        out[cat] = {
            "items": len(rows),
            "tokens": len(top),
            "entropy_mean": sum(ent) / len(ent) if ent else None,
            "top1_mean": sum(top) / len(top) if top else None,
            "share_at_least": {f"{tau:g}": (sum(t >= tau for t in top) / len(top) if top else None) for tau in TAUS},
        }
    return out
