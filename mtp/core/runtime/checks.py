"""Checks of what users give every command, made before a model loads, each a one-line ValueError:
the device, batch sizes, thread counts, text that must be valid Unicode. The command line (`mtp.cli`)
and the server use them; the flags themselves are defined in `mtp.cli.options`."""

from __future__ import annotations

import os

import torch


def check_device(device: str) -> str:
    """`cpu`, `cuda` or `cuda:N` that exists on this machine, else a one-line error."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: only cpu and cuda are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


MAX_BATCH = 256  # most KV-cache rows one batch may ask for (the cache is zero-filled up front)


def check_batch_size(n: int, flag: str) -> int:
    """`n` if it is 1 .. MAX_BATCH: rows decoded together (`mtp serve --max-batch`, `mtp data
    --batch-size`, the trainers' `--gen-batch-size`), refused before a cache is allocated."""
    if not 1 <= n <= MAX_BATCH:
        raise ValueError(f"{flag} must be in 1..{MAX_BATCH}, got {n}")
    return n


THREADS_PER_CPU = 4  # --threads is at most this many per CPU (torch crashes on huge counts)


def check_threads(threads: int) -> int:
    """`threads` if it is 0 (torch's default) or 1 .. THREADS_PER_CPU x this machine's CPUs."""
    cpus = os.cpu_count() or 1
    if threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = torch's default), got {threads}")
    if threads > THREADS_PER_CPU * cpus:
        raise ValueError(
            f"--threads is at most {THREADS_PER_CPU * cpus} ({THREADS_PER_CPU} per CPU, "
            f"{cpus} CPUs here), got {threads}"
        )
    return threads


def valid_text(text: str, what: str = "prompt") -> str:
    """`text` if it is valid Unicode (no lone surrogates: undecodable bytes in argv become those)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"the {what} is not valid UTF-8 text") from None
    return text
