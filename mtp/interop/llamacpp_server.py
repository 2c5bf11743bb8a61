"""One `llama-server` (the `make llamacpp` build) started for mtp: the llama.cpp peers of `mtp bench` and the
llama.cpp tests use it.

Contract: `LlamaServer(model, ...)` starts `llama-server` on a free local port with one slot, waits until
`/health` answers, and `complete(prompt_ids, n)` sends the prompt as token ids (already chat-formatted by
the caller; no BOS is added to an id prompt), greedy (`temperature` 0, `top_k` 1), without reusing the
previous request's KV cache, and returns the generated ids (up to the end-of-generation token, which is
not included) with llama-server's own `timings` (tokens/s, `draft_n`, `draft_n_accepted`). `close()` (or
leaving the `with` block) stops the process, and so do the interpreter's exit (`atexit`) and, on Linux, the
death of the process that started it (`PR_SET_PDEATHSIG`): no server outlives its `mtp bench`. A server
that dies or never gets ready is a RuntimeError with the last line of its log.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from mtp.interop import llamacpp_env

READY_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def spec_args(kind: str | None, drafter=None, draft_max: int = 3, threads: int = 1) -> list[str]:
    """llama-server's flags for a speculative configuration: None (plain), "ngram" (ngram-simple, 3-token
    lookup and draft: prompt lookup as in our `--proposer lookup`), "eagle3" (the GGUF `drafter`)."""
    if kind is None:
        return []
    if kind == "ngram":
        return [
            "--spec-type",
            "ngram-simple",
            "--spec-ngram-simple-size-n",
            "3",
            "--spec-ngram-simple-size-m",
            str(draft_max),
        ]
    if kind == "eagle3":
        return [
            "-md",
            str(drafter),
            "--spec-type",
            "draft-eagle3",
            "--spec-draft-n-max",
            str(draft_max),
            "-td",
            str(threads),
            "-tbd",
            str(threads),
        ]
    raise ValueError(f"unknown llama.cpp speculative type {kind!r}")


class LlamaServer:
    def __init__(
        self,
        model,
        spec: str | None = None,
        drafter=None,
        threads: int = 1,
        ctx: int = 2048,
        draft_max: int = 3,
        extra: tuple[str, ...] = (),
    ):
        binary = llamacpp_env.binary("llama-server")
        if binary is None:
            raise ValueError(llamacpp_env.missing())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            str(binary),
            "-m",
            str(model),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(ctx),
            "-np",
            "1",
            "--no-webui",
            *spec_args(spec, drafter, draft_max, threads),
            *llamacpp_env.run_flags(),
            *extra,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            self.args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        atexit.register(self.close)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def log_tail(self) -> str:
        try:
            lines = [ln for ln in Path(self._log.name).read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return lines[-1] if lines else "(no output)"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({self.proc.returncode}) before it was ready: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not ready after {READY_TIMEOUT_S} s: {self.log_tail()}")

    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        """{"ids": generated ids, "timings": llama-server's timings, "stop": why it stopped}."""
        body = {
            "prompt": [int(t) for t in prompt_ids],
            "n_predict": int(max_new_tokens),
            "temperature": 0.0,
            "top_k": 1,
            "top_p": 1.0,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        req = urllib.request.Request(
            self.url + "/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                out = json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            dead = self.proc.poll() is not None
            raise RuntimeError(
                f"llama-server {'died' if dead else 'failed'} on a request ({e}): {self.log_tail()}"
            ) from None
        return {
            "ids": [int(t) for t in out.get("tokens") or []],
            "timings": out.get("timings") or {},
            "stop": out.get("stop_type"),
        }

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
