"""Preallocated KV cache; commit and rollback are moving a per-row length pointer.

Buffers are `[layers, rows, kv_heads, capacity, head_dim]`, written at explicit positions. A row's `lengths[row]` is
how many positions hold committed (accepted) tokens. Every forward pass writes its block contiguously from that
length, and a query in slot p attends to slots 0..p only (a branched `verify` block's extra mask groups see
less: mtp.core.decoding.decode._branch_layout), so whatever lies beyond a row's length (rejected drafts, mask
tokens, padding) is never read before it is overwritten. Rejecting proposals is therefore just *not advancing
the length*: nothing is copied or freed.
"""

from __future__ import annotations

import torch

from mtp.core.runtime import kernels


class KVCache:
    def __init__(
        self, n_layers: int, rows: int, n_kv_heads: int, capacity: int, head_dim: int, dtype=torch.float32, device="cpu"
    ):
        shape = (n_layers, rows, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * rows  # committed positions per row
        self.capacity = capacity

    @classmethod
    def for_model(cls, model, rows: int, capacity: int) -> "KVCache":
        if hasattr(model, "new_cache"):  # a pipeline stage caches only its own layers (mtp.pipeline.stages)
            return model.new_cache(rows, capacity)
        cfg = model.config
        w = model.embed_tokens.weight
        return cls(cfg.n_layers, rows, cfg.n_kv_heads, capacity, cfg.head_dim, w.dtype, w.device)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def commit(self, row: int, n: int) -> None:
        """Accept the next `n` positions written for `row` (they become part of its prefix)."""
        if self.lengths[row] + n > self.capacity:
            raise ValueError(f"KV cache row {row} over capacity {self.capacity}")
        self.lengths[row] += n

    def rollback(self, row: int, length: int) -> None:
        """Forget everything of `row` from position `length` on."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot roll row {row} back to {length} (length {self.lengths[row]})")
        self.lengths[row] = length

    def reset(self, row: int) -> None:
        self.lengths[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Copy row `src`'s committed prefix into row `dst` (the server keeps active rows contiguous,
        so a batch pass reads a view of the cache instead of gathering rows)."""
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0

    def compact(self, row: int, start: int, src: list[int]) -> None:
        """Move the keys and values at slots start+src[t] to start+t (a token tree's accepted path,
        mtp.core.decoding.tree), before committing them. Sources are read before any is overwritten."""
        if not src or src == list(range(len(src))):
            return
        dst = torch.arange(start, start + len(src), device=self.k.device)
        idx = torch.tensor(src, device=self.k.device) + start
        self.k[:, row, :, dst] = self.k[:, row, :, idx]
        self.v[:, row, :, dst] = self.v[:, row, :, idx]

    def prefix_length(self, positions: torch.Tensor) -> int:
        """S = max(positions) + 1: the cache slots a pass writing `positions` [B, T] reads; refused
        beyond the capacity."""
        S = int(positions.max()) + 1
        if S > self.capacity:
            raise ValueError(f"position {S - 1} is beyond the KV cache capacity {self.capacity}")
        return S

    def writer(self, layer: int, positions: torch.Tensor, slots: torch.Tensor | None):
        """A function (k, v) -> (keys, values) for one layer's attention.

        positions: [B, T]; k, v: [B, kv_heads, T, head_dim]. Writes the block at `positions` of the
        batch's cache rows and returns that rows' cache prefix [B, kv_heads, S, head_dim] with
        S = max(positions) + 1.
        """
        S = self.prefix_length(positions)
        kc, vc = self.k[layer], self.v[layer]
        fast_writes = kernels.loaded()  # the kernel library's kv_write (same bytes, fewer calls)

        def write(k, v):
            B = k.shape[0]
            rows = slots if slots is not None else torch.arange(B, device=k.device)
            if fast_writes and k.dtype == kc.dtype == torch.float32 and k.is_cpu and not torch.is_grad_enabled():
                torch.ops.mtp.kv_write(kc, vc, rows, positions, k, v)  # one call instead of two scatters
            else:
                # advanced indices [B,1] and [B,T] around a slice -> target view [B, T, heads, hd]
                kc[rows.view(B, 1), :, positions] = k.transpose(1, 2)
                vc[rows.view(B, 1), :, positions] = v.transpose(1, 2)
            if slots is None:
                return kc[:B, :, :S], vc[:B, :, :S]
            return kc[slots, :, :S], vc[slots, :, :S]

        return write
