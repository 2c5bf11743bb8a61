"""Token trees: drafts that branch, verified in one forward pass (strategy `tree:N`).

A tree of N draft nodes is two lists: `tokens[j]` and `parents[j]` (-1: a child of the root, the
position whose prediction is the pass's own next token; otherwise an earlier node, so parents[j] < j).
A chain of drafts is the tree parents = [-1, 0, 1, ...].

Layout (one row of a pass; c = the row's cache length, P = its pending tokens): node j is fed at block
index P + j and written to cache slot c + P + j; its RoPE position is c + P - 1 + depth(j) (depth 1 for
a child of the root), and it attends to the committed prefix, the pending tokens, and its own
ancestors and itself only. E.g. P = 1, tokens [a, b, x], parents [-1, 0, -1] (a->b, and a sibling x):

    block   p     a     b     x
    slot    c     c+1   c+2   c+3
    RoPE    c     c+1   c+2   c+1
    sees    ..c   ..c,a ..c,a,b ..c,x

Acceptance (`accept`): walk from the root; at each node take the model's own token for the position
(greedy: argmax; sampling: one sample of the model's distribution, drawn exactly as plain decoding
draws it) and descend into the child holding that token, if there is one. Every emitted token is the
model's own choice, so the output equals plain decoding's, token for token (greedy) and draw for draw
(sampling with a seed: one sample per emitted token, in order). Drafts must not depend on the random
state (tree proposers pick top-k deterministically), so the tree only decides how many of the model's
own tokens one pass can confirm.

Size (`tree:auto`, `keep` / `prune`): a node's confidence estimates the probability that its whole root path is
the model's continuation (heads: the path's probability; calibrated by `mtp tune`: measured), so a tree
of nodes with confidences p_1..p_n is expected to confirm 1 + sum(p) tokens per pass; of the drafted
nodes, the most confident prefix whose expected tokens per second E / t(1 + n) is highest is kept (n = 0:
a plain pass; t also pays the mask groups a pass of n nodes appends), per row and per pass (a Sequoia-style
budgeted choice, greedy on confidences). The confidences priced are the row's `trusted` ones: corrected per
depth by what the row's earlier trees promised against what they delivered (`record_trust`).

Mask groups (`with_groups`): a pass that also wants `<mtp_mask>` guesses (the mask proposer) appends
g masks after chosen nodes ("anchors", -1 = the root), each group laid out as a chain of g extra nodes
under its anchor: it sees the prefix, the anchor's root path and the earlier masks of its own group,
at the RoPE positions that follow the anchor. In the example above, groups of g = 2 after the root and
after b (anchors [-1, 1]: masks m1 m2 after the root, n1 n2 after b) extend parents to
[-1, 0, -1, -1, 3, 1, 5]:

    block   p     a     b       x     m1     m2        n1          n2
    slot    c     c+1   c+2     c+3   c+4    c+5       c+6         c+7
    RoPE    c     c+1   c+2     c+1   c+1    c+2       c+3         c+4
    sees    ..c   ..c,a ..c,a,b ..c,x ..c,m1 ..c,m1,m2 ..c,a,b,n1  ..c,a,b,n1,n2

If acceptance stops at an anchor, its group's logits guess the tokens after the model's own next token.

Drafting (`grow`): from one next-token distribution per frontier node, depth by depth (EAGLE-2's idea):
the top-k tokens under every frontier node, the candidates with the highest path probability kept.

Commit: the accepted path's keys and values sit at slots c+P+path[t]; `compact` moves them to the
contiguous slots c+P+t (parents precede children, so path[t] >= t and no source is overwritten
before it is read); everything else beyond the committed length (other nodes, every mask) is dropped
as usual.
"""

from __future__ import annotations

from typing import Callable

import torch

from mtp.core.decoding.sampling import SamplingParams, pick


def chain(n: int) -> list[int]:
    """The parents of a chain of n nodes, each the child of the one before: [-1, 0, 1, ..., n-2]."""
    return list(range(-1, n - 1))


def depths(parents: list[int]) -> list[int]:
    """Depth of every node (a child of the root has depth 1)."""
    out: list[int] = []
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"tree node {j} has parent {p}: parents must precede their children")
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestors(parents: list[int], j: int) -> list[int]:
    """Node j and its ancestors, root-most first."""
    line = []
    while j >= 0:
        line.append(j)
        j = parents[j]
    return line[::-1]


def apply_layout(positions: torch.Tensor, attn: torch.Tensor, row: int, c: int, P: int, parents: list[int]) -> None:
    """Write one row's tree layout into positions [B, T] and attn [B, T, S] (bool, True = attend):
    node j at block index P + j, RoPE position c + P - 1 + depth(j), seeing slots 0..c+P-1 and the
    slots c+P+i of its ancestors i and itself. The tree's own [n, n] part is built in Python lists (a
    node sees what its parent sees, and itself) and written with one copy: a few tensor calls a row,
    whatever the tree's depth."""
    n = len(parents)
    if not n:
        return
    depth: list[int] = []
    seen: list[list[bool]] = []  # seen[r][j]: node r sees node j
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"tree node {j} has parent {p}: parents must precede their children")
        depth.append(1 if p < 0 else depth[p] + 1)
        line = [False] * n if p < 0 else seen[p].copy()
        line[j] = True
        seen.append(line)
    positions[row, P : P + n] = torch.tensor(depth) + (c + P - 1)
    rows = attn[row, P : P + n]  # [n, S] view
    rows[:, : c + P] = True
    rows[:, c + P :] = False
    rows[:, c + P : c + P + n] = torch.tensor(seen)


