"""`mtp serve`: an OpenAI-compatible HTTP server over continuous batching (mtp.serving.scheduler).

Endpoints: POST /v1/completions and /v1/chat/completions (OpenAI schema, `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models, /health, /metrics (Prometheus text).
A request may carry `"mtp": {"strategy": "conf_adapt:0.9", "adaptive": false}`; omitted fields take the
server's flags (`adaptive: false` exempts the request from the per-pass K cap, see `mtp.serving.scheduler`).
Every bad input is HTTP 400 with an OpenAI-style `{"error": {...}}`; `--api-key` guards every path
but /health; SIGTERM stops admitting, lets running requests finish (up to --shutdown-timeout) and
exits 0.

Threads: uvicorn's event loop parses and answers; one engine thread (Scheduler) owns the model and
the KV cache. Tokens cross over per pass through `loop.call_soon_threadsafe` into an asyncio queue
per request. Text is detokenised on the HTTP side; a streamed delta never ends inside a possible
stop string or an incomplete UTF-8 character.
"""

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, ValidationError

from mtp.core import metrics as M
from mtp.core.engine import Engine
from mtp.core.sampling import SamplingParams
from mtp.serving.scheduler import K_LIMIT, Request, Scheduler, SchedulerClosed, SchedulerConfig
from mtp.serving.shadow import ShadowLog, compare
from mtp.core.strategy import Strategy

log = logging.getLogger("mtp.serve")


@dataclass
class ServeConfig:
    model_name: str = "smollm2-135m"  # the id clients pass as `model`
    strategy: str = "ntp"  # default when a request has no `mtp.strategy`
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128  # default when a request has no `max_tokens`
    stop: list[str] = field(default_factory=list)  # default when a request has no `stop`
    seed: int | None = None  # default when a request has no `seed`
    api_key: str | None = None
    shadow_rate: float = 0.0
    shadow_log: str = "mtp-shadow.jsonl"
    shadow_seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self):
        Strategy.parse(self.strategy)
        if not 0 <= self.shadow_rate <= 1:
            raise ValueError(f"--shadow-rate must be in [0, 1], got {self.shadow_rate}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_tokens}")


# ---- request schema (OpenAI fields we honour; unknown fields are ignored, known ones type-checked)
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class MTPOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    strategy: str | None = None
    # false: this request's K is never capped by the adaptive policy, so a lossy strategy
    # (conf_adapt, static) emits exactly what `mtp generate` does, at whatever it costs the batch
    adaptive: bool = True


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: dict | None = None
    logprobs: bool | int | None = None
    mtp: MTPOptions | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- Prometheus text ---------------------------------------------------------------------------
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4)


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.n}')
        lab = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{lab} {self.sum:.6f}", f"{name}_count{lab} {self.n}"]


