"""Launching P pipeline stages as local processes (`mtp pipeline --stages P`): each runs `fn(rank,
world, *args)` with torch.distributed set up on loopback; under torchrun each process is one stage
already (`python -m mtp.pipeline`, whose options `mtp.cli.pipeline` defines)."""

from __future__ import annotations

import os
import socket
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from mtp.pipeline.transport import PipelineError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        MTP_PIPELINE_STORE="external",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    try:
        code = fn(rank, world, *args)
    except PipelineError as e:
        if e.first or rank == 0:
            print(f"mtp: error: pipeline: {e}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def launch_local(stages: int, fn, args: tuple = (), grace_s: float = 3.0) -> int:
    """Run `fn(rank, stages, *args)` in `stages` fresh processes on this machine; this process hosts
    the rendezvous store (so it outlives any stage). Returns stage 0's exit status, or the first
    failure's. Once a stage exits non-zero the others have `grace_s` to follow (their watchdogs see
    the posted failure within a heartbeat); then the stragglers (e.g. a stopped process) are killed."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_local_entry, args=(r, stages, store.port, fn, args)) for r in range(stages)]
    for p in procs:
        p.start()
    deadline, killed = None, set()
    try:
        while any(p.exitcode is None for p in procs):
            codes = [p.exitcode for p in procs]
            if deadline is None and any(c not in (None, 0) for c in codes):
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for r, p in enumerate(procs):
                    if p.exitcode is None:
                        p.kill()
                        killed.add(r)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        return 130
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if codes[0] is not None and codes[0] < 0:
        if 0 not in killed:  # stage 0 killed by a signal from outside: nobody printed why
            print(f"mtp: error: pipeline: stage 0 was killed by signal {-codes[0]}", file=sys.stderr)
        return 1
    if codes[0]:
        return codes[0]
    return next((c for c in codes if c and c > 0), 1 if any(codes) else 0)