def with_groups(parents: list[int], anchors: list[int], g: int) -> list[int]:
    """`parents` extended by g mask nodes after each anchor in turn (-1 = the root): a chain under
    its anchor, so `apply_layout` places and masks the groups too. E.g. parents [-1, 0, -1], anchors
    [-1, 1], g = 2 -> [-1, 0, -1, -1, 3, 1, 5]."""
    out = list(parents)
    for a in anchors:
        prev = a
        for _ in range(g):
            out.append(prev)
            prev = len(out) - 1
    return out


def own_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """The model's own next token from one row of logits [V], drawn as plain decoding draws it."""
    return int(pick(logits.view(1, -1), params, gen)[0][0])


def accept(
    logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams, gen: torch.Generator | None
) -> tuple[list[int], int]:
    """(the accepted path of node indices, root-most first; the model's own token after it).

    logits: [1 + N, V]: row 0 predicts after the last pending token, row 1 + j after node j."""
    children: dict[int, dict[int, int]] = {}
    for j, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault(p, {}).setdefault(t, j)  # a repeated sibling token: the first one counts
    path: list[int] = []
    node, row = -1, 0
    while True:
        own = own_token(logits[row], params, gen)
        nxt = children.get(node, {}).get(own)
        if nxt is None:
            return path, own
        path.append(nxt)
        node, row = nxt, 1 + nxt


def grow(
    n: int,
    max_depth: int,
    expand: Callable[[list[int], list[int]], torch.Tensor],
    root_token: int,
    top_k: int = 4,
    vocab: torch.Tensor | None = None,
) -> tuple[list[int], list[int], list[float]]:
    """At most n nodes, depth by depth (EAGLE-2's idea): every frontier node's distribution gives its
    top_k next tokens; the candidates with the highest cumulative probability (product of the
    probabilities along the path) are kept, ceil(n / max_depth) per depth, until n nodes are placed.
    Deterministic (top-k, never sampled), so `tree:N` stays exact under sampling too; a node's path
    probability never exceeds its parent's, so `keep`'s prefixes are trees. Returns (tokens, parents,
    path probabilities), parents before children.

    expand(rows, tokens) -> log-probabilities [F, V] of the token after each of the F frontier nodes,
    called once per depth: rows[i] is the row of the previous call's result that frontier node i was
    drawn from, tokens[i] its token (first call: rows [0], tokens [root_token], the root). Column v
    stands for token v, or for vocab[v] when a vocabulary [V] is given (the heads' draft vocabulary).
    (`Grower` is the same, one depth at a time, for callers that grow many trees together.)"""
    g = Grower(n, max_depth, root_token, top_k, vocab)
    while not g.done:
        g.step(expand(g.rows, g.toks))
    return g.tokens, g.parents, g.confs


