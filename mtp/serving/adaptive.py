"""The server's adaptive K: per pass, the cap on K that maximises expected tokens per second of the
whole batch, priced with the measured pass times (`mtp.core.policy.costmodel` at start-up, then what the
passes themselves took). K = 1 means no proposals this pass; capping K keeps lossless strategies
(`ntp`, `verify`) exact, and a capped `static` / `conf_adapt` pass emits what `conf_adapt:TAU:K` would.
Token trees (`tree:N`, `tree:auto`) are priced by their nodes, not as chains (`AdaptiveK.choose`): a cap
K lets every tree row check and draft at most K - 1 nodes, its n most confident ones (`trim_tree`).
"""

from __future__ import annotations

import math
from typing import Callable

from mtp.core.decoding import tree
from mtp.core.decoding.decode import Sequence


def ranked_confidences(parents: list[int], confidences: list[float]) -> list[float]:
    """A tree's node confidences in `tree.ranked`'s order, most confident first, each at most 1: the
    first n of them sum to what its best n-node subtree adds to the expected tokens, so a budget of
    n nodes expects 1 + their sum."""
    return [min(float(confidences[j]), 1.0) for j in tree.ranked(parents, confidences)]


def top_nodes(parents: list[int], confidences: list[float], n: int) -> list[int]:
    """Indices (ascending) of a tree's n most confident nodes (`tree.ranked`; fewer when it is shorter)."""
    return sorted(tree.ranked(parents, confidences)[:n])


