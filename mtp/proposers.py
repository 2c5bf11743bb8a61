"""Where proposals for the next tokens come from.

A proposer answers two questions for the decoding loop (mtp.decode):
1. `n_appended(k)`: how many extra tokens to append to the next pass's block so that this pass also
   yields guesses (mask tokens append k-1 masks; heads and prompt lookup append nothing);
2. `propose(...)`: after the pass, the guesses for the tokens that follow the model's own token,
   with a confidence each (top-1 probability) and, under sampling, the distribution they came from.
The strategy decides what to do with the guesses: emit them unverified (`static`, `conf_adapt`) or
send them as drafts to be checked by the next pass (`verify`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import pick


@dataclass
class Guesses:
    tokens: list[int]
    confidences: list[float]  # top-1 probability of each guess's own distribution
    probs: torch.Tensor | None = None  # [n, V] distributions sampled from (None = greedy/deterministic)

    @classmethod
    def none(cls) -> "Guesses":
        return cls([], [], None)


@dataclass
class PassView:
    """What one row's forward pass produced, as a proposer needs it."""
    context: list[int]  # prompt + every token decided so far, the model's own token included
    mask_logits: torch.Tensor  # [M, V] logits at the appended mask positions (M may be 0)
    hidden: torch.Tensor | None  # [dim] last-layer hidden state at the last accepted input position
    all_drafts_accepted: bool  # masks placed after rejected drafts predict from a wrong prefix


class Proposer:
    name = "base"
    needs_hidden = False
    has_confidence = True

    def n_appended(self, k: int) -> int:
        return 0

    def propose(self, view: PassView, k: int, params, gen) -> Guesses:
        raise NotImplementedError


class MaskProposer(Proposer):
    """The self-distilled model's own guesses: k-1 `<mtp_mask>` tokens appended to each pass."""
    name = "mask"

    def n_appended(self, k: int) -> int:
        return k - 1

    def propose(self, view: PassView, k: int, params, gen) -> Guesses:
        if k <= 1 or not view.all_drafts_accepted or view.mask_logits.shape[0] == 0:
            return Guesses.none()
        logits = view.mask_logits[: k - 1]  # [k-1, V]
        tokens, probs = pick(logits, params, gen)
        conf = torch.softmax(logits.float(), -1).amax(-1)
        return Guesses(tokens.tolist(), conf.tolist(), probs)


class PromptLookupProposer(Proposer):
    """Baseline: copy the continuation of the latest earlier occurrence of the last n-gram."""
    name = "lookup"
    has_confidence = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, view: PassView, k: int, params, gen) -> Guesses:
        ctx = view.context
        want = k - 1
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ctx) <= n:
                continue
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):  # latest match first
                if ctx[start:start + n] == tail:
                    cont = ctx[start + n:start + n + want]
                    if cont:
                        return Guesses(cont, [1.0] * len(cont), None)
        return Guesses.none()


PROPOSERS = {"mask": MaskProposer, "lookup": PromptLookupProposer}


def make_proposer(name: str, **kwargs) -> Proposer:
    if name not in PROPOSERS:
        raise ValueError(f"unknown proposer {name!r}; choose from {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[name](**kwargs)
