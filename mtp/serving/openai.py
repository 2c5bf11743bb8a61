"""The OpenAI request schema `mtp serve` honours, and the errors it answers with.

Unknown fields are ignored, known ones type-checked (strict: `"temperature": "hot"` is a 400, not a
coercion) and bounded: `model` and each `stop` string at most MAX_FIELD_CHARS characters, `mtp.strategy`
MAX_STRATEGY_CHARS, a message's `role` one of ROLES (what is tokenised, the roles and contents together,
is bounded by --max-prompt-chars in `mtp.serving.state`). `parse_request` turns a body into a request:
JSON nested deeper than Python's recursion limit, an integer of more than MAX_INT_DIGITS digits or more
than --max-messages messages is refused before any validation. Every bad input becomes an `APIError`:
HTTP 4xx with an OpenAI-style `{"error": {"message", "type", "param", "code"}}` body and a plain
one-line message that never echoes the client's input at length.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError

MAX_FIELD_CHARS = 256  # `model`, each `stop` string
MAX_STRATEGY_CHARS = 64  # `mtp.strategy` (`conf_adapt:0.9:32` is 16)
MAX_INT_DIGITS = 20  # any integer in the body (2**64 has 20 digits: `seed` is refused with its own message)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")

Short = Annotated[str, StringConstraints(max_length=MAX_FIELD_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class MTPOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    strategy: Annotated[str, StringConstraints(max_length=MAX_STRATEGY_CHARS)] | None = None
    # false: this request's K is never capped by the adaptive policy, so a lossy strategy
    # (conf_adapt, static) emits exactly what `mtp generate` does, at whatever it costs the batch
    adaptive: bool = True


class CommonRequest(_Strict):
    """The fields completions and chat requests share."""

    model: Short | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Short | list[Short] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: dict | None = None
    logprobs: bool | int | None = None  # completions: N, the top alternatives per token; chat: true / false
    mtp: MTPOptions | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None


class ChatMessage(_Strict):
    role: Literal[ROLES]
    content: str | list[dict] | None = None


class ChatRequest(CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None  # with `logprobs: true`


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


R = TypeVar("R", CompletionRequest, ChatRequest)


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise APIError(
            400,
            f"the request body holds an integer of {len(digits.lstrip('-'))} digits; at most "
            f"{MAX_INT_DIGITS} are accepted",
        )
    return int(digits)


def parse_request(raw: bytes, schema: type[R], max_messages: int) -> R:
    """The request in a body, or an APIError (400). CPU-bound on large bodies: call it off the event loop."""
    try:
        data = json.loads(raw, parse_int=_int)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, "request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    messages = data.get("messages") if schema is ChatRequest else None
    if isinstance(messages, list) and len(messages) > max_messages:
        raise APIError(
            400,
            f"the request has {len(messages)} messages, more than this server's limit of {max_messages}",
            "messages",
        )
    try:
        return schema.model_validate(data)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))  # in a union: the member that got furthest
        loc = [str(x)[:40] for x in err["loc"]]
        raise APIError(400, f"{'.'.join(loc)}: {err['msg']}" if loc else err["msg"], loc[0] if loc else None) from None