class AdaptiveK:
    """Per-pass cap on K: expected tokens per second of the whole batch, from the cost model.

    For a cap K every row r yields E_r(K) = 1 + sum_{i<K} prod_{j<=i} p_j tokens (p_j: running rate at which
    position j is emitted once position j-1 was, per strategy and proposer). The pass feeds q = rows x max_r
    block_r(K) tokens (right padding; blocks in steady state under K, where a conf_adapt/static row feeds back what
    it emitted) and makes P = sum_r (K_r - 1) proposals, so it takes T(K) = t'(q) + c * P. t'(q): the running
    observed time of decoding passes of q tokens, with or without mask tokens (those also run the adapter), once
    seen; between observed sizes, interpolated from the neighbours (t(q) is far from linear on a CPU); beyond them,
    a line a + b*q fitted to recent passes (once two block sizes were seen); else scale * t(q) from the start-up
    cost model, `scale` the running ratio of observed to modelled time (the machine's load now). Pass times exclude
    proposing; `c` is the running measured time of one proposal depth per proposer (the heads proposer runs its
    heads and the LM head per row and depth; the mask proposer almost nothing). The cap maximising sum_r E_r(K) /
    T(K) wins if it beats K = 1 by `margin`, with an exploring pass now and then while K = 1 wins. Unseen positions
    start from the previous position's rate (position 1 from `prior`), and `c` starts at 0, so a cheap enough K gets
    tried and then learnt.

    A batch with a token-tree row is priced by `_tree_rates` instead (its docstring states that
    contract): a tree row's candidates are node budgets, not chain depths.
    """

    EXPLORE_PASSES = 3  # an exploring verify row needs a pass to draft before passes that check drafts

    def __init__(
        self,
        pass_time: Callable[[float], float],
        prior: float = 0.5,
        prior_weight: float = 2.0,
        window: float = 2000.0,
        smoothing: float = 0.1,
        margin: float = 0.05,
        explore_every: int = 128,
    ):
        self.pass_time, self.prior, self.w, self.window = pass_time, prior, prior_weight, window
        # while K = 1 wins, every `explore_every`-th pass proposes anyway (the best K > 1): without it one
        # slow sample of a proposing pass, or acceptance learnt long ago, would keep K = 1 for good
        self.explore_every, self.decisions, self.exploring = explore_every, 0, 0
        self.margin = margin  # proposals must promise this much over K=1: what the model leaves out
        # (per-row verify and sampling work, prediction error) must not turn a predicted tie into a loss
        self.reached: dict[str, list[float]] = {}
        self.accepted: dict[str, list[float]] = {}
        self.alpha = smoothing
        self.scale = 1.0  # observed / modelled time of passes, proposing excluded
        self.proposal_s: dict[str, float] = {}  # proposer name -> seconds per proposal depth
        self.seen: dict[tuple[int, bool], tuple[float, int]] = {}  # (q, masks) -> (running seconds, passes)
        self.fit: dict[bool, list[float]] = {}  # masks -> decayed sums for t = a + b*q: n, q, t, q*q, q*t
        # token trees: per strategy|proposer and confidence rank i, [trees drafted with room for an
        # (i+1)-th node, how many had one, the sum of its confidences] (`observe_tree`)
        self.ranks: dict[str, list[list[float]]] = {}
        # per proposer, decayed sums for tree proposing s = a*rows + b*nodes: rr, rn, nn, rs, ns
        self.node_fit: dict[str, list[float]] = {}
        # token trees: per strategy|proposer, [drafts accepted, sum of the checked nodes' confidences]
        # over recent passes (`observe_tree_outcome`): how far the confidences over- or under-promise
        self.tree_truth: dict[str, list[float]] = {}

    @staticmethod
    def key(seq: Sequence) -> str:
        return f"{seq.strategy}|{seq.proposer.name}"

    def rates(self, key: str, n: int) -> list[float]:
        """[p_1 .. p_n] conditional emission rates of positions 1..n."""
        reached, accepted = self.reached.get(key, []), self.accepted.get(key, [])
        out, prev = [], self.prior
        for i in range(n):
            r = reached[i] if i < len(reached) else 0.0
            a = accepted[i] if i < len(accepted) else 0.0
            prev = (a + self.w * prev) / (r + self.w)
            out.append(prev)
        return out

    def expected(self, seq: Sequence, k: int) -> float:
        k = min(k, seq.strategy.k)
        if k <= 1:
            return 1.0
        total, run = 1.0, 1.0
        for p in self.rates(self.key(seq), k - 1):
            run *= p
            total += run
        return total

    @staticmethod
    def block(seq: Sequence, k: int, steady: bool = False, pending: float | None = None) -> float:
        """Tokens the row feeds a pass with cap k: pending + drafts checked + appended masks.

        steady: the row as it is in steady state under cap k (`Strategy.steady_block`), which is what
        the cap is chosen on; pricing a `verify` row on this pass's drafts instead would make the
        cap oscillate (a draftless pass looks cheap, the next one dear). `pending`: the expected
        tokens a non-verify row feeds back (see `steady_pending`), default k."""
        k = min(k, seq.strategy.k)
        if not steady:
            drafts = min(len(seq.drafts), k - 1)
            return len(seq.pending) + drafts + seq.proposer.n_appended(seq.strategy.guess_k(k), drafts)
        return seq.strategy.steady_block(k, seq.proposer, pending)

    def steady_pending(self, seqs: list[Sequence], k: int, ks: list[int] | None = None) -> float:
        """Expected padded pending length next pass under cap k (row r at K = ks[r], default min(k, its
        K)): the most tokens any non-verify row emits, E[max_r n_r] = sum_n P(some row emits >= n),
        each row's P(n_r >= n) from its rates."""
        ks = ks or [min(k, s.strategy.k) for s in seqs]
        top = max(ks, default=1)
        none_reach = [1.0] * (top + 1)  # n -> P(no row emits >= n)
        for s, kk in zip(seqs, ks):
            if s.strategy.verifies:
                continue
            reach, rates = 1.0, self.rates(self.key(s), kk - 1)
            for n in range(1, kk + 1):
                if n > 1:
                    reach *= rates[n - 2]
                none_reach[n] *= 1 - reach
        return sum(1 - none_reach[n] for n in range(1, top + 1))

    @staticmethod
    def proposals(seqs: list[Sequence], ks: list[int] | None = None) -> dict[str, int]:
        """Proposal depths a pass makes per proposer (each chain row with K > 1 proposes K - 1; row r's
        K is ks[r], default its K this pass). Tree rows are counted by `tree_requests`."""
        out: dict[str, int] = {}
        for s, kk in zip(seqs, ks or [s.k for s in seqs]):
            if kk > 1 and not s.strategy.is_tree:
                out[s.proposer.name] = out.get(s.proposer.name, 0) + kk - 1
        return out

    @staticmethod
    def tree_requests(seqs: list[Sequence], ks: list[int] | None = None) -> dict[str, tuple[int, int]]:
        """Per proposer, (tree rows that draft, nodes they ask for) after a pass: a tree row with K > 1
        asks for K - 1 nodes (row r's K is ks[r], default its K this pass)."""
        out: dict[str, tuple[int, int]] = {}
        for s, kk in zip(seqs, ks or [s.k for s in seqs]):
            if kk > 1 and s.strategy.is_tree:
                rows, nodes = out.get(s.proposer.name, (0, 0))
                out[s.proposer.name] = (rows + 1, nodes + kk - 1)
        return out

    def node_cost(self, name: str) -> tuple[float, float]:
        """(a, b): seconds a tree row of proposer `name` spends drafting, a per row plus b per node
        asked for (least squares over recent passes; while every pass asked the same nodes per row,
        rows and nodes cannot be told apart and all of it is b, per node). (0, 0) until timed."""
        rr, rn, nn, rs, ns = self.node_fit.get(name, [0.0] * 5)
        if nn <= 0:
            return 0.0, 0.0
        det = rr * nn - rn * rn
        if det > 0.01 * rr * nn:  # nodes per row varied enough (squared correlation of rows and nodes < 0.99)
            a, b = (rs * nn - ns * rn) / det, (ns * rr - rs * rn) / det
            if a >= 0 and b >= 0:
                return a, b
            if b < 0:  # a negative part is noise: fit the other one alone
                return max(0.0, rs / rr), 0.0
        return 0.0, max(0.0, ns / nn)

    def tree_proposing_time(self, requests: dict[str, tuple[int, int]]) -> float:
        """Predicted seconds tree rows spend drafting, for `tree_requests(...)`."""
        total = 0.0
        for name, (rows, nodes) in requests.items():
            a, b = self.node_cost(name)
            total += a * rows + b * nodes
        return total

    def trunk_time(self, q: float, masks: bool = False) -> float:
        """Predicted seconds of a pass feeding q tokens, proposing excluded. Passes with mask tokens
        (`masks`) are timed apart: they also run the adapter's low-rank path, a cost per pass that
        passes of the same q without masks (plain decoding, capped rows) do not pay."""
        t = self._observed(q, masks)
        if t is None and masks:
            t = self._observed(q, False)  # no pass with masks timed yet: price it as one without
        return t if t is not None else self.scale * self.pass_time(q)

    def _observed(self, q: float, masks: bool) -> float | None:
        seen = {k: v for (k, m), v in self.seen.items() if m == masks}
        if q in seen:
            return seen[q][0]
        below = max((k for k in seen if k < q), default=None)
        above = min((k for k in seen if k > q), default=None)
        if below is not None and above is not None:  # between observed block sizes: interpolate
            (t0, _), (t1, _) = seen[below], seen[above]
            return t0 + (t1 - t0) * (q - below) / (above - below)
        line = self.line(masks)
        return None if line is None else line[0] + line[1] * q

    def line(self, masks: bool = False) -> tuple[float, float] | None:
        """(a, b) of t = a + b*q over recent passes (with or without masks); None until two block sizes
        were seen."""
        n, sq, st, sqq, sqt = self.fit.get(masks, [0.0] * 5)
        var = n * sqq - sq * sq
        if sum(1 for (_, m) in self.seen if m == masks) < 2 or var <= 1e-9 * max(n * sqq, 1e-12):
            return None
        b = max(0.0, (n * sqt - sq * st) / var)
        a = max(0.0, (st - b * sq) / n)
        return a, b

    def predicted_time(self, q: float, proposals: dict[str, int], masks: bool = False) -> float:
        return self.trunk_time(q, masks) + sum(self.proposal_s.get(n, 0.0) * d for n, d in proposals.items())

    def observe_time(
        self,
        q: int,
        proposals: dict[str, float],
        seconds: float,
        proposing_s: dict[str, float] | None = None,
        masks: bool = False,
        tree_requests: dict[str, tuple[int, int]] | None = None,
        tree_proposing_s: dict[str, float] | None = None,
    ) -> None:
        """One pass of q tokens (with mask tokens or not) took `seconds`, of which proposing_s[name]
        went into `proposals[name]` proposal depths of chain rows and tree_proposing_s[name] into
        drafting `tree_requests[name]` = (tree rows, nodes asked for) (both timed by the decoding loop):
        calibrate `scale`, the observed times, the per-depth costs and the per-row/per-node costs."""
        proposing_s, tree_proposing_s = proposing_s or {}, tree_proposing_s or {}
        trunk = max(seconds - sum(proposing_s.values()) - sum(tree_proposing_s.values()), 1e-9)
        self.scale += self.alpha * (trunk / self.pass_time(q) - self.scale)
        prev, n = self.seen.get((q, masks), (trunk, 0))
        self.seen[(q, masks)] = (prev + max(self.alpha, 1 / (n + 1)) * (trunk - prev), n + 1)
        decay = 1 - self.alpha / 5  # the line remembers ~50 passes
        fit = self.fit.get(masks, [0.0] * 5)
        self.fit[masks] = [x * decay + y for x, y in zip(fit, (1.0, q, trunk, q * q, q * trunk))]
        for name, depths in proposals.items():
            if depths > 0 and name in proposing_s:
                per = proposing_s[name] / depths
                prev = self.proposal_s.get(name)
                self.proposal_s[name] = per if prev is None else prev + self.alpha * (per - prev)
        for name, (rows, nodes) in (tree_requests or {}).items():
            if rows > 0 and name in tree_proposing_s:
                t = tree_proposing_s[name]
                fit = self.node_fit.get(name, [0.0] * 5)
                self.node_fit[name] = [
                    x * decay + y for x, y in zip(fit, (rows * rows, rows * nodes, nodes * nodes, rows * t, nodes * t))
                ]

    def choose(self, seqs: list[Sequence], fixed: list[Sequence] = ()) -> int | None:
        """The cap for this pass (None: no row proposes, nothing to decide). Rows in `fixed` are not
        capped (their requests opted out); they are priced at their full K whatever the cap."""
        fixed = {id(s) for s in fixed}  # by identity: Sequence compares by value
        k_top = max((s.strategy.k for s in seqs if id(s) not in fixed), default=1)
        if k_top <= 1:
            return None
        if any(s.strategy.is_tree for s in seqs):
            return self._pick(self._tree_rates(seqs, fixed, k_top))
        return self._pick(self._chain_rates(seqs, fixed, k_top))

    def _chain_cum(self, seqs: list[Sequence]) -> dict[str, list[float]]:
        """Per strategy|proposer of the chain rows: E(K) for K = 1..its K."""
        cum: dict[str, list[float]] = {}
        for s in seqs:
            key = self.key(s)
            if key not in cum and not s.strategy.is_tree:
                e, run = [1.0], 1.0
                for p in self.rates(key, s.strategy.k - 1):
                    run *= p
                    e.append(e[-1] + run)
                cum[key] = e
        return cum

    def _chain_rates(self, seqs: list[Sequence], fixed: set[int], k_top: int) -> list[float]:
        """Expected tokens per second of the batch for caps K = 1..k_top, every row a chain."""
        cum, rates = self._chain_cum(seqs), []
        for k in range(1, k_top + 1):
            ks = [s.strategy.k if id(s) in fixed else min(k, s.strategy.k) for s in seqs]
            pending = self.steady_pending(seqs, k, ks)
            q = len(seqs) * max(self.block(s, kk, steady=True, pending=pending) for s, kk in zip(seqs, ks))
            tokens = sum(cum[self.key(s)][kk - 1] for s, kk in zip(seqs, ks))
            masks = any(s.proposer.n_appended(kk) > 0 for s, kk in zip(seqs, ks))
            rates.append(tokens / self.predicted_time(q, self.proposals(seqs, ks), masks))
        return rates

    def _tree_rates(self, seqs: list[Sequence], fixed: set[int], k_top: int) -> list[float]:
        """Expected tokens per second of the batch for caps K = 1..k_top when some rows are token trees.

        Contract: cap K gives every adaptive tree row a budget of n = min(K - 1, N) nodes (N: its
        `tree:N`; `fixed` rows keep N): one budget for all tree rows, since right padding makes the
        longest block set the pass's rows anyway. A tree row with budget n
        - expects 1 + the sum of its n most confident nodes' confidences (`ranked_confidences`,
          `tree.ranked`'s order; `trim_tree` keeps exactly those nodes): the nodes it has in hand, and
          beyond them (a row without a tree yet, or budgets above its tree's size) the average tree
          of its strategy and proposer (`tree_profile`);
        - feeds 1 pending token + its nodes (steady state: the tree it checks is the size of the
          one it drafts), so the pass feeds q = rows x the longest block (the in-hand nodes count
          1 each, the profile's by how often trees had them);
        - after the pass asks its proposer for n nodes, priced a per row + b per node (`node_cost`,
          timed by the decoding loop); n = 0 is a plain pass and drafts nothing.
        Chain rows in the same batch are priced as `_chain_rates` prices them, at min(K, their K).
        The pass takes t'(q) + chain proposing + tree proposing (t' as for chains); the cap with the
        most expected tokens per second wins under the same margin and exploration (`_pick`).
        Every tree cap is lossless: a smaller tree only confirms fewer of the model's own tokens."""
        cum = self._chain_cum(seqs)
        trees = {id(s): self.tree_expected(s) for s in seqs if s.strategy.is_tree}
        rates = []
        for k in range(1, k_top + 1):
            ks = [s.strategy.k if id(s) in fixed else min(k, s.strategy.k) for s in seqs]
            pending = self.steady_pending(seqs, k, ks)  # tree rows verify: they feed one pending token
            tokens, longest = 0.0, 0.0
            for s, kk in zip(seqs, ks):
                if s.strategy.is_tree:
                    expected, nodes = trees[id(s)]
                    tokens += expected[kk - 1]
                    # a mask tree also appends its groups: after the root and its likeliest nodes
                    masks_fed = s.proposer.n_appended(s.strategy.guess_k(kk), math.ceil(nodes[kk - 1]))
                    longest = max(longest, 1 + nodes[kk - 1] + masks_fed)
                else:
                    tokens += cum[self.key(s)][kk - 1]
                    longest = max(longest, self.block(s, kk, steady=True, pending=pending))
            masks = any(s.proposer.n_appended(kk) > 0 for s, kk in zip(seqs, ks))
            seconds = self.predicted_time(
                len(seqs) * longest, self.proposals(seqs, ks), masks
            ) + self.tree_proposing_time(self.tree_requests(seqs, ks))
            rates.append(tokens / seconds)
        return rates

    def _pick(self, rates: list[float]) -> int:
        """The cap K (rates[K - 1]: expected tokens per second under it) with the most tokens per
        second, if proposing (K > 1) beats K = 1 by `margin`; while K = 1 wins, every `explore_every`-th
        decision starts `EXPLORE_PASSES` passes at the best K > 1."""
        best_k, best_rate, plain, runner_up, runner_rate = 1, -1.0, None, None, -1.0
        for k, rate in enumerate(rates, start=1):
            plain = rate if plain is None else plain
            if rate >= best_rate and (k == 1 or rate >= (1 + self.margin) * plain):
                best_k, best_rate = k, rate  # ties keep the larger K, but proposing must beat K=1 clearly
            if k > 1 and rate >= runner_rate:
                runner_up, runner_rate = k, rate
        self.decisions += 1
        if best_k == 1 and runner_up is not None and self.explore_every:
            if self.decisions % self.explore_every == 0:
                self.exploring = self.EXPLORE_PASSES
            if self.exploring:  # now and then: re-time proposing passes and re-learn acceptance
                self.exploring -= 1
                return runner_up
        self.exploring = 0
        return best_k

    def tree_profile(self, key: str, n: int) -> tuple[list[float], list[float]]:
        """The average tree of strategy|proposer `key`, ranks 0..n-1 by confidence: ([how often a tree
        had an (i+1)-th node], [its mean confidence, 0 where absent]). A rank not yet seen starts from
        the rank before it (rank 0 from `prior`, always present), with weight `prior_weight`, so an
        untried budget looks as good as the last tried one and gets tried once it is cheap enough."""
        seen = self.ranks.get(key, [])
        present, conf = [], []
        prev_p, prev_c = 1.0, self.prior
        for i in range(n):
            drafted, had, total = seen[i] if i < len(seen) else (0.0, 0.0, 0.0)
            prev_p = (had + self.w * prev_p) / (drafted + self.w)
            prev_c = (total + self.w * prev_c) / (drafted + self.w)
            present.append(prev_p)
            conf.append(prev_c)
        return present, conf

    def tree_expected(self, seq: Sequence) -> tuple[list[float], list[float]]:
        """([expected tokens], [expected nodes fed]) of a tree row for budgets n = 0..N: its in-hand
        nodes' ranked confidences (each fed), then the profile of its strategy and proposer."""
        n_max = seq.strategy.k - 1
        mine = self.in_hand(seq)
        present, conf = self.tree_profile(self.key(seq), n_max)
        honesty = self.tree_honesty(self.key(seq))
        expected, nodes = [1.0], [0.0]
        for i in range(n_max):
            c, p = (mine[i], 1.0) if i < len(mine) else (conf[i], present[i])
            expected.append(expected[-1] + honesty * c)
            nodes.append(nodes[-1] + p)
        return expected, nodes

    @staticmethod
    def in_hand(seq: Sequence) -> list[float]:
        """The row's draft nodes' confidences, ranked (`ranked_confidences`; [] without drafts)."""
        d = seq.drafts
        return ranked_confidences(d.parents, d.confidences[: len(d)]) if d else []

    @staticmethod
    def trim_tree(seq: Sequence, n: int) -> None:
        """Keep only the row's n most confident draft nodes (`top_nodes`, what the policy priced), parents
        re-indexed; the decoding loop itself would keep the first n by index. Still lossless."""
        if not seq.strategy.is_tree or len(seq.drafts) <= n:
            return
        seq.drafts = seq.drafts.select(top_nodes(seq.drafts.parents, seq.drafts.confidences, n))

    def tree_honesty(self, key: str) -> float:
        """Drafts the trees of strategy|proposer `key` had accepted per unit of confidence they promised
        (1 + sum of a tree's confidences is what it expects to confirm; uncalibrated confidences, e.g. a
        merge served without `mtp tune`'s maps, over-promise). Starts at 1 with weight `prior_weight`;
        `tree_expected` scales every node's confidence by it."""
        accepted, promised = self.tree_truth.get(key, (0.0, 0.0))
        return (accepted + self.w) / (promised + self.w)

    def observe_tree_outcome(self, seq: Sequence, promised: float, accepted: int) -> None:
        """A tree row's pass checked nodes whose confidences summed to `promised` and accepted
        `accepted` of them (the tokens it emitted minus the model's own)."""
        if not seq.strategy.is_tree or promised <= 0:
            return
        truth = self.tree_truth.setdefault(self.key(seq), [0.0, 0.0])
        truth[0] += max(0, accepted)
        truth[1] += promised
        if truth[1] > self.window:  # forget slowly: halve the sums
            truth[0], truth[1] = truth[0] / 2, truth[1] / 2

    def observe_tree(self, seq: Sequence, budget: int) -> None:
        """A tree row drafted its next tree (seq.drafts) with room for
        `budget` nodes: count, per confidence rank below the budget, whether it had a node there and
        that node's confidence (`tree_profile`). `tree:auto`'s own pruning counts as not drafted."""
        if budget <= 0 or not seq.strategy.is_tree:
            return
        mine = self.in_hand(seq)
        seen = self.ranks.setdefault(self.key(seq), [])
        while len(seen) < budget:
            seen.append([0.0, 0.0, 0.0])
        for i in range(budget):
            seen[i][0] += 1
            if i < len(mine):
                seen[i][1] += 1
                seen[i][2] += mine[i]
        if seen[0][0] > self.window:  # forget slowly: halve the counts
            self.ranks[self.key(seq)] = [[x / 2 for x in r] for r in seen]

    def observe(self, seq: Sequence, attempted: int, emitted: int) -> None:
        """A pass offered `attempted` positions (1 = only the model's own token) and emitted `emitted`."""
        if attempted <= 1:
            return
        key = self.key(seq)
        reached = self.reached.setdefault(key, [])
        accepted = self.accepted.setdefault(key, [])
        while len(reached) < attempted - 1:
            reached.append(0.0)
            accepted.append(0.0)
        for i in range(1, attempted):  # position i (0 = the model's own token, always emitted)
            if emitted >= i:
                reached[i - 1] += 1
                accepted[i - 1] += emitted > i
        if reached[0] > self.window:  # forget slowly: halve the counts
            self.reached[key] = [x / 2 for x in reached]
            self.accepted[key] = [x / 2 for x in accepted]
