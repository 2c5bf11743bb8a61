"""Answering `/v1/completions` and `/v1/chat/completions`: one request through the scheduler, as one
JSON response or as server-sent events (`stream: true`, ending in `data: [DONE]`). A request that
fails (500) or that the server cancels at shutdown (503, `server_shutting_down`) is answered with that
`{"error": ...}`: as the JSON response, or as the stream's last event before `data: [DONE]`.

Tokens cross from the engine thread per pass through `loop.call_soon_threadsafe` into an asyncio
queue per request. Text is detokenised here; a streamed delta never ends inside a possible stop
string or an incomplete UTF-8 character. A non-streaming request watches its client independently
of token flow (every DISCONNECT_POLL_S), so an abandoned request leaves the batch at the next pass.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from mtp.serving.config import DISCONNECT_POLL_S
from mtp.serving.openai import APIError
from mtp.serving.scheduler import Request
from mtp.serving.state import ServerState


async def complete(state: ServerState, request: HTTPRequest, body, ids: list[int], max_tokens: int | None, chat: bool):
    """Answer one (chat) completion request: a JSON response, or a server-sent event stream."""
    config = state.config
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
    base = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": config.model_name,
    }
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            stream(state, req, queue, base, chat, include_usage, endpoint),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
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
        return JSONResponse(APIError(499, "client closed the request", code="client_closed").body(), status_code=499)
    if req.seq.finish_reason == "error":
        state.metrics.count(endpoint, "error")
        raise APIError(500, f"decoding failed: {req.error}", type="server_error")
    if req.seq.finish_reason == "cancelled":
        state.metrics.count(endpoint, "cancelled")
        raise shutting_down()
    text = state.text(req, tokens)
    choice = {"index": 0, "finish_reason": req.seq.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    n_prompt = len(req.seq.prompt_ids)
    out = {
        **base,
        "object": "chat.completion" if chat else "text_completion",
        "choices": [choice],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(tokens), "total_tokens": n_prompt + len(tokens)},
        "mtp": state.mtp_summary(req),
    }
    state.metrics.count(endpoint, "ok")
    state.maybe_shadow(req)
    return JSONResponse(out)


async def stream(
    state: ServerState, req: Request, queue: asyncio.Queue, base: dict, chat: bool, include_usage: bool, endpoint: str
):
    """The event stream of one request; a client that goes away frees its row at the next pass."""
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
                    err = (
                        shutting_down()
                        if req.seq.finish_reason == "cancelled"
                        else APIError(500, f"decoding failed: {req.error}", type="server_error")
                    )
                    yield _sse(err.body())
                    yield b"data: [DONE]\n\n"
                    state.metrics.count(endpoint, req.seq.finish_reason)
                    finished = True
                    return
                rest = state.text(req, tokens)[len(sent) :]
                if rest:
                    yield chunk(rest)
                yield chunk(None, req.seq.finish_reason)
                if include_usage:
                    n_prompt = len(req.seq.prompt_ids)
                    yield _sse(
                        {
                            **base,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": n_prompt,
                                "completion_tokens": len(tokens),
                                "total_tokens": n_prompt + len(tokens),
                            },
                            "mtp": state.mtp_summary(req),
                        }
                    )
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
                yield chunk(safe[len(sent) :])
                sent = safe
    finally:
        if not finished:  # the client went away: free the row at the next pass
            state.scheduler.cancel(req)
            state.metrics.count(endpoint, "cancelled")
    state.maybe_shadow(req)


def shutting_down() -> APIError:
    """What a request cancelled by the server (SIGTERM past --shutdown-timeout) is answered."""
    return APIError(503, "request cancelled: server shutting down", code="server_shutting_down", type="server_error")


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
