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

import time
from dataclasses import dataclass

import torch

from mtp.core.sampling import SamplingParams

GREEDY = SamplingParams()
MAX_MASK_GROUPS = 8  # mask groups a branched `verify` pass carries at most (see MaskProposer)


def max_appended(k: int) -> int:
    """The most tokens any proposer appends to a pass of block size k (sizes KV-cache slack)."""
    return (k - 1) * MAX_MASK_GROUPS


@dataclass
class Guesses:
    tokens: list[int]
    confidences: list[float]  # top-1 probability of each guess's own distribution
    probs: torch.Tensor | None = None  # [n, V] distributions sampled from (None = greedy/deterministic)
    parents: list[int] | None = None  # a token tree (mtp.core.tree): each guess's parent, -1 = root; None = chain
    # which proposers drafted each guess (a merge's parts, mtp.core.proposers.merged); None = the proposer itself
    sources: list[tuple[str, ...]] | None = None

    @classmethod
    def none(cls) -> "Guesses":
        return cls([], [], None)

    def select(self, keep: list[int]) -> "Guesses":
        """The guesses at indices `keep` (ascending; a tree's kept nodes must include their parents),
        parents re-indexed, distributions and sources kept alongside."""
        index = {j: i for i, j in enumerate(keep)}
        return Guesses([self.tokens[j] for j in keep], [self.confidences[j] for j in keep],
                       None if self.probs is None else self.probs[keep],
                       None if self.parents is None else [index[self.parents[j]] if self.parents[j] >= 0 else -1
                                                          for j in keep],
                       None if self.sources is None else [self.sources[j] for j in keep])


@dataclass
class PassView:
    """What one row's forward pass produced, as a proposer needs it."""
    context: list[int]  # prompt + every token decided so far, the model's own token included
    mask_logits: torch.Tensor  # [M, V] logits at the appended mask positions (M may be 0)
    hidden: torch.Tensor | None  # [dim] last-layer hidden state at the last accepted input position
    masks_valid: bool  # False when the masks sat after a rejected draft (they predict from a wrong prefix)
    # for proposers with `aux_layers` (EAGLE-3): what this pass committed, and the row's own state
    aux: torch.Tensor | None = None  # [n, A*dim] trunk residual streams at the n positions this pass committed
    start: int = 0  # position of the first of them (the row's cache length before the pass)
    state: dict | None = None  # the sequence's proposer state (Sequence.proposer_state), kept across passes


class Proposer:
    name = "base"
    needs_hidden = False
    has_confidence = True
    aux_layers: tuple[int, ...] = ()  # trunk layers whose residual streams `propose` needs (PassView.aux)

    def n_appended(self, k: int, drafts: int = 0) -> int:
        """Tokens appended to a pass of block size k that checks `drafts` drafts."""
        return 0

    def propose(self, view: PassView, k: int, params, gen) -> Guesses:
        raise NotImplementedError

    def propose_tree(self, view: PassView, n: int) -> Guesses:
        """At most n draft nodes as a tree (Guesses.parents), chosen without randomness (`tree:N`
        stays exact under sampling only when drafts do not depend on the random state). The default
        is the proposer's greedy chain."""
        g = self.propose(view, n + 1, GREEDY, None)
        return Guesses(g.tokens, g.confidences, None, list(range(-1, len(g.tokens) - 1)))


class WrappedProposer(Proposer):
    """A proposer around another one: same name, needs and appended tokens; subclasses change what
    `propose` / `propose_tree` return or record (timing, calibration, recording)."""

    def __init__(self, inner: Proposer):
        self.inner = inner
        self.name, self.needs_hidden, self.has_confidence = inner.name, inner.needs_hidden, inner.has_confidence
        self.aux_layers = getattr(inner, "aux_layers", ())  # trunk layers the inner proposer reads

    def n_appended(self, k: int, drafts: int = 0) -> int:
        return self.inner.n_appended(k, drafts)

    def propose(self, view, k, params, gen):
        return self.inner.propose(view, k, params, gen)

    def propose_tree(self, view, n):
        return self.inner.propose_tree(view, n)


class TimedProposer(WrappedProposer):
    """A row's proposer with its `propose` calls timed into a shared clock (proposer name -> seconds)
    and, given `guesses`, its guesses counted there (name -> count), so a policy can price proposing
    apart from the forward pass (the server's adaptive K; `mtp bench`'s best K: seconds per guess)."""

    def __init__(self, inner: Proposer, clock: dict[str, float], guesses: dict[str, int] | None = None):
        super().__init__(inner)
        self.clock, self.guesses = clock, guesses

    def propose_tree(self, view, n):
        t0 = time.perf_counter()
        out = self.inner.propose_tree(view, n)
        self.clock[self.name] = self.clock.get(self.name, 0.0) + time.perf_counter() - t0
        if self.guesses is not None:
            self.guesses[self.name] = self.guesses.get(self.name, 0) + len(out.tokens)
        return out

    def propose(self, view, k, params, gen):
        t0 = time.perf_counter()
        out = self.inner.propose(view, k, params, gen)
        self.clock[self.name] = self.clock.get(self.name, 0.0) + time.perf_counter() - t0
        if self.guesses is not None:
            self.guesses[self.name] = self.guesses.get(self.name, 0) + len(out.tokens)
        return out
