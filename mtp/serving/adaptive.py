"""The server's adaptive K: per pass, the cap on K that maximises expected tokens per second of the
whole batch, priced with the measured pass times (`mtp.core.costmodel` at start-up, then what the
passes themselves took). K = 1 means no proposals this pass; capping K keeps lossless strategies
(`ntp`, `verify`) exact, and a capped `static` / `conf_adapt` pass emits what `conf_adapt:TAU:K` would.
"""
from __future__ import annotations

from typing import Callable

from mtp.core.decode import Sequence


class AdaptiveK:
    """Per-pass cap on K: expected tokens per second of the whole batch, from the cost model.

    For a cap K every row r yields E_r(K) = 1 + sum_{i<K} prod_{j<=i} p_j tokens (p_j: running rate
    at which position j is emitted once position j-1 was, per strategy and proposer). The pass
    feeds q = rows x max_r block_r(K) tokens (right padding; blocks in steady state under K, where a
    conf_adapt/static row feeds back what it emitted) and makes P = sum_r (K_r - 1) proposals,
    so it takes T(K) = t'(q) + c * P. t'(q): the running observed time of decoding passes of q
    tokens, with or without mask tokens (those also run the adapter), once seen; between observed
    sizes, interpolated from the neighbours (t(q) is far from linear on a CPU); beyond them, a line a + b*q fitted to recent passes (once two block sizes were
    seen); else scale * t(q) from the start-up cost model, `scale` the running ratio of observed to
    modelled time (the machine's load now). Pass times exclude proposing; `c` is the running
    measured time of one proposal depth per proposer (the heads proposer runs its heads and the LM
    head per row and depth; the mask proposer almost nothing). The cap maximising sum_r E_r(K) / T(K)
    wins if it beats K = 1 by `margin`, with an exploring pass now and then while K = 1 wins. Unseen
    positions start from the previous position's rate (position 1 from `prior`), and `c` starts at
    0, so a cheap enough K gets tried and then learnt.
    """

    EXPLORE_PASSES = 3  # an exploring verify row needs a pass to draft before passes that check drafts

    def __init__(self, pass_time: Callable[[float], float], prior: float = 0.5, prior_weight: float = 2.0,
                 window: float = 2000.0, smoothing: float = 0.1, margin: float = 0.05, explore_every: int = 128):
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
            return len(seq.pending) + drafts + seq.proposer.n_appended(k, drafts)
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
        """Proposal depths a pass makes per proposer (each row with K > 1 proposes K - 1; row r's K is
        ks[r], default its K this pass)."""
        out: dict[str, int] = {}
        for s, kk in zip(seqs, ks or [s.k for s in seqs]):
            if kk > 1:
                out[s.proposer.name] = out.get(s.proposer.name, 0) + kk - 1
        return out

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

    def observe_time(self, q: int, proposals: dict[str, float], seconds: float,
                     proposing_s: dict[str, float] | None = None, masks: bool = False) -> None:
        """One pass of q tokens (with mask tokens or not) took `seconds`, of which proposing_s[name]
        went into `proposals[name]` proposal depths (timed by `TimedProposer`): calibrate `scale`,
        the observed times and the per-depth costs."""
        proposing_s = proposing_s or {}
        trunk = max(seconds - sum(proposing_s.values()), 1e-9)
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

    def choose(self, seqs: list[Sequence], fixed: list[Sequence] = ()) -> int | None:
        """The cap for this pass (None: no row proposes, nothing to decide). Rows in `fixed` are not
        capped (their requests opted out); they are priced at their full K whatever the cap."""
        fixed = {id(s) for s in fixed}  # by identity: Sequence compares by value
        k_top = max((s.strategy.k for s in seqs if id(s) not in fixed), default=1)
        if k_top <= 1:
            return None
        cum: dict[str, list[float]] = {}  # per strategy: E(K) for K = 1..k_top
        for s in seqs:
            key = self.key(s)
            if key not in cum:
                e, run = [1.0], 1.0
                for p in self.rates(key, s.strategy.k - 1):
                    run *= p
                    e.append(e[-1] + run)
                cum[key] = e
        best_k, best_rate, plain, runner_up, runner_rate = 1, -1.0, None, None, -1.0
        for k in range(1, k_top + 1):
            ks = [s.strategy.k if id(s) in fixed else min(k, s.strategy.k) for s in seqs]
            pending = self.steady_pending(seqs, k, ks)
            q = len(seqs) * max(self.block(s, kk, steady=True, pending=pending) for s, kk in zip(seqs, ks))
            tokens = sum(cum[self.key(s)][kk - 1] for s, kk in zip(seqs, ks))
            masks = any(s.proposer.n_appended(kk) > 0 for s, kk in zip(seqs, ks))
            rate = tokens / self.predicted_time(q, self.proposals(seqs, ks), masks)
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
