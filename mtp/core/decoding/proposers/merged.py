"""Merged proposers (`--proposer heads+suffix+lookup`): several sources' trees as one tree.

Each part drafts its own tree for the row (heads: top candidates per depth; suffix: the most frequent
continuations; lookup: every earlier occurrence). A node of the merged tree is a token path from the
root; each part that proposed it gives it weight[part] x that part's confidence in the node (heads,
eagle3: cumulative probability; suffix: the share of matches through it; lookup: 1), clamped to [0, 1],
and its score joins them as independent evidence, 1 - prod(1 - c) (parts that agree on a node make it
likelier than either alone; one part: its c), and an ancestor scores at least as high as any descendant.
The N best nodes are kept, parents first, shared prefixes once. Per row and per pass: a prompt that
repeats itself gets lookup branches, an answer the heads predict well gets head branches. The weights
are fixed priors (`WEIGHTS`) unless a part comes calibrated for trees (`mtp tune` fits one map per part
and node depth on held-out answers, `mtp.core.policy.calibration`): its nodes then score by their measured
probability of being the model's continuation, comparable across parts, and its weight is 1.

Attribution: every node carries the names of the parts that drafted it (`Guesses.sources`, in the
order of the parts). A node several parts drafted is credited in full to each of them, not split:
"lookup drafted 40 % of the accepted tokens" then reads the same whether or not heads drafted them
too, and the shares of a row may sum to more than 1 (`metrics.accepted_shares`).

Parts that keep their own state (EAGLE-3: `aux_layers`, its KV in `PassView.state`): the merge reads
the union of its parts' trunk layers (`aux_layers`, so the decoding loop gathers their streams at the
positions each pass committed, whichever part drafted the accepted nodes) and hands each such part a
view of its own: the streams of its layers only, and its own state (`state[part.name]`, a dict kept
in the sequence's state). Every part is asked on every pass, so EAGLE-3's KV extends by exactly the
committed tokens, as when it drafts alone. Parts that append mask tokens are refused: the groups of
masks a pass carries follow the single proposer's drafts (`Sequence.mask_anchors`), and on a CPU a
mask group costs k - 1 more rows of the trunk per anchor, rows the merged tree's nodes use better.
"""

from __future__ import annotations

from dataclasses import replace

from mtp.core.decoding.proposers.base import GREEDY, DraftRequest, Guesses, Proposer

# prior trust in each part's confidences; suffix and lookup measured on the 60 diverse prompts (issue 50:
# tree:8, replayed) against the earlier 0.8 and 0.5 under max-of-parts scoring: 2.84 against 2.77 tokens/pass
# for heads+suffix+lookup, 3.01 against 2.94 for eagle3+suffix+lookup. heads and eagle3 1.5 (a node the model
# part gives >= 2/3 counts as sure) chosen on 40 held-out prompts none of the diverse 60 (tree:8, 256 tokens,
# decoded): heads merge 3.223 -> 3.266, EAGLE-3 merge 3.433 -> 3.526 tokens/pass; 2.5 gave the same as 1.5
WEIGHTS = {"heads": 1.5, "eagle3": 1.5, "suffix": 0.6, "lookup": 0.3}


class MergedProposer(Proposer):
    has_confidence = True

    def __init__(self, parts: list[Proposer]):
        if len(parts) < 2:
            raise ValueError("a merged proposer needs at least two parts")
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise ValueError(f"a merged proposer names each part once, not {'+'.join(names)}")
        for p in parts:
            if p.n_appended(4):
                raise ValueError(f"proposer {p.name!r} cannot be merged (it appends mask tokens to the pass)")
        self.parts = parts
        self.name = "+".join(names)
        self.needs_hidden = any(p.needs_hidden for p in parts)
        # the union of the parts' trunk layers, in the order they first appear; `_cols` picks a part's
        self.aux_layers = tuple(dict.fromkeys(k for p in parts for k in p.aux_layers))
        self._cols = {id(p): [self.aux_layers.index(k) for k in p.aux_layers] for p in parts if p.aux_layers}

    def prepare(self, request: DraftRequest) -> list[Proposer]:
        r = self._part_request(request)
        return [p for part in self.parts for p in part.prepare(self._own(part, r))]

    def _own(self, part: Proposer, request: DraftRequest) -> DraftRequest:
        """`request` as `part` sees it: a part that keeps state (aux_layers) gets the trunk streams of its
        own layers and its own state (`state[part.name]`); the others the request as it is."""
        cols = self._cols.get(id(part))
        if cols is None:
            return request
        v = request.view
        aux = v.aux
        if aux is not None and list(cols) != list(range(len(self.aux_layers))):
            dim = aux.shape[-1] // len(self.aux_layers)
            aux = aux.view(*aux.shape[:-1], len(self.aux_layers), dim)[..., cols, :].flatten(-2)
        state = None if v.state is None else v.state.setdefault(part.name, {})
        return replace(request, view=replace(v, aux=aux, state=state))

    @staticmethod
    def _part_request(request: DraftRequest) -> DraftRequest:
        """What each part is asked: a tree of n nodes, or of 4n for a chain of n."""
        n = request.n if request.tree else 4 * request.n
        return replace(request, n=n, tree=True, params=GREEDY, gen=None)

    def propose(self, request: DraftRequest) -> Guesses:
        """A tree: the merged parts' trees; a chain: the best-scoring root path of the merged tree. Asked
        for nothing (a pass capped to K = 1), only the parts that keep state are told of the pass."""
        if request.n <= 0:
            for part in self.parts:
                if part.aux_layers:
                    part.propose(self._own(part, self._part_request(request)))
            return Guesses.none()
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
        for part in self.parts:  # every part, every pass: a stateful one follows each committed token
            g = part.propose(self._own(part, request))
            # a part calibrated for trees (mtp tune) scores a node by its probability of being right: no prior
            w = 1.0 if getattr(part, "tree_calibration", None) is not None else WEIGHTS.get(part.name, 0.5)
            paths: list[tuple] = []
            for j, (t, p) in enumerate(zip(g.tokens, g.parents)):
                paths.append((paths[p] if p >= 0 else ()) + (t,))
                conf = g.confidences[j] if j < len(g.confidences) else 1.0
                c = min(max(w * float(conf), 0.0), 1.0)
                score[paths[-1]] = 1.0 - (1.0 - score.get(paths[-1], 0.0)) * (1.0 - c)
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
