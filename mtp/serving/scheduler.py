"""Continuous batching for `mtp serve`: one engine thread, one KV cache, `decode.decode_step` per pass.

Layout (ragged rows, right-padded): the cache has `max_batch` rows; every admitted request (a
`decode.Sequence`) owns one row with its own length, and its own block per pass (pending + drafts +
masks); `decode_step` right-pads the blocks to the longest. Active rows are kept contiguous in rows
0..n-1 (a leaving row is replaced by the last one, `KVCache.move_row`), so a batch pass reads a view
of the cache instead of gathering rows.

One iteration of the engine thread:
  1. drop cancelled rows (client gone) and compact the rows;
  2. admit from the FIFO queue while a row is free and the token budget holds (sum over rows of
     prompt + max_tokens + K <= max_cache_tokens); background (shadow) work only when no live
     request waits; nobody is dropped, the rest wait;
  3. prefill newcomers in a pass of their own (`prefill_group`: FIFO, up to PREFILL_TOKENS padded
     tokens): a prompt in the decoding pass would pad every row of the batch to its length; that
     pass also yields their first token(s) (K capped by the policy as in step 4);
  4. let the adaptive policy cap K for this pass (`AdaptiveK`), then one `decode_step` over every
     active row;
  5. hand each row's tokens to its request's callback; finished rows leave.

Adaptivity (seed 002's integration fell to 0.26x of plain decoding at 16 concurrent requests): before
each pass `AdaptiveK` picks the cap K that maximises expected tokens / predicted pass time, with
t(q) from `mtp.core.costmodel` (q = rows x padded block) and expected tokens from running per-strategy
acceptance. K = 1 means no proposals this pass. Capping K keeps lossless strategies (`ntp`,
`verify`) exact; for `static` / `conf_adapt` a capped pass emits what `conf_adapt:TAU:K` would.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from mtp.core.cache import KVCache
from mtp.core.decode import Sequence, block_slack, decode_step
from mtp.core.metrics import DecodeStats
from mtp.core.proposers import Proposer

log = logging.getLogger("mtp.serve")

K_LIMIT = 32  # largest K a request may ask for (sizes the cache rows' slack)


PREFILL_TOKENS = 1024  # padded prompt tokens one prefill pass may carry (at least one prompt)


def prefill_group(waiting: list["Request"]) -> list["Request"]:
    """The newcomers to prefill in one pass, FIFO: as many as fit PREFILL_TOKENS once right-padded to
    the longest of them. One wave of 16 GSM8K prompts then joins in ~2 passes instead of 16, so the
    batch runs full sooner (and its rows finish together instead of staggered by one pass each)."""
    group, longest = [], 0
    for r in waiting:
        n = len(r.seq.pending)
        if group and (len(group) + 1) * max(longest, n) > PREFILL_TOKENS:
            break
        group.append(r)
        longest = max(longest, n)
    return group


class SchedulerClosed(RuntimeError):
    """The server is shutting down and admits no new request."""


@dataclass
class SchedulerConfig:
    max_batch: int = 8  # KV-cache rows = requests decoded together
    max_model_len: int = 1024  # per request: prompt + max_tokens
    max_cache_tokens: int = 0  # admission budget, sum of prompt + max_tokens + K; 0 = max_batch * max_model_len
    adaptive: bool = True  # cap K per pass with the cost model

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_cache_tokens < 0:
            raise ValueError(f"--max-cache-tokens must be >= 0, got {self.max_cache_tokens}")
        if not self.max_cache_tokens:
            self.max_cache_tokens = self.max_batch * self.max_model_len


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One request in the scheduler. `on_event(req, tokens, final)` runs on the engine thread after
    every pass of the request with the tokens it emitted; `final` is True exactly once, at the end
    (then `seq.finish_reason` is stop | length | cancelled | error)."""
    seq: Sequence
    on_event: Callable[["Request", list[int], bool], None] = lambda r, t, f: None
    background: bool = False  # shadow work: admitted only when no live request waits
    adaptive: bool = True  # False: the policy never caps this row's K (exact `generate` output for lossy strategies)
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    error: str | None = None
    t_arrival: float = field(default_factory=time.perf_counter)
    t_admitted: float | None = None
    t_first: float | None = None
    t_finish: float | None = None
    capped_passes: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def budget(self) -> int:
        return len(self.seq.prompt_ids) + self.seq.params.max_new_tokens + self.seq.strategy.k

    def cancel(self) -> None:
        self.cancelled = True


