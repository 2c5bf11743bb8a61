"""Launching P pipeline stages as local processes (`mtp pipeline --stages P`): each runs `fn(rank,
world, *args)` with torch.distributed set up on loopback; under torchrun each process is one stage
already (`python -m mtp.pipeline`, whose options `mtp.cli.pipeline` defines).

The stages never outlive the launcher: on Linux each gets SIGKILL when the launching thread ends, however
it ends (SIGKILL included: prctl PR_SET_PDEATHSIG, as the llama.cpp RPC workers), and one whose launcher
died before that was set exits at once; the resource tracker torch.multiprocessing started exits once its
last user is gone. Ctrl-C is the launcher's to handle (it stops every stage): the stages ignore SIGINT,
so none prints a traceback of its own. Their C++ log lines (torch.distributed retrying a vanished rendezvous
store, with stack frames) are off (`TORCH_CPP_LOG_LEVEL`, unless set): their failures arrive as one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from mtp.pipeline.transport import PipelineError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """Make this process die with `parent`, the process that started it: on Linux SIGKILL when the thread
    that started it ends (prctl PR_SET_PDEATHSIG); and if `parent` is gone already (this process was
    reparented before the prctl took effect), exit now."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


@contextlib.contextmanager
def _stage_environment():
    """While stages start: SIGINT ignored (kept across exec, and by Python in the child) and the C++ log
    off (read when the child imports torch), unless TORCH_CPP_LOG_LEVEL is set; restored after."""
    old_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    main = threading.current_thread() is threading.main_thread()  # only it may change signal handlers
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if old_int is not None:  # None: not set from Python, nor changed here
            signal.signal(signal.SIGINT, old_int)
        if old_level is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def _local_entry(rank: int, world: int, port: int, fn, args, parent: int) -> None:
    die_with_parent(parent)
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
    failure's; 130 on Ctrl-C. Once a stage exits non-zero the others have `grace_s` to follow (their
    watchdogs see the posted failure within a heartbeat); then the stragglers (e.g. a stopped process)
    are killed. No stage outlives this call (any exception kills them), nor this process (see above);
    call it from a thread that lives until it returns."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    me = os.getpid()
    procs = [ctx.Process(target=_local_entry, args=(r, stages, store.port, fn, args, me)) for r in range(stages)]
    try:
        with _stage_environment():
            for p in procs:
                p.start()
        killed = _wait(procs, grace_s)
    except KeyboardInterrupt:
        return 130
    finally:  # Ctrl-C, SystemExit (a SIGTERM handler), any error: no stage is left running
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join()
    return _status([p.exitcode for p in procs], killed)


def _wait(procs: list, grace_s: float) -> set[int]:
    """Until every stage has exited; once one exits non-zero the others have `grace_s` to follow, then
    the stragglers are killed. Returns the ranks killed."""
    deadline, killed = None, set()
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
    return killed


def _status(codes: list[int | None], killed: set[int]) -> int:
    """The pipeline's exit status from its stages' (`killed`: the ranks `_wait` killed): stage 0's, or the
    first failure's; 1 for a stage 0 killed by a signal (said on stderr when the signal came from outside)."""
    if codes[0] is not None and codes[0] < 0:
        if 0 not in killed:  # stage 0 killed by a signal from outside: nobody printed why
            print(f"mtp: error: pipeline: stage 0 was killed by signal {-codes[0]}", file=sys.stderr)
        return 1
    if codes[0]:
        return codes[0]
    return next((c for c in codes if c and c > 0), 1 if any(codes) else 0)
