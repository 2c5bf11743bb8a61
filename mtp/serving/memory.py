"""Whether `mtp serve`'s KV cache fits: it is zero-filled up front (`mtp.core.runtime.cache.KVCache`), so a
cache larger than the memory available would fail (or be OOM-killed) while allocating. `check_kv_cache`
refuses such a cache with a one-line ValueError before it is allocated; MAX_KV_FRACTION of the memory
available (after the model loaded) may go to it."""

from __future__ import annotations

import os

import torch

MAX_KV_FRACTION = 0.9


def kv_cache_bytes(model, rows: int, capacity: int) -> int | None:
    """Bytes of K and V for `rows` x `capacity` positions; None for a model with a cache of its own."""
    if hasattr(model, "new_cache"):  # a pipeline stage (mtp.pipeline.stages) sizes its own layers
        return None
    cfg, w = model.config, model.embed_tokens.weight
    return 2 * cfg.n_layers * rows * cfg.n_kv_heads * capacity * cfg.head_dim * w.element_size()


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device` (Linux MemAvailable on CPU); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return ""


def check_kv_cache(model, rows: int, capacity: int) -> None:
    """Raise ValueError (one line) if a `rows` x `capacity` KV cache cannot fit in memory."""
    need = kv_cache_bytes(model, rows, capacity)
    if need is None:
        return
    free = available_bytes(model.embed_tokens.weight.device)
    if free is not None and need > MAX_KV_FRACTION * free:
        raise ValueError(
            f"--max-batch {rows} x {capacity} positions needs a KV cache of {_size(need)}, more than "
            f"{MAX_KV_FRACTION:.0%} of the {_size(free)} of memory available; lower --max-batch or "
            f"--max-model-len"
        )