class AdaptiveK:
    """Per-pass cap on K: expected tokens per second of the whole batch, from the cost model.

    For a cap K every row r yields E_r(K) = 1 + sum_{i<K} prod_{j<=i} p_j tokens (p_j: running rate
    at which position j is emitted once position j-1 was, per strategy and proposer). The pass
    feeds q = rows x max_r block_r(K) tokens (right padding; blocks in steady state under K, where a
    conf_adapt/static row feeds back what it emitted) and makes P = sum_r (K_r - 1) proposals,
    so it takes T(K) = t'(q) + c * P. t'(q): the running observed time of decoding passes of q
    tokens, with or without mask tokens (those also run the adapter), once seen; between observed
    sizes, interpolated from the neighbours (t(q) on 2 cores bends: ~1.6 ms a token at 16 rows x 1,
    ~0.7 at 16 x 4); beyond them, a line a + b*q fitted to recent passes (once two block sizes were
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

        steady: the row as it is in steady state under cap k, which is what the cap is chosen on.
        A `verify` row then checks k-1 drafts behind its one pending token: priced on this pass's
        drafts instead, a pass without drafts (the previous one was capped) looked cheap and won, the
        next one, with drafts, looked dear and was capped, dropping the drafts; alternating so, verify
        fell to 1 token a pass. Any other row feeds back, as pending, the tokens it emitted last pass
        (guesses have no KV yet): `pending` (expected, see `steady_pending`), else k."""
        k = min(k, seq.strategy.k)
        if not steady:
            drafts = min(len(seq.drafts), k - 1)
            return len(seq.pending) + drafts + seq.proposer.n_appended(k, drafts)
        if seq.strategy.kind == "verify":
            return 1 + (k - 1) + seq.proposer.n_appended(k, k - 1)
        return (k if pending is None else pending) + seq.proposer.n_appended(k, 0)

    def steady_pending(self, seqs: list[Sequence], k: int, ks: list[int] | None = None) -> float:
        """Expected padded pending length next pass under cap k (row r at K = ks[r], default min(k, its
        K)): the most tokens any non-verify row emits, E[max_r n_r] = sum_n P(some row emits >= n),
        each row's P(n_r >= n) from its rates."""
        ks = ks or [min(k, s.strategy.k) for s in seqs]
        top = max(ks, default=1)
        none_reach = [1.0] * (top + 1)  # n -> P(no row emits >= n)
        for s, kk in zip(seqs, ks):
            if s.strategy.kind == "verify":
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


def measured_cost(model, max_batch: int, cache_len: int = 256, repeats: int = 3):
    """A cost model t(q) over total tokens per pass (q = rows x block): batch-1 blocks plus
    full-batch blocks, so both ends of the batch range are measured, not extrapolated.

    On a shared machine other processes inflate some timings, so each point is the fastest of its
    repeats (the pass's own cost), and t is made non-decreasing in q (a bigger block never costs less).
    """
    from mtp.core.costmodel import CostModel, measure
    cache_len = max(0, min(cache_len, model.config.max_seq_len - 64))

    def fastest(cm) -> dict[int, float]:
        spread = cm.meta.get("spread", {})
        return {q: float(spread[str(q)][0]) if str(q) in spread else t for q, t in cm.points.items()}

    points = fastest(measure(model, qs=[1, 4, 16, 64], cache_len=cache_len, batch=1, repeats=repeats))
    if max_batch > 1:
        full = fastest(measure(model, qs=[1, 2, 4], cache_len=cache_len, batch=max_batch, repeats=repeats))
        for q, t in full.items():
            n = q * max_batch
            points[n] = min(points[n], t) if n in points else t
    qs = sorted(points)
    for a, b in zip(qs, qs[1:]):
        points[b] = max(points[b], points[a])
    return CostModel(points, {"cache_len": cache_len, "max_batch": max_batch, "repeats": repeats})


class TimedProposer(Proposer):
    """A row's proposer with its `propose` calls timed into a shared clock (proposer name -> seconds),
    so the adaptive policy knows what proposing costs apart from the forward pass."""

    def __init__(self, inner: Proposer, clock: dict[str, float]):
        self.inner, self.clock = inner, clock
        self.name, self.needs_hidden, self.has_confidence = inner.name, inner.needs_hidden, inner.has_confidence

    def n_appended(self, k: int, drafts: int = 0) -> int:
        return self.inner.n_appended(k, drafts)

    def propose(self, view, k, params, gen):
        t0 = time.perf_counter()
        try:
            return self.inner.propose(view, k, params, gen)
        finally:
            self.clock[self.name] = self.clock.get(self.name, 0.0) + time.perf_counter() - t0


