"""Where proposals for the next tokens come from.

A proposer answers two questions for the decoding loop (mtp.core.decode):
1. `n_appended(k, drafts)`: how many extra tokens to append to the next pass's block so that this pass
   also yields guesses (mask tokens append k-1 masks, and under `verify` one such group per possible
   number of accepted drafts; heads and prompt lookup append nothing);
2. `propose(...)`: after the pass, the guesses for the tokens that follow the model's own token,
   with a confidence each (top-1 probability) and, under sampling, the distribution they came from.
The strategy decides what to do with the guesses: emit them unverified (`static`, `conf_adapt`) or
send them as drafts to be checked by the next pass (`verify`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp.core.sampling import pick


MAX_MASK_GROUPS = 8  # mask groups a branched `verify` pass carries at most (see MaskProposer)


def max_appended(k: int) -> int:
    """The most tokens any proposer appends to a pass of block size k (sizes KV-cache slack)."""
    return (k - 1) * MAX_MASK_GROUPS


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
    masks_valid: bool  # False when the masks sat after a rejected draft (they predict from a wrong prefix)


class Proposer:
    name = "base"
    needs_hidden = False
    has_confidence = True

    def n_appended(self, k: int, drafts: int = 0) -> int:
        """Tokens appended to a pass of block size k that checks `drafts` drafts."""
        return 0

    def propose(self, view: PassView, k: int, params, gen) -> Guesses:
        raise NotImplementedError


class MaskProposer(Proposer):
    """The self-distilled model's own guesses: k-1 `<mtp_mask>` tokens appended to each pass.

    Under `verify` the masks must follow the prefix that survives verification, unknown before the
    pass. With `branch` (the default) the pass carries one group of k-1 masks after each possible
    accepted prefix (after the pending token, after draft 1, ..., after the last draft), each group
    attending only to its prefix (mtp.core.decode builds the layout), so the next pass always has drafts.
    Without it, masks follow the last draft only and every rejection leaves the next pass draftless:
    on SmolLM2 with the shipped adapter that was half the passes (1.46 tokens/pass for `verify:4`).
    The price is (k-1)·D more rows a pass, cheap where a pass is latency-bound (pipelines, GPUs).
    At most MAX_MASK_GROUPS groups: the extra ones go after 0, 1, ... accepted drafts, the likeliest."""
    name = "mask"

    def __init__(self, branch: bool = True):
        self.branch = branch
        self.name = "mask" if branch else "mask-single"  # `--proposer mask-single`: no branching

    def n_appended(self, k: int, drafts: int = 0) -> int:
        if k <= 1:
            return 0
        return (k - 1) * (1 + (min(drafts, MAX_MASK_GROUPS - 1) if self.branch else 0))

    def propose(self, view: PassView, k: int, params, gen) -> Guesses:
        if k <= 1 or not view.masks_valid or view.mask_logits.shape[0] == 0:
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


PROPOSERS = {"mask": MaskProposer, "mask-single": lambda: MaskProposer(branch=False),
             "lookup": PromptLookupProposer}


def check_proposer(name: str) -> str:
    """`name` if it names a proposer (`heads` lives in mtp.training.heads_train and needs its checkpoint), else ValueError."""
    if name not in ("heads",) + tuple(PROPOSERS):
        raise ValueError(f"unknown proposer {name!r}; choose from heads, {', '.join(sorted(PROPOSERS))}")
    return name


def make_proposer(name: str, **kwargs) -> Proposer:
    if name not in PROPOSERS:
        raise ValueError(f"unknown proposer {name!r}; choose from {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[name](**kwargs)
