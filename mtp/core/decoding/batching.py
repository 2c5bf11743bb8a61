"""Continuous batching over one KV cache: the rows `mtp serve` and `mtp data` decode together.

A `Batch` owns a KV cache of `rows` rows. Sequences join (`add`) while a row is free and leave
(`remove`) when finished; active rows stay contiguous in rows 0..n-1 (a leaving row is replaced by
the last one, `KVCache.move_row`), so a pass reads a view of the cache instead of gathering rows.
Every pass is one `decode.decode_step`; `step` makes the passes of one iteration:
  1. newcomers (no pass yet) are prefilled in a pass of their own, FIFO, up to `prefill_tokens`
     padded tokens (`prefill_group`): a prompt inside the decoding pass would pad every row to
     its length;
  2. one decoding pass over every row past its prefill.
`before_pass(seqs, prefill)` / `after_pass(seqs, emitted, seconds, prefill)` let an owner cap K
per pass, observe timings and hand tokens on (the server's adaptive policy and callbacks) without
another copy of this loop.
"""

from __future__ import annotations

import time
from typing import Callable

from mtp.core.decoding import decode
from mtp.core.decoding.decode import Sequence
from mtp.core.decoding.metrics import DecodeStats
from mtp.core.runtime.cache import KVCache

PREFILL_TOKENS = 1024  # padded prompt tokens one prefill pass may carry (at least one prompt)


def prefill_group(waiting: list[Sequence], limit: int = PREFILL_TOKENS) -> list[Sequence]:
    """The newcomers to prefill in one pass, FIFO: as many as fit `limit` once right-padded to the
    longest of them (always at least one)."""
    group, longest = [], 0
    for s in waiting:
        n = len(s.pending)
        if group and (len(group) + 1) * max(longest, n) > limit:
            break
        group.append(s)
        longest = max(longest, n)
    return group


class Batch:
    """Rows of one KV cache decoded together; see the module docstring."""

    def __init__(self, model, mask_id: int | None, rows: int, capacity: int, prefill_tokens: int | None = None):
        self.model, self.mask_id = model, mask_id
        self.cache = KVCache.for_model(model, rows, capacity)
        self.active: list[Sequence] = []  # active[i].slot == i
        self.prefill_tokens = prefill_tokens

    @property
    def free(self) -> int:
        return self.cache.rows - len(self.active)

    def add(self, seq: Sequence) -> None:
        """Give `seq` the next free row; its first pass (prefill) comes with the next `step`."""
        if not self.free:
            raise ValueError("no free row in the batch")
        seq.slot = len(self.active)
        self.cache.reset(seq.slot)
        seq.stats = DecodeStats()
        self.active.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Free `seq`'s row and move the last row into it (rows stay contiguous)."""
        i = next(j for j, s in enumerate(self.active) if s is seq)  # by identity: Sequence compares by value
        last = self.active.pop()
        if last is not seq:
            self.cache.move_row(last.slot, i)
            last.slot = i
            self.active[i] = last

    def step(self, before_pass: Callable | None = None, after_pass: Callable | None = None) -> list[tuple]:
        """One iteration (a prefill pass for newcomers, then a decoding pass for the others).
        Returns [(sequence, tokens emitted)] of every pass, in pass order. Finished rows stay until
        the owner removes them (`after_pass` may do so: the decoding pass skips finished rows and
        is built after the prefill pass's callback returned)."""
        out = []
        waiting = [s for s in self.active if s.stats.forward_passes == 0]
        if waiting:
            limit = PREFILL_TOKENS if self.prefill_tokens is None else self.prefill_tokens
            out += self._pass(prefill_group(waiting, limit), True, before_pass, after_pass)
        rows = [s for s in self.active if s.stats.forward_passes > 0 and not s.finished]
        if rows:
            out += self._pass(rows, False, before_pass, after_pass)
        return out

    def _pass(self, seqs: list[Sequence], prefill: bool, before_pass, after_pass) -> list[tuple]:
        if before_pass is not None:
            before_pass(seqs, prefill)
        t0 = time.perf_counter()
        emitted = decode.decode_step(self.model, self.cache, seqs, self.mask_id)
        if after_pass is not None:
            after_pass(seqs, emitted, time.perf_counter() - t0, prefill)
        return list(zip(seqs, emitted))
