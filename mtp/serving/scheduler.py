"""Continuous batching for `mtp serve`: one engine thread, one `core.batching.Batch`, requests come
and go between passes.

One iteration of the engine thread:
  1. drop cancelled rows (client gone) and compact the rows;
  2. admit waiting requests while a row is free and the token budget holds (sum over rows of
     prompt + max_tokens + K <= max_cache_tokens), fairly (`_admit`): the next row goes to the waiting
     choice whose HTTP request holds the fewest rows (ties: first come, first served), and one HTTP
     request's choices (`n > 1`) hold at most `row_share` = ceil(max_batch / 2) rows at a time, the
     rest waiting their turn, so a request arriving behind an `n = 8` one gets a row within a pass or
     two instead of after a whole choice's decode. Background (shadow) work only when no live request
     waits; nobody is dropped, the rest wait. A request's further choices (`Request.follows`) wait
     until the first one had its prefill pass, then start from it (`share_prefill`: the prompt's keys
     and values copied, all but the last token's);
  3. `Batch.step`: newcomers are prefilled in a pass of their own (FIFO, up to PREFILL_TOKENS padded
     tokens), then one `decode_step` over every active row; before each pass the adaptive policy
     (`mtp.serving.adaptive.AdaptiveK`) caps K for it (a token tree keeps its K - 1 most confident
     nodes), after it each row's tokens go to its request's callback and finished rows leave.
A request with `adaptive=False` is never capped (a lossy strategy then emits exactly what `mtp
generate` does). `drain(timeout)` stops admitting; once `timeout` seconds have passed, whatever still
runs or waits is cancelled (finish_reason `cancelled`).

The KV cache is allocated (zero-filled) up front: `--max-batch` is at most MAX_BATCH (`mtp.core.runtime.checks`),
and a cache that does not fit in the memory available is refused before it is allocated
(`mtp.serving.memory`).
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

from mtp.core.decoding import batching
from mtp.core.decoding.batching import Batch
from mtp.core.decoding.decode import Sequence, block_slack
from mtp.core.decoding.strategy import K_LIMIT
from mtp.core.runtime.checks import check_batch_size
from mtp.serving import memory
from mtp.serving.adaptive import AdaptiveK

log = logging.getLogger("mtp.serve")

PREFILL_TOKENS = batching.PREFILL_TOKENS  # padded prompt tokens one prefill pass may carry (at least one prompt)


def proposing(seqs: list[Sequence]) -> tuple[dict[str, float], dict[str, float]]:
    """The seconds the rows' proposers spent drafting after the last pass (`DecodeStats.proposing_s`),
    per proposer name: in chain rows, and in tree rows (priced per row and node, not depth)."""
    chains: dict[str, float] = {}
    trees: dict[str, float] = {}
    for s in seqs:
        clock = trees if s.strategy.is_tree else chains
        clock[s.proposer.name] = clock.get(s.proposer.name, 0.0) + s.stats.proposing_s[-1]
    return chains, trees


class SchedulerClosed(RuntimeError):
    """The server is shutting down and admits no new request."""


@dataclass
class SchedulerConfig:
    max_batch: int = 8  # KV-cache rows = requests decoded together
    max_model_len: int = 1024  # per request: prompt + max_tokens
    max_cache_tokens: int = 0  # admission budget, sum of prompt + max_tokens + K; 0 = max_batch * max_model_len
    adaptive: bool = True  # cap K per pass with the cost model

    def __post_init__(self):
        check_batch_size(self.max_batch, "--max-batch")
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
    arm: str | None = None  # under a rollout (mtp.serving.rollout): "tuned" or "fallback"; None = chose its own
    proposer: str | None = None  # the proposer named at admission (None: the engine's)
    # another choice of the same HTTP request (`n > 1`): admitted once `follows` had its prefill pass, with
    # its prompt's keys and values but the last copied (`Scheduler.share_prefill`), then it decodes on its own
    follows: Request | None = None
    choice: int = 0  # its index among the request's choices
    shared_prefill: bool = False  # it started from `follows`'s prefill
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
    def owner(self) -> "Request":
        """The HTTP request's first choice, which stands for all its choices (`Scheduler.row_share`)."""
        return self.follows if self.follows is not None else self

    @property
    def budget(self) -> int:
        return len(self.seq.prompt_ids) + self.seq.params.max_new_tokens + self.seq.strategy.k

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    """Owns the model, one KV cache and the engine thread; requests come and go between passes."""

    def __init__(self, model, mask_id: int | None, config: SchedulerConfig, pass_time=None):
        self.model, self.mask_id, self.config = model, mask_id, config
        capacity = config.max_model_len + block_slack(K_LIMIT)
        memory.check_kv_cache(model, config.max_batch, capacity)
        self.batch = Batch(model, mask_id, config.max_batch, capacity)
        self.requests: dict[int, Request] = {}  # id(seq) -> its request, for the batch's rows
        self.policy = AdaptiveK(pass_time) if (config.adaptive and pass_time is not None) else None
        self.queue: collections.deque[Request] = collections.deque()
        self.background: collections.deque[Request] = collections.deque()
        self.cond = threading.Condition()
        self.draining = False
        self.deadline: float | None = None  # drain(timeout): time.monotonic() after which all is cancelled
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
        self.chunks: dict[str, collections.deque] = {}  # strategy.metric_label -> tokens per pass, recent passes
        self.k_caps: collections.Counter = collections.Counter()  # cap chosen -> passes

    # ---- HTTP side ---------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if req.budget > self.config.max_cache_tokens:
            raise ValueError(
                f"request needs {req.budget} cache tokens, over --max-cache-tokens {self.config.max_cache_tokens}"
            )
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
    def cache(self):
        return self.batch.cache

    @property
    def active(self) -> list[Request]:
        """Admitted requests in row order (active[i].seq.slot == i)."""
        return [self.requests[id(s)] for s in self.batch.active]

    @property
    def queue_length(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.active)

    def start(self) -> None:
        """Run the engine loop on a new thread (tests, embedding). `mtp serve` instead runs it on the
        process's main thread (`run`): torch calls from a second thread pay for a second OpenMP pool
        on the same cores, which slows small passes."""
        self.thread = threading.Thread(target=self.run, name="mtp-engine", daemon=True)
        self.thread.start()

    def drain(self, timeout: float | None = None) -> None:
        """Stop admitting new requests; queued and running ones still finish (within `timeout` seconds,
        then they are cancelled; a second call can only shorten it). Shadow work is dropped."""
        with self.cond:
            self.draining = True
            if timeout is not None:
                end = time.monotonic() + timeout
                self.deadline = end if self.deadline is None else min(self.deadline, end)
                self.cond.notify()
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
                    if self.deadline is not None and time.monotonic() >= self.deadline:
                        for r in list(self.active) + list(self.queue):
                            r.cancel()  # the active rows leave at the start of this iteration
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
            if any(a is r for a in self.active):
                self._leave(r, "cancelled")
            else:
                self._finish(r, "cancelled")

    @property
    def row_share(self) -> int:
        """The most rows one HTTP request's choices hold at once: ceil(max_batch / 2)."""
        return -(-self.config.max_batch // 2)

    def _admit(self) -> list[Request]:
        """Admit waiting requests while a row is free and the budget holds (called with the lock).
        Live requests first, fairly: the next one is, of the choices that may start now, the one whose
        HTTP request (`Request.owner`) holds the fewest rows, ties first come first served. A choice may
        start unless its request already holds `row_share` rows, or it shares the prefill of a first
        choice that has not had its prefill pass yet. When the one picked does not fit (no free row, or
        over the token budget) admission stops there: nothing overtakes it for good. Background
        (shadow) work only when no live request waits, FIFO."""
        for r in [r for r in self.queue if r.cancelled]:
            self.queue.remove(r)
            self._finish(r, "cancelled")
        used = sum(r.budget for r in self.active)
        newcomers = []
        while self.queue:
            held = collections.Counter(id(a.owner) for a in self.active)
            ready = [
                r
                for r in self.queue
                if held[id(r.owner)] < self.row_share and not (r.follows is not None and self._prefilling(r.follows))
            ]
            if not ready:
                break
            r = min(ready, key=lambda r: held[id(r.owner)])  # the first of the fewest: FIFO among equals
            if not self._fits(r, used):
                break
            self.queue.remove(r)
            used += self._start(r, newcomers)
        while self.background and not self.queue:
            r = self.background[0]
            if r.cancelled:
                self.background.popleft()
                self._finish(r, "cancelled")
                continue
            if not self._fits(r, used):
                break
            self.background.popleft()
            used += self._start(r, newcomers)
        return newcomers

    def _fits(self, r: Request, used: int) -> bool:
        """A row is free and `r`'s budget fits beside the `used` tokens."""
        return len(self.active) < self.config.max_batch and used + r.budget <= self.config.max_cache_tokens

    def _start(self, r: Request, newcomers: list[Request]) -> int:
        """Give `r` a row (its prefill comes with the next step); returns its budget."""
        self.batch.add(r.seq)
        self.requests[id(r.seq)] = r
        if r.follows is not None:
            self.share_prefill(r)
        r.t_admitted = time.perf_counter()
        newcomers.append(r)
        return r.budget

    def _prefilling(self, r: Request) -> bool:
        """`r` is admitted and waits for its prefill pass (called with the lock)."""
        return id(r.seq) in self.requests and r.seq.stats.forward_passes == 0

    def share_prefill(self, r: Request) -> None:
        """Start `r` (just admitted) from the prefill of `r.follows` (the same prompt), if that one is
        still decoding: its first P-1 positions' keys and values are copied into `r`'s row, so `r`'s own
        first pass feeds the last prompt token alone (and computes the prediction after it, with its own
        sampling). Otherwise (`follows` left, a one-token prompt, a proposer that keeps per-sequence state
        from every pass: EAGLE-3) `r` prefills its prompt itself."""
        parent, seq = r.follows, r.seq
        n = len(seq.prompt_ids) - 1
        if (
            id(parent.seq) not in self.requests
            or parent.seq.stats.forward_passes == 0
            or n < 1
            or parent.seq.prompt_ids != seq.prompt_ids
            or seq.proposer.aux_layers
            or parent.seq.proposer.aux_layers
        ):
            return
        cache, src, dst = self.batch.cache, parent.seq.slot, seq.slot
        cache.k[:, dst, :, :n] = cache.k[:, src, :, :n]
        cache.v[:, dst, :, :n] = cache.v[:, src, :, :n]
        cache.lengths[dst] = n
        seq.pending = [seq.prompt_ids[-1]]
        r.shared_prefill = True

    def _iteration(self, newcomers: list[Request]) -> None:
        for r in [r for r in self.active if r.cancelled]:
            self._leave(r, "cancelled")
        self.batch.prefill_tokens = PREFILL_TOKENS
        self.batch.step(self._before_pass, self._after_pass)

    def _before_pass(self, seqs: list[Sequence], prefill: bool) -> None:
        """Cap K for this pass (prefills too: masks cost there) and note what the pass offers."""
        rows = [self.requests[id(s)] for s in seqs]
        fixed = [r.seq for r in rows if not r.adaptive]
        k = self.policy.choose(seqs, fixed) if self.policy is not None else None
        if k is not None:
            self.k_caps[k] += 1
            for r in rows:
                if r.adaptive:
                    r.seq.k_override = k
                    r.capped_passes += k < r.seq.strategy.k
                    AdaptiveK.trim_tree(r.seq, r.seq.k - 1)  # the nodes the policy priced: the most confident
            if any(r.adaptive and k < r.seq.strategy.k for r in rows):
                self.capped_passes += 1
        # what each row can emit at most: the model's own token + drafts (verify) or guesses
        self._offered = [s.strategy.offered(s.k, len(s.drafts)) for s in seqs]
        # what each tree row's checked nodes promise (1 + this = expected tokens; AdaptiveK.tree_honesty)
        self._promised = [sum(s.drafts.confidences[: len(s.drafts)]) if s.strategy.is_tree else 0.0 for s in seqs]
        self._q = len(seqs) * max(AdaptiveK.block(s, s.k) for s in seqs)
        self._masks = any(s.n_appended() > 0 for s in seqs)
        self._proposals = AdaptiveK.proposals(seqs)
        self._tree_requests = AdaptiveK.tree_requests(seqs)

    def _after_pass(self, seqs: list[Sequence], emitted: list[list[int]], seconds: float, prefill: bool) -> None:
        if self.policy is not None and not prefill:  # a prompt pass (1 row, a long block) would skew
            # the times of the decoding passes the policy decides on
            chains, trees = proposing(seqs)
            self.policy.observe_time(self._q, self._proposals, seconds, chains, self._masks, self._tree_requests, trees)
        self.passes += 1
        self.prefill_passes += prefill
        self.row_passes += len(seqs)
        now = time.perf_counter()
        for s, toks, att, promised in zip(seqs, emitted, self._offered, self._promised):
            r = self.requests[id(s)]
            if self.policy is not None:  # the tree it drafted for the next pass, with room for K - 1 nodes
                self.policy.observe_tree(s, s.k - 1)
            s.k_override = None
            chunk = s.stats.chunks[-1]
            self.chunks.setdefault(s.strategy.metric_label, collections.deque(maxlen=20000)).append(chunk)
            if self.policy is not None and s.stats.forward_passes > 1:
                self.policy.observe(s, att, chunk)
                self.policy.observe_tree_outcome(s, promised, chunk - 1)
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
        """Remove an active row (the batch moves its last row into the freed one)."""
        self.batch.remove(r.seq)
        del self.requests[id(r.seq)]
        self._finish(r, reason, tokens)

    def _finish(self, r: Request, reason: str, tokens: list[int] = ()) -> None:
        r.seq.finish_reason = reason
        r.t_finish = time.perf_counter()
        self._emit(r, list(tokens), True)
        r.done.set()
