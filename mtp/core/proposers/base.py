"""Where proposals for the next tokens come from.

A proposer answers two questions for the decoding loop (mtp.core.decode):
1. `n_appended(k, drafts)`: how many extra tokens to append to the next pass's block so that this pass
   also yields guesses (mask tokens append k-1 masks, and under `verify` one such group per possible
   number of accepted drafts; heads and prompt lookup append nothing);
2. `propose(...)`: after the pass, the guesses for the tokens that follow the model's own token,
   with a confidence each (top-1 probability) and, under sampling, the distribution they came from.
   Before any row's `propose`, every row announces its call (`prepare`, a `DraftRequest`); a proposer
   shared by rows (the heads) may then draft them all at once (`draft_prepared`) and hand each row its
   answer when asked, what it would draft alone (up to the last bits of a matmul over more rows: CPU
   kernels are not batch-invariant); the default does nothing (drafting per row).
The strategy decides what to do with the guesses: emit them unverified (`static`, `conf_adapt`) or
send them as drafts to be checked by the next pass (`verify`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

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


@dataclass
class DraftRequest:
    """One row's coming `propose_tree(view, n)` (tree) or `propose(view, n, params, gen)` (chain: n is
    the block size k), announced to `Proposer.prepare` before any row of the pass drafts."""
    view: PassView
    n: int
    tree: bool
    params: SamplingParams = field(default_factory=lambda: GREEDY)
    gen: torch.Generator | None = None
    # wrappers' clocks (TimedProposer): each is called with this row's share of a batched draft's seconds
    charges: list[Callable[[float], None]] = field(default_factory=list)


class Proposer:
    name = "base"
    needs_hidden = False
    has_confidence = True
    aux_layers: tuple[int, ...] = ()  # trunk layers whose residual streams `propose` needs (PassView.aux)

    def n_appended(self, k: int, drafts: int = 0) -> int:
        """Tokens appended to a pass of block size k that checks `drafts` drafts."""
        return 0

    def prepare(self, request: DraftRequest) -> list["Proposer"]:
        """Announce one row's drafting for this pass (before any row drafts). Returns the proposers
        that took it and must `draft_prepared()` before the rows' `propose` calls (the decoding loop
        calls each once per pass, however many rows they took). Default: none (drafting per row).
        Wrappers forward it; a merge forwards what each part will be asked."""
        return []

    def draft_prepared(self) -> None:
        """Draft every request taken since the last call, so that the announced `propose` /
        `propose_tree` calls return at once, with the guesses they would have drafted alone (up to float
        rounding where the arithmetic is not batch-invariant: `HeadsProposer._draft`)."""

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

    def prepare(self, request: DraftRequest) -> list[Proposer]:
        return self.inner.prepare(request)

    def propose(self, view, k, params, gen):
        return self.inner.propose(view, k, params, gen)

    def propose_tree(self, view, n):
        return self.inner.propose_tree(view, n)


class TimedProposer(WrappedProposer):
    """A row's proposer with its `propose` calls timed into a shared clock (proposer name -> seconds)
    and, given `guesses`, its guesses counted there (name -> count), so a policy can price proposing
    apart from the forward pass (the server's adaptive K; `mtp bench`'s best K: seconds per guess).
    Drafting done for many rows at once (`prepare` / `draft_prepared`, the heads) is charged split
    evenly over the rows it served: each row's clock gets batch seconds / rows, beside the time of
    its own `propose` call (which then only hands out the answer and runs the parts that draft alone)."""

    def __init__(self, inner: Proposer, clock: dict[str, float], guesses: dict[str, int] | None = None):
        super().__init__(inner)
        self.clock, self.guesses = clock, guesses

    def prepare(self, request: DraftRequest) -> list[Proposer]:
        request.charges.append(self._charge)
        return self.inner.prepare(request)

    def _charge(self, seconds: float) -> None:
        self.clock[self.name] = self.clock.get(self.name, 0.0) + seconds

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
