"""Failure detection across pipeline stages: heartbeats in the rendezvous store and one shared
place for the first failure anyone saw, so every stage exits with the same line naming the culprit."""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from mtp.pipeline.transport import PipelineConfig, PipelineError, store_address, store_prefix


class Watchdog:
    """Heartbeats in the rendezvous store, and one shared place for the first failure anyone saw.

    Every `heartbeat_s` each stage bumps its counter `hb/RANK`, checks whether a failure was posted
    (then it exits: stage 0 printing the line, the others silently) and whether a peer's counter has
    stood still for `timeout_s` (then it posts "stage R stopped responding" and exits)."""

    def __init__(self, rank: int, world: int, config: PipelineConfig):
        self.rank, self.world, self.config = rank, world, config
        addr, port = self.address = store_address()
        client = dist.TCPStore(addr, port, None, False, timeout=timedelta(seconds=max(config.timeout_s, 5)))
        self.store = dist.PrefixStore(store_prefix() + "/watch", client)
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        now = time.monotonic()
        self.seen = {r: (-1, now) for r in range(world) if r != rank}  # rank -> (counter, when it last moved)
        self.thread = threading.Thread(target=self._run, name=f"mtp-pipeline-watchdog-{rank}", daemon=True)

    def start(self) -> "Watchdog":
        self.thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop watching (before this stage leaves): peers stop expecting heartbeats from it."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.thread.join(timeout=5)
        if done:
            try:
                with self.lock:
                    self.store.set(f"done/{self.rank}", "1")
            except Exception:
                pass

    def posted(self) -> str | None:
        with self.lock:
            if self.store.check(["abort"]):
                return self.store.get("abort").decode()
        return None

    def post(self, msg: str) -> tuple[str, bool]:
        """Record a failure unless one was recorded first; return the one that stands and whether
        it is ours."""
        try:
            with self.lock:
                if int(self.store.add("abort_n", 1)) == 1:
                    self.store.set("abort", msg)
                    return msg, True
                deadline = time.monotonic() + 2.0
                while not self.store.check(["abort"]) and time.monotonic() < deadline:
                    time.sleep(0.02)
                return self.store.get("abort").decode(), False
        except Exception:
            return msg, True

    def silent(self) -> list[tuple[int, float]]:
        """Every live peer (not yet done) with the seconds since its heartbeat last moved."""
        now, out = time.monotonic(), []
        with self.lock:
            for r, (count, _since) in self.seen.items():
                if self.store.check([f"done/{r}"]):
                    continue
                c = int(self.store.add(f"hb/{r}", 0))
                if c != count:
                    self.seen[r] = (c, now)
                out.append((r, now - self.seen[r][1]))
        return out

    def diagnose(self, peer: int, err: Exception, what: str) -> PipelineError:
        """Turn a failed send/recv with `peer` into the error to report (someone else's if posted first)."""
        deadline = time.monotonic() + 4 * self.config.heartbeat_s + 0.5
        try:
            while time.monotonic() < deadline:  # a better-placed stage may be posting the cause right now
                msg = self.posted()
                if msg:
                    return PipelineError(msg, first=False)
                time.sleep(self.config.heartbeat_s / 2)
            text = str(err)
            if any(s in text for s in ("closed by peer", "Connection reset", "Broken pipe", "closed")):
                msg = f"stage {peer} closed its link to stage {self.rank} (it crashed or was killed)"
            elif "imed out" in text or "imeout" in text:
                silent = [(r, t) for r, t in self.silent() if t > 4 * self.config.heartbeat_s + 1.0]
                if silent:
                    r, s = max(silent, key=lambda x: x[1])
                    msg = f"stage {r} stopped responding (no heartbeat for {s:.1f} s: hung, stopped or killed)"
                else:
                    msg = (
                        f"stage {self.rank} got nothing from stage {peer} within {self.config.timeout_s:g} s "
                        f"while {what} (a stage is stuck; raise --timeout-s if passes are this slow)"
                    )
            else:
                msg = f"link stage {self.rank} <-> stage {peer} failed while {what}: {text.splitlines()[0][:200]}"
        except Exception:  # the store itself is gone: its host died
            msg = self._store_lost()
        return PipelineError(*self.post(msg))

    def _store_lost(self) -> str:
        addr, port = self.address
        return (
            f"the rendezvous store at {addr}:{port} is unreachable (its host died: stage 0, torchrun's "
            f"agent or the `mtp pipeline` launcher)"
        )

    def _exit(self, msg: str, speak: bool) -> None:
        if speak:
            print(f"mtp: error: pipeline: {msg}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def _run(self) -> None:
        timeout = self.config.timeout_s
        while not self.stopped.wait(self.config.heartbeat_s):
            try:
                with self.lock:
                    self.store.add(f"hb/{self.rank}", 1)
                msg = self.posted()
                if msg:
                    self._exit(msg, speak=self.rank == 0)
                for r, t in self.silent():
                    if t > timeout:
                        msg, first = self.post(
                            f"stage {r} stopped responding (no heartbeat for {t:.1f} s: hung, stopped or killed)"
                        )
                        self._exit(msg, speak=first or self.rank == 0)
            except Exception:
                if self.stopped.is_set():
                    return
                self._exit(self._store_lost(), speak=True)
