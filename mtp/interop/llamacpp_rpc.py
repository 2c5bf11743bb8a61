"""llama.cpp's RPC backend as a cluster on one machine: N `ggml-rpc-server` workers on loopback, each behind a
relay that delays every chunk by D ms per direction, and `llama-server --rpc` across them with any drafter on
the head (the llama-server process itself).

Contract:
- `parse_delay(x)` -> milliseconds, a finite float >= 0; anything else is a ValueError of one line.
- `DelayRelay(target_port, delay_ms)` listens on 127.0.0.1 (a port it binds itself: no race), connects each
  accepted connection to 127.0.0.1:target_port, and writes every chunk it reads, in either direction, D ms
  after it read it, in order. The delay is a latency, not a bandwidth cap: chunks in flight overlap, as on a
  long link. `delay_ms` may change while it runs; a chunk keeps the delay in force when it was read. Timers
  are never early and late by the OS timer's slack (0.1-0.5 ms per direction measured here). `unanswered_since`
  is when the server was sent data it has not answered since (None when it answered last); `round_trips`
  counts the answers that followed data sent (the round trips the link paid).
- `Cluster(nodes, delay_ms, threads=1, port=None)` starts N workers (`-t threads`) on free loopback ports,
  or on `port, port + 1, ...` where given (one in use: ClusterError, one line), and a relay in front of each.
  `endpoints` is the `--rpc` value (the relays), `server_args()` the llama-server flags that put every target
  layer on the workers, split evenly, and keep a draft model on the head. `check()` raises ClusterError
  naming the first worker that exited, is stopped (SIGSTOP), or, while a request is in flight (`busy`), left
  data unanswered for `hang_s`. `close()` (also the `with` block, `atexit`, and on Linux the death of the
  starting process: PR_SET_PDEATHSIG, SIGKILL) stops every worker: SIGTERM, SIGKILL after `STOP_S`; `pids()` lists them.
- `cluster_t_of_q(cluster, target)`: llama.cpp's t(q) across the cluster at its delay (`llama-bench --rpc`), for
  `llamacpp_profile.advise`: the draft count `mtp bench --profile` would choose on that cluster.
- `ClusterServer(cluster, model, ...)` is a `LlamaServer` on the cluster whose start and requests call
  `cluster.check()` every `POLL_S`: a dead or hung worker ends the request within `hang_s` + ~1 s, named,
  and the llama-server is killed with it.
Everything binds 127.0.0.1 and connects to 127.0.0.1: nothing leaves loopback. `tc netem` is not used: it needs
CAP_NET_ADMIN in a network namespace (an unprivileged user namespace grants that) and the kernel's `sch_netem`,
which the machine this was built on lacks ("Specified qdisc kind is unknown"); the relay needs neither.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mtp.interop import llamacpp_env
from mtp.interop.llamacpp_server import LlamaServer

HOST = "127.0.0.1"
CHUNK = 1 << 16  # bytes read per chunk
QUEUE_CHUNKS = 1024  # chunks a direction may hold in flight (<= 64 MiB): back-pressure beyond
READY_S = 30.0  # a worker must listen within this
STOP_S = 3.0  # SIGTERM, then SIGKILL after this
HANG_S = 12.0  # data unanswered this long during a request: the worker hangs
POLL_S = 0.25
PORT_TRIES = 4  # free ports tried per worker (another process may take one between our probe and its bind)
BIND_FAILED = "Failed to create server socket"  # what ggml-rpc-server prints when its port is taken


class ClusterError(RuntimeError):
    """A worker of the cluster failed (one line, naming it)."""


def parse_delay(x) -> float:
    """A link delay in milliseconds: a finite number >= 0 (str or number), else ValueError (one line)."""
    try:
        ms = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"delay {x!r} is not a number of milliseconds") from None
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(f"delay {x!r} must be a finite number of milliseconds >= 0")
    return ms


def parse_delays(text: str) -> list[float]:
    """'0,1,5,20' -> [0.0, 1.0, 5.0, 20.0] (each as parse_delay; at least one)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"no delay in {text!r}")
    return [parse_delay(t) for t in items]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG; a worker holds
    nothing to flush, and a stopped or SIGTERM-ignoring one must go too)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class DelayRelay:
    """A TCP relay 127.0.0.1:port -> 127.0.0.1:target_port that delays each chunk by `delay_ms` per direction."""

    def __init__(self, target_port: int, delay_ms: float = 0.0):
        self.delay_ms = parse_delay(delay_ms)
        self.target_port = int(target_port)
        self.unanswered_since: float | None = None  # time.monotonic() of the first unanswered upstream chunk
        self.port = 0
        self.round_trips = 0  # answers that followed data sent: round trips the link paid
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._ready, self._error = threading.Event(), None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"relay-{target_port}")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ClusterError(f"relay for port {target_port} could not listen on {HOST}: {self._error}")

    @property
    def delay_ms(self) -> float:
        return self._delay_s * 1e3

    @delay_ms.setter
    def delay_ms(self, ms) -> None:
        self._delay_s = parse_delay(ms) / 1e3

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, HOST, 0))
            self.port = self._server.sockets[0].getsockname()[1]
        except OSError as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()

    def _keep(self, task: asyncio.Task) -> None:
        """Hold a strong reference until the task ends (the loop holds tasks only weakly)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._keep(asyncio.current_task())
        try:
            server_r, server_w = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(self._pipe(client_r, server_w, up=True), self._pipe(server_r, client_w, up=False))
        except asyncio.CancelledError:  # close(): the loop is stopping
            pass
        finally:
            for w in (client_w, server_w):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool) -> None:
        """Read chunks as they come; write each `delay` after its arrival, in order (None: end of stream)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_CHUNKS)

        async def send() -> None:
            while True:
                due, chunk = await queue.get()
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                if chunk is None:
                    break
                writer.write(chunk)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        sender = asyncio.create_task(send())
        self._keep(sender)
        try:
            while (chunk := await reader.read(CHUNK)) and not sender.done():  # done: the far side failed
                if up and self.unanswered_since is None:
                    self.unanswered_since = time.monotonic()
                elif not up and self.unanswered_since is not None:
                    self.unanswered_since = None
                    self.round_trips += 1
                await queue.put((loop.time() + self._delay_s, chunk))
        except OSError:
            pass
        await queue.put((loop.time() + self._delay_s, None))
        try:
            await sender
        except OSError:
            pass

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a TCP socket listening on `port` (Linux /proc; elsewhere: a connect)."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")}
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        with socket.socket() as s:
            return s.connect_ex((HOST, port)) == 0
    for line in lines:
        f = line.split()  # sl local_address rem_address st ... inode
        if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port and f[9] in inodes:
            return True
    return False