class ServerMetrics:
    """Counters the HTTP side and the engine thread update; rendered as Prometheus text."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.queue_wait = Histogram(LATENCY_BUCKETS)
        self.shadow = {"requests": 0, "exact_match": 0, "answer_compared": 0, "answer_agree": 0}
        self.shadow_ratio = Histogram(RATIO_BUCKETS)

    def count(self, endpoint: str, status: str) -> None:
        with self.lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def finished(self, req: Request) -> None:
        with self.lock:
            self.prompt_tokens += len(req.seq.prompt_ids)
            self.completion_tokens += len(req.seq.output)
            if req.t_finish is not None:
                self.latency.observe(req.t_finish - req.t_arrival)
            if req.t_first is not None:
                self.ttft.observe(req.t_first - req.t_arrival)
            if req.t_admitted is not None:
                self.queue_wait.observe(req.t_admitted - req.t_arrival)

    def shadow_done(self, rec: dict) -> None:
        with self.lock:
            self.shadow["requests"] += 1
            self.shadow["exact_match"] += bool(rec["exact_match"])
            if rec["answer_agree"] is not None:
                self.shadow["answer_compared"] += 1
                self.shadow["answer_agree"] += bool(rec["answer_agree"])
            if rec.get("latency_ratio"):
                self.shadow_ratio.observe(rec["latency_ratio"])

    def render(self, sched: Scheduler) -> str:
        out = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        with self.lock:
            metric("mtp_requests_total", "counter", "HTTP requests by endpoint and outcome",
                   [f'mtp_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())])
            metric("mtp_prompt_tokens_total", "counter", "prompt tokens of finished requests",
                   [f"mtp_prompt_tokens_total {self.prompt_tokens}"])
            metric("mtp_generation_tokens_total", "counter", "tokens generated for finished requests",
                   [f"mtp_generation_tokens_total {self.completion_tokens}"])
            metric("mtp_request_latency_seconds", "histogram", "arrival to last token",
                   self.latency.lines("mtp_request_latency_seconds"))
            metric("mtp_time_to_first_token_seconds", "histogram", "arrival to first token",
                   self.ttft.lines("mtp_time_to_first_token_seconds"))
            metric("mtp_queue_wait_seconds", "histogram", "arrival to admission into the batch",
                   self.queue_wait.lines("mtp_queue_wait_seconds"))
            for k, v in self.shadow.items():
                metric(f"mtp_shadow_{k}_total", "counter", f"shadow comparisons: {k}", [f"mtp_shadow_{k}_total {v}"])
            metric("mtp_shadow_latency_ratio", "histogram", "MTP decode time / ntp shadow decode time",
                   self.shadow_ratio.lines("mtp_shadow_latency_ratio"))
        metric("mtp_queue_length", "gauge", "requests waiting for a batch row", [f"mtp_queue_length {sched.queue_length}"])
        metric("mtp_running_requests", "gauge", "requests in the batch", [f"mtp_running_requests {sched.running}"])
        metric("mtp_forward_passes_total", "counter", "forward passes (prefills included)",
               [f"mtp_forward_passes_total {sched.passes}"])
        metric("mtp_prefill_passes_total", "counter", "prompt prefill passes", [f"mtp_prefill_passes_total {sched.prefill_passes}"])
        metric("mtp_row_passes_total", "counter", "forward passes summed over batch rows",
               [f"mtp_row_passes_total {sched.row_passes}"])
        metric("mtp_capped_passes_total", "counter", "passes where the cost model capped K",
               [f"mtp_capped_passes_total {sched.capped_passes}"])
        metric("mtp_k_cap_passes_total", "counter", "passes by the K cap the adaptive policy chose",
               [f'mtp_k_cap_passes_total{{k="{k}"}} {n}' for k, n in sorted(dict(sched.k_caps).items())])
        tpf, acc = [], []
        for strat, dq in sorted(sched.chunks.items()):
            chunks = list(dq)
            tpf.append(f'mtp_tokens_per_forward{{strategy="{strat}"}} {M.tokens_per_forward(chunks):.4f}')
            for i, a in enumerate(M.acceptance_by_position(chunks)):
                acc.append(f'mtp_acceptance_by_position{{strategy="{strat}",position="{i}"}} {a:.4f}')
        metric("mtp_tokens_per_forward", "gauge", "tokens emitted per row pass, recent passes", tpf)
        metric("mtp_acceptance_by_position", "gauge", "fraction of row passes emitting more than `position` tokens", acc)
        return "\n".join(out) + "\n"


# ---- the application --------------------------------------------------------------------------
class ServerState:
    def __init__(self, engine: Engine, config: ServeConfig, pass_time=None):
        self.engine, self.config = engine, config
        sc = config.scheduler
        if sc.max_model_len > engine.context_window:  # never promise more than the model's window
            sc.max_model_len = engine.context_window
        self.scheduler = Scheduler(engine.model, engine.mask_id, config.scheduler, pass_time)
        self.metrics = ServerMetrics()
        self.shadow_log = ShadowLog(config.shadow_log) if config.shadow_rate > 0 else None
        self.rng = random.Random(config.shadow_seed)
        self.created = int(time.time())

    # -- building a Sequence from a request
    def sampling(self, body: _Common) -> SamplingParams:
        stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else list(self.config.stop)
        if len(stop) > 4:
            raise APIError(400, "at most 4 stop sequences are supported", "stop")
        if body.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", "n")
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        t = self.config.temperature if body.temperature is None else body.temperature
        if not 0 <= t <= 2:
            raise APIError(400, f"temperature must be in [0, 2], got {t}", "temperature")
        top_p = self.config.top_p if body.top_p is None else body.top_p
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
        top_k = self.config.top_k if body.top_k is None else body.top_k
        if top_k < 0:
            raise APIError(400, f"top_k must be >= 0, got {top_k}", "top_k")
        seed = self.config.seed if body.seed is None else body.seed
        return SamplingParams(temperature=t, top_p=top_p, top_k=top_k, seed=seed, stop=stop)

    def strategy(self, body: _Common) -> Strategy:
        text = body.mtp.strategy if body.mtp and body.mtp.strategy is not None else self.config.strategy
        try:
            s = Strategy.parse(text)
        except ValueError as e:
            raise APIError(400, str(e), "mtp.strategy") from None
        if s.k > K_LIMIT:
            raise APIError(400, f"strategy {s}: K is at most {K_LIMIT} on this server", "mtp.strategy")
        return s

    def new_request(self, body: _Common, ids: list[int], max_tokens: int | None) -> Request:
        if body.model is not None and body.model != self.config.model_name:
            raise APIError(404, f"The model {body.model!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", "model", "model_not_found")
        params = self.sampling(body)
        strategy = self.strategy(body)
        limit = self.config.scheduler.max_model_len
        n = len(ids)
        if n >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has {n}",
                           "messages" if isinstance(body, ChatRequest) else "prompt", "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.config.max_tokens, limit - n)
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if n + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt ({n}) + "
                                f"max_tokens ({max_tokens}) exceed it", "max_tokens", "context_length_exceeded")
        params.max_new_tokens = max_tokens
        try:
            seq = self.engine.new_sequence(ids, strategy, params)
        except ValueError as e:
            raise APIError(400, str(e), "mtp.strategy") from None
        return Request(seq, adaptive=body.mtp.adaptive if body.mtp else True)

    def completion_ids(self, body: CompletionRequest) -> list[int]:
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "one prompt per request is supported", "prompt")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt must not be empty", "prompt")
            return self.engine.encode(p, chat=False)
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        vocab = self.engine.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab or t == self.engine.mask_id for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(p)

    def chat_ids(self, body: ChatRequest) -> list[int]:
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        messages = []
        for m in body.messages:
            c = m.content
            if isinstance(c, list):
                try:
                    c = "".join(part["text"] for part in c if part.get("type") == "text")
                except (KeyError, TypeError):
                    raise APIError(400, "message content parts must be {'type': 'text', 'text': ...}",
                                   "messages") from None
            messages.append({"role": m.role, "content": c or ""})
        try:
            return self.engine.encode(messages, chat=True)
        except APIError:
            raise
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from None

    # -- running a request
    def submit(self, req: Request, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()

        def on_event(r, tokens, final):
            if final:
                self.metrics.finished(r)
            with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
                loop.call_soon_threadsafe(q.put_nowait, (tokens, final))

        req.on_event = on_event
        try:
            self.scheduler.submit(req)
        except SchedulerClosed as e:
            raise APIError(503, str(e), code="server_shutting_down", type="server_error") from None
        except ValueError as e:
            raise APIError(400, str(e), "max_tokens", "context_length_exceeded") from None
        return q

    def text(self, req: Request, tokens: list[int]) -> str:
        seq = req.seq
        return seq.text if seq.text is not None else self.engine.decode_text(tokens)

    def mtp_summary(self, req: Request) -> dict:
        s = req.seq.stats.summary(req.seq.strategy.k)
        return {"strategy": str(req.seq.strategy), "forward_passes": s["forward_passes"],
                "tokens_per_forward": round(s["tokens_per_forward"], 4),
                "acceptance_by_position": [round(a, 4) for a in s["acceptance_by_position"]],
                "capped_passes": req.capped_passes,
                "queue_s": round((req.t_admitted or req.t_arrival) - req.t_arrival, 4),
                "decode_s": round((req.t_finish or 0) - (req.t_admitted or 0), 4) if req.t_finish else None}

    def maybe_shadow(self, req: Request) -> None:
        """After the answer went out: decode the same prompt with ntp in the background and log it."""
        seq = req.seq
        if (self.shadow_log is None or seq.strategy.kind == "ntp" or seq.finish_reason not in ("stop", "length")
                or self.rng.random() >= self.config.shadow_rate):
            return
        params = SamplingParams(temperature=seq.params.temperature, top_p=seq.params.top_p, top_k=seq.params.top_k,
                                seed=seq.params.seed, max_new_tokens=seq.params.max_new_tokens,
                                stop=list(seq.params.stop))
        shadow = Request(self.engine.new_sequence(seq.prompt_ids, Strategy(), params), background=True)
        primary = {"ids": list(seq.output), "text": self.text(req, seq.output),
                   "latency": req.t_finish - req.t_admitted, "strategy": str(seq.strategy),
                   "tpf": seq.stats.summary()["tokens_per_forward"], "id": req.id}

        def on_event(r, tokens, final):
            if not final or r.seq.finish_reason not in ("stop", "length"):
                return
            latency = r.t_finish - r.t_admitted
            rec = {"request_id": primary["id"], "strategy": primary["strategy"],
                   "prompt_tokens": len(seq.prompt_ids), "temperature": seq.params.temperature,
                   "tokens": len(primary["ids"]), "shadow_tokens": len(r.seq.output),
                   **compare(primary["ids"], primary["text"], r.seq.output, self.text(r, r.seq.output)),
                   "latency_s": round(primary["latency"], 4), "shadow_latency_s": round(latency, 4),
                   "latency_ratio": round(primary["latency"] / latency, 4) if latency > 0 else None,
                   "tokens_per_forward": round(primary["tpf"], 4)}
            self.shadow_log.write(rec)
            self.metrics.shadow_done(rec)

        shadow.on_event = on_event
        with contextlib.suppress(SchedulerClosed, ValueError):
            self.scheduler.submit(shadow)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that could be the start of a stop string."""
    n = 0
    for s in stops:
        for j in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:j]):
                n = j
                break
    return n


