"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram."""
from __future__ import annotations

from mtp.core import tree
from mtp.core.proposers.base import Guesses, PassView, Proposer


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

    def propose_tree(self, view: PassView, n: int) -> Guesses:
        """Every earlier occurrence's continuation, merged into one tree: longer n-grams first, then
        the latest occurrence first; continuations are up to n tokens long."""
        ctx = view.context
        cands: list[list[int]] = []
        for m in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ctx) <= m:
                continue
            tail = ctx[-m:]
            for start in range(len(ctx) - m - 1, -1, -1):
                if ctx[start:start + m] == tail:
                    cont = ctx[start + m:start + m + n]
                    if cont:
                        cands.append(cont)
        tokens, parents = tree.build(cands, n)
        return Guesses(tokens, [1.0] * len(tokens), None, parents)