class Scheduler:
    """Owns the model, one KV cache and the engine thread; requests come and go between passes."""

    def __init__(self, model, mask_id: int | None, config: SchedulerConfig, pass_time=None):
        self.model, self.mask_id, self.config = model, mask_id, config
        self.cache = KVCache.for_model(model, config.max_batch, config.max_model_len + block_slack(K_LIMIT))
        self.policy = AdaptiveK(pass_time) if (config.adaptive and pass_time is not None) else None
        self.queue: collections.deque[Request] = collections.deque()
        self.background: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []  # active[i].seq.slot == i
        self.cond = threading.Condition()
        self.draining = False
        self.stopped = False
        self.thread: threading.Thread | None = None  # set by start(); run() may use the caller's thread
        self.running_loop: threading.Thread | None = None
        self.loop_done = threading.Event()
        self.hosted = False  # the owner calls run() itself (mtp serve: the main thread); start() is not used
        # counters for /metrics (read without a lock: ints and deques)
        self.passes = 0  # forward passes, prefills included
        self.prefill_passes = 0
        self.row_passes = 0
        self.capped_passes = 0
        self.chunks: dict[str, collections.deque] = {}  # strategy -> tokens per pass, recent passes
        self.k_caps: collections.Counter = collections.Counter()  # cap chosen -> passes
        self.proposing_s: dict[str, float] = {}  # this pass's time in proposers (TimedProposer)

    # ---- HTTP side ---------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if req.budget > self.config.max_cache_tokens:
            raise ValueError(f"request needs {req.budget} cache tokens, over --max-cache-tokens "
                             f"{self.config.max_cache_tokens}")
        with self.cond:
            if self.draining or self.stopped:
                raise SchedulerClosed("server is shutting down")
            (self.background if req.background else self.queue).append(req)
            self.cond.notify()

    def cancel(self, req: Request) -> None:
        req.cancel()
        with self.cond:
            self.cond.notify()

    @property
    def queue_length(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.active)

    def start(self) -> None:
        """Run the engine loop on a new thread (tests, embedding). `mtp serve` instead runs it on the
        process's main thread (`run`): oneDNN and OpenMP calls from a second thread that does torch
        work pay ~0.1 ms each on 2 cores (two OpenMP pools oversubscribe the cores), which made a
        1-row pass ~35% slower than in `mtp generate`."""
        self.thread = threading.Thread(target=self.run, name="mtp-engine", daemon=True)
        self.thread.start()

    def drain(self) -> None:
        """Stop admitting new requests; queued and running ones still finish. Shadow work is dropped."""
        with self.cond:
            self.draining = True
            dropped = list(self.background)
            self.background.clear()
        for r in dropped:
            self._finish(r, "cancelled")

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel whatever is left and end the engine thread."""
        self.drain()
        with self.cond:
            self.stopped = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)
        elif self.running_loop is not threading.current_thread():
            self.loop_done.wait(timeout)

    # ---- engine thread -------------------------------------------------------------------------
    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        """The engine loop, on the calling thread, until `stop()` (or `alive()` turns False while idle)."""
        self.running_loop = threading.current_thread()
        try:
            self._loop(alive)
        finally:
            self.loop_done.set()

    def _loop(self, alive: Callable[[], bool]) -> None:
        with torch.inference_mode():
            while True:
                with self.cond:
                    while not self.stopped and not (self.queue or self.active or self.background):
                        self.cond.wait(0.5)
                        if not alive():
                            self.stopped = True
                    if self.stopped:
                        break
                    newcomers = self._admit()
                try:
                    self._iteration(newcomers)
                except Exception:  # a failing pass fails its rows, never the server
                    log.error("engine pass failed:\n%s", traceback.format_exc())
                    msg = traceback.format_exc().strip().splitlines()[-1]
                    for r in list(self.active):
                        r.error = msg
                        self._leave(r, "error")
        leftover = list(self.active) + list(self.queue) + list(self.background)
        self.queue.clear()
        self.background.clear()
        for r in leftover:
            if r in self.active:
                self._leave(r, "cancelled")
            else:
                self._finish(r, "cancelled")

    def _admit(self) -> list[Request]:
        """Pop requests FIFO while a row is free and the budget holds (called with the lock)."""
        used = sum(r.budget for r in self.active)
        newcomers = []
        for q in (self.queue, self.background):
            if q is self.background and self.queue:
                break  # live requests first
            while q:
                r = q[0]
                if r.cancelled:
                    q.popleft()
                    self._finish(r, "cancelled")
                    continue
                if len(self.active) >= self.config.max_batch or used + r.budget > self.config.max_cache_tokens:
                    break
                q.popleft()
                used += r.budget
                r.seq.slot = len(self.active)
                if not isinstance(r.seq.proposer, TimedProposer):
                    r.seq.proposer = TimedProposer(r.seq.proposer, self.proposing_s)
                self.cache.reset(r.seq.slot)
                r.seq.stats = DecodeStats()
                r.t_admitted = time.perf_counter()
                self.active.append(r)
                newcomers.append(r)
        return newcomers

    def _iteration(self, newcomers: list[Request]) -> None:
        for r in [r for r in self.active if r.cancelled]:
            self._leave(r, "cancelled")
        # 3. prefill newcomers together, apart from the decoding rows, up to PREFILL_TOKENS padded tokens
        waiting_prefill = [r for r in self.active if r.seq.stats.forward_passes == 0]
        if waiting_prefill:
            self._pass(prefill_group(waiting_prefill), prefill=True)
        # 4. one pass for every active row past its prefill
        rows = [r for r in self.active if r.seq.stats.forward_passes > 0]
        if rows:
            self._pass(rows, prefill=False)

    def _pass(self, rows: list[Request], prefill: bool) -> None:
        seqs = [r.seq for r in rows]  # ordered by slot: active rows are contiguous
        fixed = [r.seq for r in rows if not r.adaptive]
        k = self.policy.choose(seqs, fixed) if self.policy is not None else None  # prefills too: masks cost there
        if k is not None:
            self.k_caps[k] += 1
            for r in rows:
                if r.adaptive:
                    r.seq.k_override = k
                    r.capped_passes += k < r.seq.strategy.k
            if any(r.adaptive and k < r.seq.strategy.k for r in rows):
                self.capped_passes += 1
        # what each row can emit at most: the model's own token + drafts (verify) or guesses
        attempted = [len(s.drafts[: s.k - 1]) + 1 if s.strategy.kind == "verify" else s.k for s in seqs]
        q = len(seqs) * max(AdaptiveK.block(s, s.k) for s in seqs)
        masks = any(s.n_appended() > 0 for s in seqs)
        proposals = AdaptiveK.proposals(seqs)
        self.proposing_s.clear()
        t0 = time.perf_counter()
        emitted = decode_step(self.model, self.cache, seqs, self.mask_id)
        if self.policy is not None and not prefill:  # a prompt pass (1 row, a long block) would skew
            # the times of the decoding passes the policy decides on
            self.policy.observe_time(q, proposals, time.perf_counter() - t0, self.proposing_s, masks)
        self.passes += 1
        self.prefill_passes += prefill
        self.row_passes += len(rows)
        now = time.perf_counter()
        for r, toks, att in zip(rows, emitted, attempted):
            s = r.seq
            s.k_override = None
            chunk = s.stats.chunks[-1]
            self.chunks.setdefault(str(s.strategy), collections.deque(maxlen=20000)).append(chunk)
            if self.policy is not None and s.stats.forward_passes > 1:
                self.policy.observe(s, att, chunk)
            if toks and r.t_first is None:
                r.t_first = now
            if s.finished:
                self._leave(r, s.finish_reason, toks)
            else:
                self._emit(r, toks, False)

    def _emit(self, r: Request, tokens: list[int], final: bool) -> None:
        try:
            r.on_event(r, tokens, final)
        except Exception:
            log.error("request callback failed:\n%s", traceback.format_exc())

    def _leave(self, r: Request, reason: str, tokens: list[int] = ()) -> None:
        """Remove an active row and move the last row into its slot (rows stay contiguous)."""
        i = self.active.index(r)
        last = self.active.pop()
        if last is not r:
            self.cache.move_row(last.seq.slot, i)
            last.seq.slot = i
            self.active[i] = last
        self._finish(r, reason, tokens)

    def _finish(self, r: Request, reason: str, tokens: list[int] = ()) -> None:
        r.seq.finish_reason = reason
        r.t_finish = time.perf_counter()
        self._emit(r, list(tokens), True)
        r.done.set()