def create_app(engine: Engine, config: ServeConfig, pass_time=None):
    """The FastAPI app around an Engine. `pass_time(q)` (seconds per pass of q tokens) turns on the
    adaptive K policy; `mtp serve` measures it at start-up (mtp.core.costmodel)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    state = ServerState(engine, config, pass_time)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not state.scheduler.hosted:
            state.scheduler.start()
        yield
        state.scheduler.stop()

    app = FastAPI(title="mtp", lifespan=lifespan)
    app.state.mtp = state

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return JSONResponse(APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).body(),
                            status_code=exc.status_code)

    @app.middleware("http")
    async def auth(request: HTTPRequest, call_next):
        key = config.api_key
        if key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                err = APIError(401, "Incorrect API key provided", code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    async def parse(request: HTTPRequest, schema):
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = [str(x) for x in err["loc"]]
            raise APIError(400, f"{'.'.join(loc)}: {err['msg']}" if loc else err["msg"],
                           loc[0] if loc else None) from None

    async def run(request: HTTPRequest, body, ids, max_tokens, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            req = state.new_request(body, ids, max_tokens)
        except APIError:
            state.metrics.count(endpoint, "invalid")
            raise
        loop = asyncio.get_running_loop()
        queue = state.submit(req, loop)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": config.model_name}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream(request, req, queue, base, chat, include_usage, endpoint),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        tokens = []
        try:
            while True:
                try:
                    new, final = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        state.scheduler.cancel(req)
                        state.metrics.count(endpoint, "cancelled")
                        return JSONResponse({}, status_code=499)
                    continue
                tokens += new
                if final:
                    break
        finally:
            if not req.done.is_set():
                state.scheduler.cancel(req)
        if req.seq.finish_reason == "error":
            state.metrics.count(endpoint, "error")
            raise APIError(500, f"decoding failed: {req.error}", type="server_error")
        if req.seq.finish_reason == "cancelled":
            state.metrics.count(endpoint, "cancelled")
            raise APIError(503, "request cancelled: server shutting down", type="server_error")
        text = state.text(req, tokens)
        choice = {"index": 0, "finish_reason": req.seq.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        n_prompt = len(req.seq.prompt_ids)
        out = {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
               "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(tokens),
                         "total_tokens": n_prompt + len(tokens)},
               "mtp": state.mtp_summary(req)}
        state.metrics.count(endpoint, "ok")
        state.maybe_shadow(req)
        return JSONResponse(out)

    async def stream(request, req: Request, queue: asyncio.Queue, base: dict, chat: bool, include_usage: bool,
                     endpoint: str):
        tokens, sent = [], ""
        stops = req.seq.params.stop

        def chunk(text=None, finish=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                c = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return _sse({**base, "choices": [c]})

        finished = False
        try:
            if chat:
                yield chunk(role=True)
            while True:
                new, final = await queue.get()
                tokens += new
                if final:
                    if req.seq.finish_reason in ("error", "cancelled"):
                        msg = req.error or "request cancelled: server shutting down"
                        yield _sse(APIError(500, msg, type="server_error").body())
                        state.metrics.count(endpoint, req.seq.finish_reason)
                        finished = True
                        return
                    rest = state.text(req, tokens)[len(sent):]
                    if rest:
                        yield chunk(rest)
                    yield chunk(None, req.seq.finish_reason)
                    if include_usage:
                        n_prompt = len(req.seq.prompt_ids)
                        yield _sse({**base, "choices": [], "usage": {
                            "prompt_tokens": n_prompt, "completion_tokens": len(tokens),
                            "total_tokens": n_prompt + len(tokens)}, "mtp": state.mtp_summary(req)})
                    yield b"data: [DONE]\n\n"
                    finished = True
                    state.metrics.count(endpoint, "ok")
                    break
                if not new:
                    continue
                full = state.engine.decode_text(tokens)
                if full.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 character: wait for the rest
                safe = full[: len(full) - _stop_holdback(full, stops)] if stops else full
                if len(safe) > len(sent) and safe.startswith(sent):
                    yield chunk(safe[len(sent):])
                    sent = safe
        finally:
            if not finished:  # the client went away: free the row at the next pass
                state.scheduler.cancel(req)
                state.metrics.count(endpoint, "cancelled")
        state.maybe_shadow(req)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await parse(request, CompletionRequest)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        return await run(request, body, state.completion_ids(body), body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await parse(request, ChatRequest)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await run(request, body, state.chat_ids(body), max_tokens, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": state.created,
                                            "owned_by": "mtp"}]}

    @app.get("/health")
    async def health():
        if state.scheduler.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "running": state.scheduler.running, "queued": state.scheduler.queue_length}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(state.metrics.render(state.scheduler),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


# ---- running it ---------------------------------------------------------------------------------
def serve_app(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
              shutdown_timeout: float = 30.0) -> int:
    """Run the app with uvicorn until SIGINT/SIGTERM; SIGTERM drains and returns 0.

    From the main thread (`mtp serve`), the engine loop runs on the main thread and uvicorn on a
    helper thread: torch is ~35% faster per small pass on the thread that loaded the model (see
    `Scheduler.start`). Signals reach the main thread, which drains the scheduler and tells uvicorn
    to exit; uvicorn's shutdown (lifespan) stops the engine loop, which returns here."""
    import uvicorn

    state: ServerState = app.state.mtp
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout)
    server = uvicorn.Server(config)
    if threading.current_thread() is not threading.main_thread():  # no signals here; the lifespan
        server.run()  # starts an engine thread
        return 0 if server.started else 1

    def on_signal(sig, frame):
        state.scheduler.drain()  # stop admitting at once; running requests finish
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True  # a second Ctrl-C: stop waiting for open connections
        server.should_exit = True

    state.scheduler.hosted = True
    prev = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    http = threading.Thread(target=server.run, name="mtp-http", daemon=True)
    http.start()
    try:
        state.scheduler.run(alive=http.is_alive)
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
        http.join(shutdown_timeout + 5)
    return 0 if server.started else 1


