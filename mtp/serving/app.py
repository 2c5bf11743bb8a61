"""`mtp serve`: an OpenAI-compatible HTTP server over continuous batching (mtp.serving.scheduler).

Endpoints: POST /v1/completions and /v1/chat/completions (OpenAI schema, `stream: true` as
server-sent events ending in `data: [DONE]`; `n`, `logprobs` / `top_logprobs`, and on completions
`echo`, prompt scoring included: `mtp.serving.state`), GET /v1/models, /health, /metrics (Prometheus text).
A request may carry `"mtp": {"strategy": "conf_adapt:0.9", "adaptive": false}`; omitted fields take the
server's flags (`adaptive: false` exempts the request from the per-pass K cap, see `mtp.serving.scheduler`).
Every bad input is HTTP 4xx with an OpenAI-style `{"error": {...}}` (413 for a body over
--max-body-bytes); an API key (see `mtp.cli.serve`) guards every path but /health, which then
shows a client without the key its status alone (no load, no rollout); SIGTERM stops
admitting, lets running requests finish (up to --shutdown-timeout, then they are answered 503 / a
final error event) and exits 0.

Threads: uvicorn's event loop reads and answers (parsing and tokenising in a worker thread, so one
large request never stalls other streams); one engine thread (`Scheduler`) owns the model and the KV
cache. The request checks live in `mtp.serving.openai` and `mtp.serving.state`, the answering in
`mtp.serving.completions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import signal
import threading

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtp.core.engine import Engine
from mtp.serving.completions import complete
from mtp.serving.config import SHUTDOWN_GRACE_S, ServeConfig, check_shutdown_timeout
from mtp.serving.openai import APIError, ChatRequest, CompletionRequest, parse_request
from mtp.serving.prometheus import CONTENT_TYPE
from mtp.serving.state import ServerState


def has_key(scope, key: bytes) -> bool:
    """The request carries `Authorization: Bearer KEY` (the scheme case-insensitive, RFC 9110 11.1;
    compared in constant time)."""
    scheme, _, token = dict(scope.get("headers") or []).get(b"authorization", b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


class APIKeyAuth:
    """`Authorization: Bearer KEY` (`has_key`) on every path but /health, which shows a client without
    the key its status alone. A plain ASGI middleware: it hands the request's `receive` through
    untouched, so a handler still sees its client disconnect."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and not has_key(scope, self.key):
            err = APIError(401, "Incorrect API key provided", code="invalid_api_key")
            await JSONResponse(err.body(), status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(engine: Engine, config: ServeConfig, pass_time=None):
    """The FastAPI app around an Engine. `pass_time(q)` (seconds per pass of q tokens) turns on the
    adaptive K policy; `mtp serve` measures it at start-up (mtp.core.policy.costmodel)."""
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
        return JSONResponse(
            APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).body(), status_code=exc.status_code
        )

    if config.api_key:
        app.add_middleware(APIKeyAuth, key=config.api_key)
    _completion_routes(app, state)
    _info_routes(app, state)
    return app


async def read_body(request: HTTPRequest, limit: int) -> bytes:
    """The body, refused with 413 as soon as it exceeds `limit` bytes (declared or streamed)."""
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


def _completion_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/completions and /v1/chat/completions: the body read, parsed and tokenised off the event
    loop, then answered (`mtp.serving.completions.complete`)."""
    config = state.config

    async def parse(request: HTTPRequest, schema):
        # read, then parsed off the event loop: a 4 MiB body never stalls streams
        raw = await read_body(request, config.max_body_bytes)
        return await asyncio.to_thread(parse_request, raw, schema, config.max_messages)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await parse(request, CompletionRequest)
        ids = await asyncio.to_thread(state.completion_ids, body)  # tokenising never blocks other streams
        return await complete(state, request, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await parse(request, ChatRequest)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        ids = await asyncio.to_thread(state.chat_ids, body)  # tokenising never blocks other streams
        return await complete(state, request, body, ids, max_tokens, chat=True)


def _info_routes(app: FastAPI, state: ServerState) -> None:
    """GET /v1/models, /health (also HEAD) and /metrics (Prometheus text)."""
    config = state.config

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": config.model_name, "object": "model", "created": state.created, "owned_by": "mtp"}],
        }

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: HTTPRequest):
        """Liveness for anyone; the load and the rollout (tuned strategy, tolerance, window losses)
        only without an API key or with it."""
        if state.scheduler.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if config.api_key and not has_key(request.scope, config.api_key.encode()):
            return {"status": "ok"}
        body = {"status": "ok", "running": state.scheduler.running, "queued": state.scheduler.queue_length}
        if state.rollout is not None:
            body["rollout"] = state.rollout.health()
        return body

    @app.get("/metrics")
    async def prometheus():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


# ---- running it ---------------------------------------------------------------------------------
def serve_app(
    app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", shutdown_timeout: float = 30.0
) -> int:
    """Run the app with uvicorn until SIGINT/SIGTERM; SIGTERM drains and returns 0.

    From the main thread (`mtp serve`), the engine loop runs on the main thread and uvicorn on a
    helper thread (torch is faster per small pass on the thread that loaded the model, see
    `Scheduler.start`). Signals reach the main thread, which drains the scheduler and tells uvicorn
    to exit: nothing new is admitted, running requests have `shutdown_timeout` seconds to finish, then
    the scheduler cancels the rest (a waiting client gets a 503 JSON error, a stream a final error
    event and `data: [DONE]`); uvicorn waits SHUTDOWN_GRACE_S longer for those answers to go out, and
    its shutdown (lifespan) stops the engine loop, which returns here. A `shutdown_timeout` that is
    not a finite number >= 0 is a ValueError (`check_shutdown_timeout`), before anything binds."""
    shutdown_timeout = check_shutdown_timeout(shutdown_timeout)
    state: ServerState = app.state.mtp
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_GRACE_S,
    )
    server = uvicorn.Server(config)
    if threading.current_thread() is not threading.main_thread():  # no signals here; the lifespan
        server.run()  # starts an engine thread
        return 0 if server.started else 1

    def on_signal(sig, frame):
        again = server.should_exit and sig == signal.SIGINT  # a second Ctrl-C: stop at once
        state.scheduler.drain(0.0 if again else shutdown_timeout)  # stop admitting; running requests finish
        server.force_exit = server.force_exit or again
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
        http.join(shutdown_timeout + SHUTDOWN_GRACE_S + 5)
    return 0 if server.started else 1