def _state(pid: int) -> str:
    """The process state letter of `pid` from /proc (R, S, T stopped, Z zombie, ...; '' when unknown)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class Worker:
    """One ggml-rpc-server process (node `index` of `of`) on 127.0.0.1:port, its log in a temporary file."""

    def __init__(self, binary: Path, index: int, of: int, port: int, threads: int):
        self.index, self.of, self.port = index, of, port
        self.log = tempfile.NamedTemporaryFile(prefix=f"rpc-server-{index}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [str(binary), "-H", HOST, "-p", str(port), "-t", str(threads)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "GGML_RPC_NO_RDMA": "1"},  # TCP only: every byte passes the relay
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    @property
    def name(self) -> str:
        return f"ggml-rpc-server {self.index} of {self.of} ({HOST}:{self.port}, pid {self.proc.pid})"

    def log_tail(self) -> str:
        try:
            lines = [ln for ln in Path(self.log.name).read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return lines[-1].strip() if lines else "(no output)"

    def bind_failed(self) -> bool:
        try:
            return BIND_FAILED in Path(self.log.name).read_text(errors="replace")
        except OSError:
            return False

    def wait_listening(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return
            if _listens(self.proc.pid, self.port):
                return
            time.sleep(0.05)
        raise ClusterError(f"{self.name} did not listen within {READY_S:g} s: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            if _state(self.proc.pid) in ("T", "t"):  # stopped: SIGTERM would wait for a SIGCONT
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class Cluster:
    """N ggml-rpc-server workers on loopback, each behind a DelayRelay (see the module docstring)."""

    def __init__(
        self, nodes: int, delay_ms: float = 0.0, threads: int = 1, port: int | None = None, hang_s: float = HANG_S
    ):
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be a whole number >= 1, got {nodes!r}")
        delay = parse_delay(delay_ms)
        binary = llamacpp_env.binary(llamacpp_env.RPC_SERVER)
        if binary is None:
            raise ValueError(llamacpp_env.missing(llamacpp_env.RPC_SERVER))
        if port is not None:
            taken = [p for p in range(port, port + nodes) if not _port_free(p)]
            if taken:
                raise ClusterError(f"port {HOST}:{taken[0]} is in use (the cluster needs {port}..{port + nodes - 1})")
        self.hang_s, self.busy_since = hang_s, None
        self.workers: list[Worker] = []
        self.relays: list[DelayRelay] = []
        atexit.register(self.close)
        try:
            for i in range(nodes):
                self.workers.append(self._start(binary, i + 1, nodes, threads, None if port is None else port + i))
            self.relays = [DelayRelay(w.port, delay) for w in self.workers]
        except BaseException:
            self.close()
            raise

    def _start(self, binary: Path, index: int, of: int, threads: int, port: int | None) -> Worker:
        for _ in range(1 if port is not None else PORT_TRIES):
            w = Worker(binary, index, of, port if port is not None else _free_port(), threads)
            try:
                w.wait_listening()
            except BaseException:  # not listening in time, or Ctrl-C: not yet in self.workers
                w.stop()
                raise
            if w.proc.poll() is None:
                return w
            if not w.bind_failed():
                tail = w.log_tail()
                w.stop()
                raise ClusterError(f"{w.name} exited ({w.proc.returncode}) at start: {tail}")
            w.stop()
        raise ClusterError(f"port {HOST}:{w.port} is in use ({w.name} could not bind it)")

    @property
    def nodes(self) -> int:
        return len(self.workers)

    @property
    def endpoints(self) -> str:
        return ",".join(f"{HOST}:{r.port}" for r in self.relays)

    def set_delay(self, delay_ms) -> None:
        ms = parse_delay(delay_ms)
        for r in self.relays:
            r.delay_ms = ms

    @property
    def delay_ms(self) -> float:
        return self.relays[0].delay_ms if self.relays else 0.0

    def server_args(self) -> list[str]:
        """llama-server flags: every target layer on the workers (split evenly), a draft model on the head."""
        return [
            "--rpc",
            self.endpoints,
            "-ngl",
            "all",
            "-ts",
            ",".join(["1"] * self.nodes),
            "-fit",
            "off",
            "-devd",
            "none",
        ]

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def check(self) -> None:
        """Raise ClusterError naming the first worker that exited, is stopped, or hangs during a request."""
        now = time.monotonic()
        for w, r in zip(self.workers, self.relays or [None] * len(self.workers)):
            code = w.proc.poll()
            if code is not None:
                raise ClusterError(f"{w.name} exited ({code}): {w.log_tail()}")
            if _state(w.proc.pid) in ("T", "t"):
                raise ClusterError(f"{w.name} is stopped (SIGSTOP): it cannot answer")
            if r is not None and self.busy_since is not None and r.unanswered_since is not None:
                waited = now - max(r.unanswered_since, self.busy_since)
                if waited > self.hang_s:
                    raise ClusterError(f"{w.name} left a request unanswered for {waited:.0f} s: it hangs")

    def close(self) -> None:
        atexit.unregister(self.close)
        for w in self.workers:
            w.stop()
        for r in self.relays:
            r.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def cluster_t_of_q(cluster: Cluster, target, qs=(1, 2, 3, 4, 5, 6, 8), depth: int = 128, repeats: int = 3) -> dict:
    """t(q) in seconds of a q-token target pass across `cluster` at its current delay: `llama-bench --rpc`
    (as `llamacpp_profile.measure` on one machine), watched by `cluster.check()`. The cluster serves one
    client at a time: no llama-server may be connected to it meanwhile."""
    binary = llamacpp_env.binary("llama-bench")
    if binary is None:
        raise ValueError(llamacpp_env.missing("llama-bench"))
    cmd = [str(binary), "-m", str(target), "-p", ",".join(map(str, qs)), "-n", "0", "-d", str(depth)]
    cmd += ["-t", "1", "-r", str(repeats), "-o", "json", "-rpc", cluster.endpoints, "-ngl", "99"]
    cmd += ["-ts", "/".join(["1"] * cluster.nodes), *llamacpp_env.run_flags()]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        cluster.busy_since = time.monotonic()
        try:
            while proc.poll() is None:
                cluster.check()
                time.sleep(POLL_S)
        finally:
            cluster.busy_since = None
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"llama-bench across the cluster failed ({proc.returncode}): {tail}")
    return {int(r["n_prompt"]): r["avg_ns"] / 1e9 for r in json.loads(stdout) if r.get("n_gen") == 0}


class ClusterServer(LlamaServer):
    """`LlamaServer` across `cluster` (its `server_args()` added); start and requests watched by `cluster.check()`."""

    def __init__(self, cluster: Cluster, model, *args, extra: tuple[str, ...] = (), **kwargs):
        self.cluster = cluster
        super().__init__(model, *args, extra=(*cluster.server_args(), *extra), **kwargs)

    def _watched(self, fn, *args):
        """fn(*args) in a thread while the cluster is checked every POLL_S; a failed check kills llama-server."""
        box: dict = {}

        def run():
            try:
                box["out"] = fn(*args)
            except BaseException as e:  # handed to the caller's thread
                box["err"] = e

        thread = threading.Thread(target=run, daemon=True)
        self.cluster.busy_since = time.monotonic()
        thread.start()
        try:
            while thread.is_alive():
                thread.join(POLL_S)
                self.cluster.check()
            if "err" in box:  # a worker that died makes llama-server fail first: name the worker
                for _ in range(int(1 / POLL_S) + 1):
                    self.cluster.check()
                    time.sleep(POLL_S)
                raise box["err"]
            return box["out"]
        except ClusterError:
            if self.proc.poll() is None:
                self.proc.kill()
            raise
        finally:
            self.cluster.busy_since = None

    def _wait_ready(self) -> None:
        self._watched(super()._wait_ready)

    def close(self) -> None:
        """SIGTERM, SIGKILL after STOP_S (a request across the cluster may outlast llama-server's own shutdown)."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        super().close()

    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        return self._watched(super().complete, prompt_ids, max_new_tokens)
