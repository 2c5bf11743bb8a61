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

import asyncio
import contextlib
import hmac
import json
import logging
import random
import signal
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtp.core.engine import Engine
from mtp.core.sampling import SamplingParams
from mtp.core.strategy import Strategy
from mtp.serving.openai import APIError, ChatRequest, CompletionRequest, _Common
from mtp.serving.prometheus import ServerMetrics
from mtp.serving.config import DISCONNECT_POLL_S, ServeConfig
from mtp.serving.scheduler import Request, Scheduler, SchedulerClosed
from mtp.serving.shadow import ShadowLog, compare

log = logging.getLogger("mtp.serve")

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
        top_p = self.config.top_p if body.top_p is None else body.top_p
        top_k = self.config.top_k if body.top_k is None else body.top_k
        seed = self.config.seed if body.seed is None else body.seed
        try:  # the limits every front end shares
            return SamplingParams(temperature=t, top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param if param in ("temperature", "top_p", "top_k", "seed") else None) \
                from None

    def strategy(self, body: _Common) -> Strategy:
        text = body.mtp.strategy if body.mtp and body.mtp.strategy is not None else self.config.strategy
        try:
            return Strategy.parse(text)  # K is capped there, for every front end
        except ValueError as e:
            raise APIError(400, str(e), "mtp.strategy") from None

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

    def check_text(self, text: str, param: str) -> str:
        """Text a client sent: valid Unicode (no lone surrogates) and within the character limit,
        checked before any tokenising."""
        if len(text) > self.config.max_prompt_chars:
            raise APIError(400, f"the prompt has {len(text)} characters, more than this server's limit of "
                                f"{self.config.max_prompt_chars}", param, "context_length_exceeded")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the prompt is not valid UTF-8 text (it holds a lone surrogate)", param) from None
        return text

    def completion_ids(self, body: CompletionRequest) -> list[int]:
        """Token ids of a completion request's prompt (call off the event loop: it tokenises)."""
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "one prompt per request is supported", "prompt")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt must not be empty", "prompt")
            return self.engine.encode(self.check_text(p, "prompt"), chat=False)
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        vocab = self.engine.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab or t == self.engine.mask_id for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(p)

    def chat_ids(self, body: ChatRequest) -> list[int]:
        """Token ids of a chat request's messages with the chat template (call off the event loop)."""
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        messages, total = [], 0
        for m in body.messages:
            c = m.content
            if isinstance(c, list):
                try:
                    texts = [part["text"] for part in c if part.get("type") == "text"]
                except (KeyError, TypeError, AttributeError):
                    raise APIError(400, "message content parts must be {'type': 'text', 'text': ...}",
                                   "messages") from None
                if not texts or not all(isinstance(x, str) for x in texts):
                    raise APIError(400, "a message's content parts hold no text (only text parts are supported)",
                                   "messages")
                c = "".join(texts)
            total += len(c or "")
            if total > self.config.max_prompt_chars:
                self.check_text("x" * total, "messages")  # the one message for the limit
            messages.append({"role": m.role, "content": self.check_text(c or "", "messages")})
        try:
            return self.engine.encode(messages, chat=True)
        except APIError:
            raise
        except Exception as e:  # details go to the log, not to the client
            log.info("chat template failed: %s", e)
            raise APIError(400, "cannot apply the model's chat template to these messages", "messages") from None

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

    async def read_body(request: HTTPRequest) -> bytes:
        """The body, refused with 413 as soon as it exceeds the limit (declared or streamed)."""
        limit = config.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = APIError(413, f"request body over this server's limit of {limit} bytes", code="body_too_large")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(request: HTTPRequest, schema):
        raw = await read_body(request)
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
        tokens, gone = [], asyncio.Event()

        async def watch_client():  # independent of token flow: a busy batch never hides a gone client
            while not req.done.is_set():
                await asyncio.sleep(DISCONNECT_POLL_S)
                if await request.is_disconnected():
                    gone.set()
                    state.scheduler.cancel(req)  # the row leaves at the next pass
                    return

        watcher = asyncio.ensure_future(watch_client())
        try:
            while True:
                new, final = await queue.get()
                tokens += new
                if final:
                    break
        finally:
            watcher.cancel()
            if not req.done.is_set():
                state.scheduler.cancel(req)
        if gone.is_set():
            state.metrics.count(endpoint, "cancelled")
            return JSONResponse(APIError(499, "client closed the request", code="client_closed").body(),
                                status_code=499)
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
        ids = await asyncio.to_thread(state.completion_ids, body)  # tokenising never blocks other streams
        return await run(request, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await parse(request, ChatRequest)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        ids = await asyncio.to_thread(state.chat_ids, body)  # tokenising never blocks other streams
        return await run(request, body, ids, max_tokens, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": state.created,
                                            "owned_by": "mtp"}]}

    @app.api_route("/health", methods=["GET", "HEAD"])
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
