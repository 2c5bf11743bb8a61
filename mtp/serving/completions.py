"""Answering `/v1/completions` and `/v1/chat/completions`: one request through the scheduler, as one
JSON response or as server-sent events (`stream: true`, ending in `data: [DONE]`). A request that
fails (500) or that the server cancels at shutdown (503, `server_shutting_down`) is answered with that
`{"error": ...}`: as the JSON response, or as the stream's last event before `data: [DONE]`.

A request's choices (`n`, `mtp.serving.state.Asked`) decode as rows of their own (greedy: one row,
answered n times); their tokens cross from the engine thread per pass through
`loop.call_soon_threadsafe` into one asyncio queue, tagged with the choice. Text is detokenised here;
a streamed delta never ends inside a possible stop string or an incomplete UTF-8 character, and carries
the log-probabilities of the tokens whose text it completes (`mtp.serving.logprobs`; the rest with the
final delta). `echo` sends the prompt (and its log-probabilities) first. A non-streaming request
watches its client independently of token flow (every DISCONNECT_POLL_S), so an abandoned request
leaves the batch at the next pass.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from mtp.serving.config import DISCONNECT_POLL_S
from mtp.serving.logprobs import Pieces, chat_content, completion_logprobs, text_offsets
from mtp.serving.openai import APIError
from mtp.serving.scheduler import Request
from mtp.serving.state import Asked, ServerState


async def complete(state: ServerState, request: HTTPRequest, body, ids: list[int], max_tokens: int | None, chat: bool):
    """Answer one (chat) completion request: a JSON response, or a server-sent event stream."""
    config = state.config
    endpoint = "chat" if chat else "completions"
    try:
        req = state.new_request(body, ids, max_tokens)
        asked = state.asked(body, max_tokens)
        reqs = state.choices(req, asked)
    except APIError:
        state.metrics.count(endpoint, "invalid")
        raise
    loop = asyncio.get_running_loop()
    queue = state.submit(reqs, loop)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    base = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": config.model_name,
    }
    answer = Answer(state, reqs, asked, chat, body.prompt if not chat and isinstance(body.prompt, str) else None)
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            stream(state, answer, queue, base, include_usage, endpoint),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    tokens, gone = await _gather(state, request, reqs, queue)
    if gone:
        state.metrics.count(endpoint, "cancelled")
        return JSONResponse(APIError(499, "client closed the request", code="client_closed").body(), status_code=499)
    for r in reqs:
        if r.seq.finish_reason == "error":
            state.metrics.count(endpoint, "error")
            raise APIError(500, f"decoding failed: {r.error}", type="server_error")
    if any(r.seq.finish_reason == "cancelled" for r in reqs):
        state.metrics.count(endpoint, "cancelled")
        raise shutting_down()
    choices = [answer.choice(index, tokens[answer.row(index)]) for index in range(asked.n)]
    out = {
        **base,
        "object": "chat.completion" if chat else "text_completion",
        "choices": choices,
        "usage": answer.usage([tokens[answer.row(index)] for index in range(asked.n)]),
        "mtp": answer.summary(),
    }
    state.metrics.count(endpoint, "ok")
    state.maybe_shadow(req)
    return JSONResponse(out)


async def _gather(state: ServerState, request: HTTPRequest, reqs: list[Request], queue: asyncio.Queue):
    """(every row's tokens, whether the client went away): the rows' tokens gathered until each is final,
    the client watched meanwhile (its leaving cancels the rows); a row left unfinished is cancelled."""
    tokens: list[list[int]] = [[] for _ in reqs]
    gone = asyncio.Event()

    async def watch_client():  # independent of token flow: a busy batch never hides a gone client
        while not all(r.done.is_set() for r in reqs):
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                gone.set()
                for r in reqs:
                    state.scheduler.cancel(r)  # the rows leave at the next pass
                return

    watcher = asyncio.ensure_future(watch_client())
    try:
        left = len(reqs)
        while left:
            i, new, final, _ = await queue.get()
            tokens[i] += new
            left -= final
    finally:
        watcher.cancel()
        for r in reqs:
            if not r.done.is_set():
                state.scheduler.cancel(r)
    return tokens, gone.is_set()


class Answer:
    """How a request's choices are answered: their text, finish reasons, log-probabilities and echo."""

    def __init__(self, state: ServerState, reqs: list[Request], asked: Asked, chat: bool, prompt_text: str | None):
        self.state, self.reqs, self.asked, self.chat = state, reqs, asked, chat
        self.engine = state.engine
        self.piece = Pieces(state.engine.tokenizer)
        self.echo = ""
        if asked.echo:  # the client's own text when it sent text, else the prompt's ids decoded
            ids = reqs[0].seq.prompt_ids
            self.echo = prompt_text if prompt_text is not None else self.engine.decode_text(ids)

    def row(self, index: int) -> int:
        """The request decoding choice `index` (greedy n > 1: the one request)."""
        return index if len(self.reqs) > 1 else 0

    def text(self, r: Request, tokens: list[int]) -> str:
        return self.state.text(r, tokens) if self.asked.generate else ""

    def finish_reason(self, r: Request) -> str:
        return r.seq.finish_reason if self.asked.generate else "length"

    def echo_logprobs(self) -> dict | None:
        """The echoed prompt's part of a completion's logprobs (the first token has none)."""
        if self.asked.logprobs is None:
            return None
        seq = self.reqs[0].seq
        ids = seq.prompt_ids
        records = [None] + list(seq.prompt_token_logprobs)
        records += [None] * (len(ids) - len(records))
        return completion_logprobs(ids, records, text_offsets(ids, self.engine.decode_text), self.piece)

    def logprobs(self, ids: list[int], records: list, before: list[int] = ()) -> dict | None:
        """The logprobs of generated tokens `ids` (following the generated tokens `before`) in the shape
        of the endpoint; completions offsets count the echoed prompt and the text before them."""
        if self.asked.logprobs is None or not self.asked.generate:
            return None
        if self.chat:
            return {"content": chat_content(records, self.piece)}
        decode = self.engine.decode_text
        start = len(self.echo) + (len(decode(list(before))) if before else 0)
        return completion_logprobs(ids, records, text_offsets(ids, decode, start), self.piece)

    def choice(self, index: int, tokens: list[int]) -> dict:
        r = self.reqs[self.row(index)]
        text = self.text(r, tokens)
        seq = r.seq
        logprobs = self.logprobs(list(seq.output), list(seq.token_logprobs))
        if self.chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "finish_reason": self.finish_reason(r),
                "logprobs": logprobs,
            }
        if self.asked.echo:
            text = self.echo + text
            head = self.echo_logprobs()
            if head is not None:
                tail = logprobs or {k: [] for k in head}
                logprobs = {k: head[k] + tail[k] for k in head}
        return {"index": index, "text": text, "finish_reason": self.finish_reason(r), "logprobs": logprobs}

    def usage(self, tokens: list[list[int]]) -> dict:
        n_prompt = len(self.reqs[0].seq.prompt_ids)
        n_out = sum(len(t) for t in tokens) if self.asked.generate else 0
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def summary(self) -> dict:
        out = self.state.mtp_summary(self.reqs[0])
        if len(self.reqs) > 1:
            out["choices"] = [{**self.state.mtp_summary(r), "shared_prefill": r.shared_prefill} for r in self.reqs]
        return out