class Grower:
    """`grow`'s state between depths, for a caller that expands many trees' frontiers in one call
    (the heads drafting every row of a pass at once): while not `done`, feed `step` the
    log-probabilities [F, V] after the F frontier nodes (`rows` / `toks`, as `grow`'s expand gets
    them); then `tokens`, `parents`, `confs` are `grow`'s result, identical to it."""

    def __init__(self, n: int, max_depth: int, root_token: int, top_k: int = 4, vocab: torch.Tensor | None = None):
        self.n, self.max_depth, self.top_k, self.vocab = n, max_depth, top_k, vocab
        self.width = -(-n // max_depth) if max_depth > 0 else 0
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.confs: list[float] = []
        self.frontier, self.rows, self.toks = [-1], [0], [root_token]  # frontier nodes (-1: the root), sources
        self.score = torch.zeros(1)  # [F] the frontier's cumulative log-probabilities
        self.depth = 0

    @property
    def room(self) -> int:
        return min(self.width, self.n - len(self.tokens))

    @property
    def done(self) -> bool:
        return self.depth >= self.max_depth or self.room <= 0 or not self.frontier

    def step(self, logp: torch.Tensor) -> None:
        """Place the next depth's nodes from logp [F, V], one row per frontier node (in `rows` order)."""
        room = self.room
        val, idx = logp.topk(min(self.top_k, logp.shape[-1]), -1)  # [F, top_k]
        cum = self.score.view(-1, 1) + val  # [F, top_k]
        order = cum.flatten().argsort(descending=True)[:room].tolist()
        k = val.shape[1]
        ids = (idx if self.vocab is None else self.vocab[idx]).flatten().tolist()  # Python lists from here
        probs = cum.exp().flatten().tolist()  # the paths' probabilities (what a merge compares)
        nxt, rows, toks = [], [], []
        for o in order:
            f = o // k
            nxt.append(len(self.tokens))
            rows.append(f)
            toks.append(ids[o])
            self.tokens.append(ids[o])
            self.parents.append(self.frontier[f])
            self.confs.append(probs[o])
        self.frontier, self.rows, self.toks, self.score = nxt, rows, toks, cum.flatten()[order]
        self.depth += 1


def build(candidates: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """Merge token sequences into one tree (shared prefixes once), at most `budget` nodes, the
    earlier candidates first (callers order them by how much they trust them): (tokens, parents)."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for cand in candidates:
        node = -1
        for t in cand:
            key = (node, t)
            if key not in index:
                if len(tokens) >= budget:
                    break
                index[key] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = index[key]
    return tokens, parents


def prune(
    tokens: list[int],
    parents: list[int],
    confidences: list[float],
    pass_time,
    pending: int = 1,
    appended: Callable[[int], int] | None = None,
):
    """The most confident nodes worth their rows: (tokens, parents, confidences) of the nodes `keep` keeps."""
    kept = keep(parents, confidences, pass_time, pending, appended)
    index = {j: i for i, j in enumerate(kept)}
    return (
        [tokens[j] for j in kept],
        [index[parents[j]] if parents[j] >= 0 else -1 for j in kept],
        [confidences[j] for j in kept],
    )


TRUST_PRIOR = 2.0  # passes' worth of "the confidences are right" a row's trust starts with


def trusted(parents: list[int], confidences: list[float], trust: list[list[float]]) -> list[float]:
    """The confidences a row's own record says to believe (online correction): a node at depth d keeps
    its confidence times f_d = (accepted_d + TRUST_PRIOR) / (promised_d + TRUST_PRIOR), where promised_d
    sums the confidences of the depth-d nodes of the row's earlier trees and accepted_d counts the passes
    whose accepted path reached depth d (`record_trust`); clipped to [0, 1] and to its parent's value, so
    every prefix of `ranked` stays a tree. Raw merged scores (lookup's 1.0, a suffix match's share)
    over-promise several-fold on text they do not fit; after a few passes this prices them at what
    they deliver. With no record (`trust` empty) the confidences come back as they are, clipped."""
    d = depths(parents)
    out: list[float] = []
    for j, c in enumerate(confidences):
        f = 1.0
        if d[j] <= len(trust):
            promised, accepted = trust[d[j] - 1]
            f = (accepted + TRUST_PRIOR) / (promised + TRUST_PRIOR)
        v = min(max(float(c) * f, 0.0), 1.0)
        out.append(min(v, out[parents[j]]) if parents[j] >= 0 else v)
    return out


def record_trust(trust: list[list[float]], parents: list[int], confidences: list[float], accepted: int) -> None:
    """Add one pass to a row's record (in place): per depth d, the confidences its tree's depth-d nodes
    promised, and whether the accepted path (`accepted` nodes long) reached depth d."""
    for dj, c in zip(depths(parents), confidences):
        while len(trust) < dj:
            trust.append([0.0, 0.0])
        trust[dj - 1][0] += min(max(float(c), 0.0), 1.0)
    for dj in range(1, accepted + 1):
        while len(trust) < dj:
            trust.append([0.0, 0.0])
        trust[dj - 1][1] += 1.0


def ranked(parents: list[int], confidences: list[float]) -> list[int]:
    """Node indices by confidence, most confident first (ties: shallower first, then by index), cut
    before the first node whose parent is not yet in it (a proposer breaking the rule that a confidence
    never exceeds its parent's) and before nodes of confidence <= 0: every prefix of it is a tree, and
    its first n nodes are the tree's n-node subtree of the largest total confidence."""
    d = depths(parents)
    p = [min(max(float(c), 0.0), 1.0) for c in confidences]
    out: list[int] = []
    kept: set[int] = set()
    for j in sorted(range(len(parents)), key=lambda j: (-p[j], d[j], j)):
        if p[j] <= 0 or (parents[j] >= 0 and parents[j] not in kept):
            break
        kept.add(j)
        out.append(j)
    return out


def keep(
    parents: list[int],
    confidences: list[float],
    pass_time,
    pending: int = 1,
    appended: Callable[[int], int] | None = None,
) -> list[int]:
    """Indices (ascending, so parents still precede children) of the prefix of `ranked`'s order that
    maximises (1 + sum of its confidences) / t(pending + n + appended(n)), appended(n) being the tokens
    a pass of n nodes appends besides them (mask groups; default none)."""
    extra = appended or (lambda n: 0)
    order = ranked(parents, confidences)
    best_n, best_rate, expected = 0, 1.0 / pass_time(pending + extra(0)), 1.0
    for n, j in enumerate(order, 1):
        expected += min(float(confidences[j]), 1.0)
        rate = expected / pass_time(pending + n + extra(n))
        if rate > best_rate:
            best_n, best_rate = n, rate
    return sorted(order[:best_n])
