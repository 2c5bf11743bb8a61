"""`mtp serve`: an OpenAI-compatible HTTP server over continuous batching (mtp.serving.scheduler).

Endpoints: POST /v1/completions and /v1/chat/completions (OpenAI schema, `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models, /health, /metrics (Prometheus text).
A request may carry `"mtp": {"strategy": "conf_adapt:0.9", "adaptive": false}`; omitted fields take the
server's flags (`adaptive: false` exempts the request from the per-pass K cap, see `mtp.serving.scheduler`).
Every bad input is HTTP 4xx with an OpenAI-style `{"error": {...}}` (413 for a body over
--max-body-bytes); `--api-key` guards every path but /health; SIGTERM stops admitting, lets running
requests finish (up to --shutdown-timeout) and exits 0.

Threads: uvicorn's event loop parses and answers (tokenising in a worker thread, so one large prompt
never stalls other streams); one engine thread (`Scheduler`) owns the model and the KV cache. The
request checks live in `mtp.serving.state`, the answering in `mtp.serving.completions`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import threading

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtp.core.engine import Engine
from mtp.serving.completions import complete
from mtp.serving.config import ServeConfig
from mtp.serving.openai import APIError, ChatRequest, CompletionRequest
from mtp.serving.state import ServerState


class APIKeyAuth:
    """`Authorization: Bearer KEY` on every path but /health. A plain ASGI middleware: it hands the
    request's `receive` through untouched, so a handler still sees its client disconnect."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "Incorrect API key provided", code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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

    if config.api_key:
        app.add_middleware(APIKeyAuth, key=config.api_key)

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
    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await parse(request, CompletionRequest)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        ids = await asyncio.to_thread(state.completion_ids, body)  # tokenising never blocks other streams
        return await complete(state, request, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await parse(request, ChatRequest)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        ids = await asyncio.to_thread(state.chat_ids, body)  # tokenising never blocks other streams
        return await complete(state, request, body, ids, max_tokens, chat=True)

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
    helper thread (torch is faster per small pass on the thread that loaded the model, see
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