class _Streamed:
    """One decoding row's progress in a stream: tokens and log-probabilities received, text sent."""

    def __init__(self):
        self.tokens: list[int] = []
        self.records: list = []
        self.sent = ""
        self.n_sent = 0  # tokens whose log-probabilities went out
        self.echoed = False


class _Events:
    """The server-sent events of one streamed request, made from its rows' tokens as they arrive (`take`);
    each method yields the events of one moment of the stream."""

    def __init__(self, state: ServerState, answer: Answer, base: dict):
        self.answer, self.base = answer, base
        self.reqs, self.asked = answer.reqs, answer.asked
        self.decode = state.engine.decode_text
        self.rows = [_Streamed() for _ in answer.reqs]

    def chunks(self, row: int, text=None, finish=None, role=False, logprobs=None):
        """The same delta for every choice that row `row` answers."""
        indices = range(self.asked.n) if len(self.reqs) == 1 else [row]
        for index in indices:
            if self.answer.chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                c = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                c = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            yield _sse({**self.base, "choices": [c]})

    def roles(self):
        """A chat stream opens with the assistant's role for every row."""
        if self.answer.chat:
            for i in range(len(self.reqs)):
                yield from self.chunks(i, role=True)

    def take(self, i: int, new: list[int], records: list) -> None:
        st = self.rows[i]
        st.tokens += new
        st.records += records

    def echo(self, i: int):
        """With `echo`, the prompt (and its log-probabilities) before row i's first tokens."""
        st = self.rows[i]
        if self.asked.echo and not st.echoed:
            st.echoed = True
            yield from self.chunks(i, self.answer.echo, logprobs=self.answer.echo_logprobs())

    def error(self, i: int) -> APIError | None:
        """What answers a row that ended in an error (500) or that the server cancelled (503); None otherwise."""
        r = self.reqs[i]
        if r.seq.finish_reason not in ("error", "cancelled"):
            return None
        if r.seq.finish_reason == "cancelled":
            return shutting_down()
        return APIError(500, f"decoding failed: {r.error}", type="server_error")

    def delta(self, i: int, new: list[int]):
        """Row i's new text that can no longer change: none inside a possible stop string or an incomplete
        UTF-8 character; with the log-probabilities of the tokens whose text it completes."""
        r, st = self.reqs[i], self.rows[i]
        if not new or not self.asked.generate:
            return
        full = self.decode(st.tokens)
        if full.endswith("\ufffd"):
            return  # an incomplete UTF-8 character: wait for the rest
        stops = r.seq.params.stop
        safe = full[: len(full) - _stop_holdback(full, stops)] if stops else full
        if len(safe) > len(st.sent) and safe.startswith(st.sent):
            lp = None
            if self.asked.logprobs is not None:  # the tokens whose text this delta completes
                k = st.n_sent
                while k < len(st.records) and len(self.decode(st.tokens[: k + 1])) <= len(safe):
                    k += 1
                lp = self.answer.logprobs(st.tokens[st.n_sent : k], st.records[st.n_sent : k], st.tokens[: st.n_sent])
                st.n_sent = k
            yield from self.chunks(i, safe[len(st.sent) :], logprobs=lp)
            st.sent = safe

    def final(self, i: int):
        """Row i is done: the rest of its text (and log-probabilities), then its finish reason."""
        r, st = self.reqs[i], self.rows[i]
        if self.asked.generate:
            rest = self.answer.text(r, st.tokens)[len(st.sent) :]
            output = r.seq.output  # final: the engine no longer changes it
            ids, recs = output[st.n_sent :], r.seq.token_logprobs[st.n_sent : len(output)]
            lp = self.answer.logprobs(ids, recs, output[: st.n_sent]) if ids else None
            if rest or lp is not None:
                yield from self.chunks(i, rest, logprobs=lp)
        yield from self.chunks(i, None, self.answer.finish_reason(r))

    def usage(self) -> bytes:
        """`stream_options.include_usage`: the token counts and mtp's summary, after every choice's end."""
        answer = self.answer
        tokens = [self.rows[answer.row(index)].tokens for index in range(self.asked.n)]
        return _sse({**self.base, "choices": [], "usage": answer.usage(tokens), "mtp": answer.summary()})


