"""The links between pipeline stages: the process group, the message header, bounded sends and receives.

A message is a header (`HEADER` int64s: op, B, T, N, flags, cache epoch, cache rows, cache capacity, delay,
attention-layout width, KV moves) followed by payload tensors sent back to back; `Link` adds the dialled-in delay
before each message and turns a failed or timed-out transfer into a `PipelineError` naming the stage at fault.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# message header: [op, B, T, N, flags, cache_epoch, cache_rows, cache_capacity, delay_us, layout_S, n_moves]
HEADER = 11
OP_SHUTDOWN, OP_FORWARD, OP_RESULT = 0, 1, 2
F_CACHE, F_SLOTS, F_OUT, F_GATE, F_HIDDEN, F_LAYOUT, F_MOVES = 1, 2, 4, 8, 16, 32, 64
IDLE_WAIT = timedelta(days=7)  # a stage waiting for the next pass relies on the watchdog instead


@dataclass
class PipelineConfig:
    link_delay_ms: float = 0.0  # added before every inter-stage message (P messages per pass)
    timeout_s: float = 60.0  # bound on every wait inside a pass, and on a silent heartbeat
    backend: str = "auto"  # gloo on CPU, nccl when the model is on CUDA
    heartbeat_s: float = 0.25


class PipelineError(RuntimeError):
    """A stage died, hung or failed; the message names it. `first`: this stage posted it (so it is
    the one to print it, besides stage 0)."""

    def __init__(self, msg: str, first: bool = True):
        super().__init__(msg)
        self.first = first


def store_address() -> tuple[str, int]:
    """The rendezvous store's host and port (torchrun's MASTER_ADDR / MASTER_PORT)."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))


def store_prefix() -> str:
    """The store's key namespace for this run (torchrun: one per run and restart)."""
    env = os.environ  # torchrun: one namespace per run and restart
    return f"mtp_pipeline/{env.get('TORCHELASTIC_RUN_ID', 'local')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def init_group(rank: int, world: int, config: PipelineConfig, backend: str) -> None:
    """Join the process group through the TCP store at MASTER_ADDR:MASTER_PORT. Stage 0 hosts the
    store unless torchrun's agent or the `mtp pipeline` launcher already does."""
    addr, port = store_address()
    external = (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or os.environ.get("MTP_PIPELINE_STORE") == "external"
    )
    timeout = timedelta(seconds=config.timeout_s)
    store = dist.TCPStore(addr, port, world, rank == 0 and not external, timeout=timeout, wait_for_workers=False)
    dist.init_process_group(
        backend, store=dist.PrefixStore(store_prefix() + "/pg", store), rank=rank, world_size=world, timeout=timeout
    )


class Link:
    """Point-to-point messages between stages: bounded waits, and the dialled-in delay before each
    message (a message = its header and payload tensors, sent back to back)."""

    def __init__(self, rank: int, world: int, config: PipelineConfig, watchdog, device):
        self.rank, self.world, self.config, self.watchdog = rank, world, config, watchdog
        self.device = device  # where transported tensors live (CPU for gloo)
        self.delay_s = config.link_delay_ms / 1000.0
        self.broken = False

    def send(self, dst: int, tensors: list[torch.Tensor]) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        tensors = [t.to(self.device).contiguous() for t in tensors]  # kept alive until sent
        timeout = timedelta(seconds=self.config.timeout_s)
        with self._failures(dst, f"sending to stage {dst}"):
            works = [dist.isend(t, dst) for t in tensors]
            for w in works:
                w.wait(timeout)

    def recv(self, src: int, shape, dtype, idle: bool = False) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        with self._failures(src, f"waiting for stage {src}"):
            dist.irecv(t, src).wait(IDLE_WAIT if idle else timedelta(seconds=self.config.timeout_s))
        return t

    @contextlib.contextmanager
    def _failures(self, peer: int, what: str):
        """A failed or timed-out transfer becomes a PipelineError naming the stage at fault."""
        try:
            yield
        except RuntimeError as e:
            self.broken = True
            raise self.watchdog.diagnose(peer, e, what) from None


def message_header(op: int, *values: int) -> torch.Tensor:
    """A message's fixed-size header: the op code, then up to HEADER - 1 integers."""
    h = torch.zeros(HEADER, dtype=torch.long)
    h[0] = op
    h[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.long)
    return h
