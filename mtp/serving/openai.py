"""The OpenAI request schema `mtp serve` honours, and the errors it answers with.

Unknown fields are ignored, known ones type-checked (strict: `"temperature": "hot"` is a 400, not a
coercion; the message names the field, what it takes and the JSON type it got) and bounded. Fields
that would change the output but that mtp does not implement (`UNSUPPORTED`: `logit_bias`, the
penalties, `response_format`, `tools`, ...) are a 400 naming the field unless they hold their no-op
value; `user` and the other fields in `IGNORED` change nothing and are accepted (docs/limits.md).
Bounds: `model` and each `stop` string at most MAX_FIELD_CHARS characters, `mtp.strategy`
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
    # typed, but refused unless they hold their no-op value (UNSUPPORTED)
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM
    min_p: float | None = None  # vLLM
    min_tokens: int | None = None  # vLLM
    ignore_eos: bool | None = None  # vLLM
    stop_token_ids: list[int] | None = None  # vLLM
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    # typed, and ignored (IGNORED)
    user: Short | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    best_of: int | None = None  # refused unless 1 or n
    suffix: str | None = None  # refused unless empty


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

# OpenAI / vLLM fields that change the output and that mtp does not implement: field -> (its no-op
# values, how to write them). A request holding anything else there is refused (400 naming the field).
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "logit_bias": (({},), "{}"),
    "frequency_penalty": ((0,), "0"),
    "presence_penalty": ((0,), "0"),
    "repetition_penalty": ((1,), "1"),
    "min_p": ((0,), "0"),
    "min_tokens": ((0,), "0"),
    "ignore_eos": ((False,), "false"),
    "stop_token_ids": (([],), "[]"),
    "response_format": (({"type": "text"},), '{"type": "text"}'),
    "tools": (([],), "[]"),
    "tool_choice": (("none",), '"none"'),
    "functions": (([],), "[]"),
    "function_call": (("none",), '"none"'),
    "suffix": (("",), '""'),
    # vLLM's guided decoding and OpenAI's non-text outputs: only absent (null)
    "guided_json": ((), "null"),
    "guided_regex": ((), "null"),
    "guided_choice": ((), "null"),
    "guided_grammar": ((), "null"),
    "prediction": ((), "null"),
    "audio": ((), "null"),
    "modalities": ((["text"],), '["text"]'),
}
# accepted and ignored: they change nothing mtp computes (`parallel_tool_calls` only matters with tools)
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options (but include_usage)")


def check_supported(req: CommonRequest) -> None:
    """Refuse (APIError 400, naming the field) a request that sets a field of UNSUPPORTED to anything but
    its no-op value, or `best_of` other than 1 or n: mtp would silently answer something else. (The
    typed fields' types were checked by the schema, so `false` never passes for a 0.)"""
    fields = {**(req.model_extra or {}), **dict(req)}
    for name, (no_op, written) in UNSUPPORTED.items():
        value = fields.get(name)
        if value is not None and value not in no_op:
            raise APIError(
                400,
                f"{name} is not supported by this server (it would change the output); leave it out or send {written}",
                name,
                "unsupported_parameter",
            )
    best_of, n = fields.get("best_of"), fields.get("n") or 1
    if best_of is not None and best_of not in (1, n):
        raise APIError(
            400,
            f"best_of is not supported by this server (choices are not ranked); leave it out or send {n}",
            "best_of",
            "unsupported_parameter",
        )


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
        req = schema.model_validate(data)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValidationError as e:
        path, message = describe_error(e.errors(), data)
        raise APIError(400, f"{'.'.join(path)}: {message}" if path else message, path[0] if path else None) from None
    check_supported(req)
    return req


_EXPECTED = {  # pydantic's type errors -> what the field takes, in JSON's words
    "string_type": "a string",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "bool_type": "a boolean",
    "float_type": "a number",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def json_kind(value) -> str:
    """The JSON type of a value, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def describe_error(errors: list[dict], data) -> tuple[list[str], str]:
    """(the path in the body, a message) for a validation failure. Each error's location is read
    against the body itself, which drops the names pydantic gives a union's members (`logprobs.bool`,
    `prompt.list[str].0` -> `logprobs`, `prompt.0`); of the deepest such path, a constraint broken by a
    value of a right type is reported as it is, else "expected <the types the members take>, got <the
    JSON type given>" (`logprobs: "5"` -> "logprobs: expected a boolean or an integer, got a string")."""
    found = []
    for err in errors:
        node, path = data, []
        for i, part in enumerate(err["loc"]):
            if isinstance(node, dict) and (part in node or (err["type"] == "missing" and i == len(err["loc"]) - 1)):
                path.append(str(part))
                node = node.get(part)
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                path.append(str(part))
                node = node[part]
        found.append((path, node, err))
    depth = max(len(p) for p, _, _ in found)
    deepest = [(p, v, e) for p, v, e in found if len(p) == depth]
    path, value = deepest[0][0], deepest[0][1]
    path = [p[:40] for p in path]
    other = [e for _, _, e in deepest if e["type"] not in _EXPECTED]
    if other:
        e = other[0]
        return path, "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
    wanted = list(dict.fromkeys(_EXPECTED[e["type"]] for _, _, e in deepest))
    takes = wanted[0] if len(wanted) == 1 else ", ".join(wanted[:-1]) + " or " + wanted[-1]
    return path, f"expected {takes}, got {json_kind(value)}"