async def stream(
    state: ServerState, answer: Answer, queue: asyncio.Queue, base: dict, include_usage: bool, endpoint: str
):
    """The event stream of one request; a client that goes away frees its rows at the next pass."""
    reqs = answer.reqs
    events = _Events(state, answer, base)
    finished = False
    try:
        for c in events.roles():
            yield c
        left = len(reqs)
        while left:
            i, new, final, records = await queue.get()
            events.take(i, new, records)
            for c in events.echo(i):
                yield c
            err = events.error(i) if final else None
            if err is not None:  # this row's error ends the stream; the other rows stop
                yield _sse(err.body())
                yield b"data: [DONE]\n\n"
                state.metrics.count(endpoint, reqs[i].seq.finish_reason)
                finished = True
                _cancel(state, reqs)
                return
            for c in events.final(i) if final else events.delta(i, new):
                yield c
            left -= final
        if include_usage:
            yield events.usage()
        yield b"data: [DONE]\n\n"
        finished = True
        state.metrics.count(endpoint, "ok")
    finally:
        if not finished:  # the client went away: free the rows at the next pass
            _cancel(state, reqs)
            state.metrics.count(endpoint, "cancelled")
    state.maybe_shadow(reqs[0])


def _cancel(state: ServerState, reqs: list[Request]) -> None:
    for r in reqs:
        state.scheduler.cancel(r)


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
