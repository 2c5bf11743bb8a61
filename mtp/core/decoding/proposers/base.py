"""Where proposals for the next tokens come from.

A proposer answers two questions for the decoding loop (mtp.core.decoding.decode):
1. `n_appended(k, drafts)`: how many extra tokens to append to the next pass's block so that this pass
   also yields guesses (mask tokens append k-1 masks, and under `verify` one such group per possible
   number of accepted drafts; heads and prompt lookup append nothing);
2. `propose(request)`: after the pass, the guesses for the tokens that follow the model's own token
   (a `DraftRequest`: at most n of them, as a token tree or as a chain, the tree each node of which is
   the child of the one before), with a confidence each (top-1 probability) and, for a chain drawn
   under sampling, the distribution each came from.
   Before any row's `propose`, every row announces its request (`prepare`); a proposer
   shared by rows (the heads) may then draft them all at once (`draft_prepared`) and hand each row its
   answer when asked, what it would draft alone (up to the last bits of a matmul over more rows: CPU
   kernels are not batch-invariant); the default does nothing (drafting per row). The loop times both
   into the row's stats (`DecodeStats.proposing_s`: a batched draft's time split evenly over its rows).
The strategy decides what to do with the guesses: emit them unverified (`static`, `conf_adapt`) or
send them as drafts to be checked by the next pass (`verify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp.core.decoding import tree
from mtp.core.decoding.sampling import SamplingParams

GREEDY = SamplingParams()
MAX_MASK_GROUPS = 8  # mask groups a branched `verify` pass carries at most (see MaskProposer)


def max_appended(k: int) -> int:
    """The most tokens any proposer appends to a pass of block size k (sizes KV-cache slack)."""
    return (k - 1) * MAX_MASK_GROUPS


@dataclass
class Guesses:
    """Proposed tokens as a token tree (a chain being the tree `tree.chain(n)`), with what the decoding
    loop needs beside each: a proposer's answer, and a sequence's drafts (`Sequence.drafts`)."""

    tokens: list[int]
    confidences: list[float]  # top-1 probability of each guess's own distribution
    probs: torch.Tensor | None = None  # [n, V] distributions sampled from (None = greedy/deterministic)
    # each guess's parent in the tree (mtp.core.decoding.tree), -1 = root; always set: None given = a chain
    parents: list[int] | None = None
    # which proposers drafted each guess (a merge's parts, core.decoding.proposers.merged); None = the proposer itself
    sources: list[tuple[str, ...]] | None = None

    def __post_init__(self):
        if self.parents is None:
            self.parents = tree.chain(len(self.tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def none(cls) -> "Guesses":
        return cls([], [], None)

    def select(self, keep: list[int]) -> "Guesses":
        """The guesses at indices `keep` (ascending; a tree's kept nodes must include their parents),
        parents re-indexed, distributions and sources kept alongside."""
        index = {j: i for i, j in enumerate(keep)}
        return Guesses(
            [self.tokens[j] for j in keep],
            [self.confidences[j] for j in keep],
            None if self.probs is None else self.probs[keep],
            [index[self.parents[j]] if self.parents[j] >= 0 else -1 for j in keep],
            None if self.sources is None else [self.sources[j] for j in keep],
        )

    def prefix(self, n: int) -> "Guesses":
        """The first n guesses (parents precede their children: still a tree)."""
        return Guesses(
            self.tokens[:n],
            self.confidences[:n],
            None if self.probs is None else self.probs[:n],
            self.parents[:n],
            None if self.sources is None else self.sources[:n],
        )


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
    """One row's drafting after a pass: at most `n` guesses for the tokens after `view.context[-1]`.
    `tree`: a token tree, chosen without randomness (`tree:N` stays exact under sampling only when
    drafts do not depend on the random state); else a chain (parents `tree.chain`), each guess drawn
    under `params` with `gen`. Announced to `Proposer.prepare` before any row of the pass drafts,
    then asked of `Proposer.propose`."""

    view: PassView
    n: int
    tree: bool = False
    params: SamplingParams = field(default_factory=lambda: GREEDY)
    gen: torch.Generator | None = None


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
        """Draft every request taken since the last call, so that the announced `propose` calls
        return at once, with the guesses they would have drafted alone (up to float rounding where
        the arithmetic is not batch-invariant: `HeadsProposer._draft`)."""

    def propose(self, request: DraftRequest) -> Guesses:
        """What `request` asks: at most request.n guesses, a tree (Guesses.parents) or a chain."""
        raise NotImplementedError

    def modules(self) -> list:
        """The torch modules this proposer runs beside the model (a drafter, heads): what
        `mtp.core.runtime.weights.attach_proposer` puts on the kernels. Default: none."""
        return []


class WrappedProposer(Proposer):
    """A proposer around another one: same name, needs and appended tokens; subclasses change what
    `propose` returns or record it (calibration, recording)."""

    def __init__(self, inner: Proposer):
        self.inner = inner
        self.name, self.needs_hidden, self.has_confidence = inner.name, inner.needs_hidden, inner.has_confidence
        self.aux_layers = getattr(inner, "aux_layers", ())  # trunk layers the inner proposer reads

    def n_appended(self, k: int, drafts: int = 0) -> int:
        return self.inner.n_appended(k, drafts)

    def prepare(self, request: DraftRequest) -> list[Proposer]:
        return self.inner.prepare(request)

    def propose(self, request: DraftRequest) -> Guesses:
        return self.inner.propose(request)
