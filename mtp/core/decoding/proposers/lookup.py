"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram."""

from __future__ import annotations

from mtp.core.decoding import tree
from mtp.core.decoding.proposers.base import DraftRequest, Guesses, Proposer


class PromptLookupProposer(Proposer):
    """Baseline: copy the continuation of the latest earlier occurrence of the last n-gram."""

    name = "lookup"
    has_confidence = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def continuations(self, ctx: list[int], depth: int):
        """What followed each earlier occurrence of the context's last n-gram, at most `depth` tokens:
        longer n-grams first, then the latest occurrence first (a generator: a chain takes the first)."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ctx) <= n:
                continue
            tail = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start : start + n] == tail:
                    cont = ctx[start + n : start + n + depth]
                    if cont:
                        yield cont

    def propose(self, request: DraftRequest) -> Guesses:
        """A chain: the latest occurrence's continuation; a tree: every earlier occurrence's, merged
        into one tree (shared prefixes once)."""
        ctx, n = request.view.context, request.n
        if request.tree:
            tokens, parents = tree.build(list(self.continuations(ctx, n)), n)
            return Guesses(tokens, [1.0] * len(tokens), None, parents)
        cont = next(self.continuations(ctx, n), None)
        return Guesses(cont, [1.0] * len(cont), None) if cont else Guesses.none()