def add_cli(sub) -> None:
    from mtp.cli.generate import add_model_args, add_sampling_args
    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and shadow mode")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (KV-cache rows)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="prompt + max_tokens per request (default: min(context window, 1024))")
    p.add_argument("--max-cache-tokens", type=int, default=0,
                   help="admission budget: sum of prompt + max_tokens + K over running requests "
                        "(default max-batch x max-model-len)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="cap K per pass with the cost model when proposals do not pay (default on)")
    p.add_argument("--cost-model", default=None, help="cost-model JSON from `mtp bench --profile` "
                                                       "(default: measured at start-up)")
    p.add_argument("--shadow-rate", type=float, default=0.0, help="fraction of MTP requests re-decoded with ntp")
    p.add_argument("--shadow-log", default="mtp-shadow.jsonl", help="JSONL log of shadow comparisons")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def build_config(args, context_window: int) -> ServeConfig:
    max_len = args.max_model_len or min(context_window, 1024)
    if max_len > context_window:
        raise ValueError(f"--max-model-len {max_len} exceeds the model's context window {context_window}")
    sched = SchedulerConfig(max_batch=args.max_batch, max_model_len=max_len, max_cache_tokens=args.max_cache_tokens,
                            adaptive=args.adaptive)
    return ServeConfig(model_name=args.served_model_name or args.model, strategy=args.strategy,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       max_tokens=args.max_new_tokens, stop=list(args.stop or []), seed=args.seed,
                       api_key=args.api_key, shadow_rate=args.shadow_rate,
                       shadow_log=args.shadow_log, scheduler=sched)


def run(args) -> int:
    from mtp.cli.generate import engine_config
    Strategy.parse(args.strategy)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), format="%(message)s")
    engine = Engine.load(engine_config(args))
    config = build_config(args, engine.context_window)
    pass_time = None
    if config.scheduler.adaptive:
        from mtp.core.costmodel import CostModel
        if args.cost_model:
            pass_time = CostModel.load(args.cost_model).pass_time
        elif engine.mask_id is not None or not engine.config.proposer.startswith("mask"):
            print("mtp serve: measuring the pass-time cost model (--cost-model PATH skips this)...", file=sys.stderr)
            from mtp.serving.scheduler import measured_cost
            cost = measured_cost(engine.model, config.scheduler.max_batch)
            pass_time = cost.pass_time
            print("mtp serve: t(q) ms: " + ", ".join(f"{q}:{1000 * t:.0f}" for q, t in cost.points.items()),
                  file=sys.stderr)
    app = create_app(engine, config, pass_time)
    print(f"mtp serve: {config.model_name} on http://{args.host}:{args.port}/v1 (strategy {config.strategy}, "
          f"max batch {config.scheduler.max_batch})", file=sys.stderr)
    return serve_app(app, args.host, args.port, args.log_level, args.shutdown_timeout)
