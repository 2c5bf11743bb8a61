"""Merged proposers (`--proposer heads+suffix+lookup`): several sources' trees as one tree.

Each part drafts its own tree for the row (heads: top candidates per depth; suffix: the most frequent
continuations; lookup: every earlier occurrence). A node of the merged tree is a token path from the
root; its score is the best over the parts that proposed it of weight[part] x that part's confidence in
the node (heads: cumulative probability; suffix: the share of matches through it; lookup: 1), and an
ancestor scores at least as high as any descendant. The N best nodes are kept, parents first, shared
prefixes once. Per row and per pass: a prompt that repeats itself gets lookup branches, an answer the
heads predict well gets head branches. The weights are fixed priors (`WEIGHTS`) unless a part comes
calibrated for trees (`mtp tune` fits one map per part and node depth on held-out answers,
`mtp.core.calibration`): its nodes then score by their measured probability of being the model's
continuation, comparable across parts, and its weight is 1.

Attribution: every node carries the names of the parts that drafted it (`Guesses.sources`, in the
order of the parts). A node several parts drafted is credited in full to each of them, not split:
"lookup drafted 40 % of the accepted tokens" then reads the same whether or not heads drafted them
too, and the shares of a row may sum to more than 1 (`metrics.accepted_shares`).
"""

from __future__ import annotations

from dataclasses import replace

from mtp.core.proposers.base import GREEDY, DraftRequest, Guesses, Proposer

WEIGHTS = {"heads": 1.0, "suffix": 0.8, "lookup": 0.5}  # prior trust in each part's confidences


class MergedProposer(Proposer):
    has_confidence = True

    def __init__(self, parts: list[Proposer]):
        if len(parts) < 2:
            raise ValueError("a merged proposer needs at least two parts")
        for p in parts:
            if p.n_appended(4) or p.aux_layers:
                raise ValueError(f"proposer {p.name!r} cannot be merged (it appends masks or keeps its own state)")
        self.parts = parts
        self.name = "+".join(p.name for p in parts)
        self.needs_hidden = any(p.needs_hidden for p in parts)

    def prepare(self, request: DraftRequest) -> list[Proposer]:
        return [p for part in self.parts for p in part.prepare(self._part_request(request))]

    @staticmethod
    def _part_request(request: DraftRequest) -> DraftRequest:
        """What each part is asked: a tree of n nodes, or of 4n for a chain of n."""
        n = request.n if request.tree else 4 * request.n
        return replace(request, n=n, tree=True, params=GREEDY, gen=None)

    def propose(self, request: DraftRequest) -> Guesses:
        """A tree: the merged parts' trees; a chain: the best-scoring root path of the merged tree."""
        g = self._merge(self._part_request(request))
        if request.tree:
            return g
        chain: list[int] = []
        for j in range(len(g.tokens)):
            if g.parents[j] == (chain[-1] if chain else -1) and len(chain) < request.n:
                chain.append(j)
        return Guesses(
            [g.tokens[j] for j in chain], [g.confidences[j] for j in chain], None, None, [g.sources[j] for j in chain]
        )

    def _merge(self, request: DraftRequest) -> Guesses:
        """The n best nodes of the parts' trees (tree `request` of n nodes), scored as the module says."""
        n = request.n
        score: dict[tuple, float] = {}
        drafted_by: dict[tuple, list[str]] = {}  # path -> the parts that drafted it, in part order
        for part in self.parts:
            g = part.propose(request)
            # a part calibrated for trees (mtp tune) scores a node by its probability of being right: no prior
            w = 1.0 if getattr(part, "tree_calibration", None) is not None else WEIGHTS.get(part.name, 0.5)
            paths: list[tuple] = []
            for j, (t, p) in enumerate(zip(g.tokens, g.parents)):
                paths.append((paths[p] if p >= 0 else ()) + (t,))
                conf = g.confidences[j] if j < len(g.confidences) else 1.0
                score[paths[-1]] = max(score.get(paths[-1], 0.0), w * float(conf))
                names = drafted_by.setdefault(paths[-1], [])
                if part.name not in names:
                    names.append(part.name)
        for path in sorted(score, key=len, reverse=True):  # an ancestor is worth at least its best descendant
            if len(path) > 1:
                score[path[:-1]] = max(score[path[:-1]], score[path])
        chosen = sorted(sorted(score, key=lambda q: (-score[q], len(q)))[:n], key=len)
        index: dict[tuple, int] = {}
        tokens, parents, confs, sources = [], [], [], []
        for path in chosen:
            if len(path) > 1 and path[:-1] not in index:
                continue
            index[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(index[path[:-1]] if len(path) > 1 else -1)
            confs.append(score[path])
            sources.append(tuple(drafted_by[path]))
        return Guesses(tokens, confs, None, parents, sources)
