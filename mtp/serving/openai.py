"""The OpenAI request schema `mtp serve` honours, and the errors it answers with.

Unknown fields are ignored, known ones type-checked (strict: `"temperature": "hot"` is a 400, not a
coercion). Every bad input becomes an `APIError`: HTTP 4xx with an OpenAI-style
`{"error": {"message", "type", "param", "code"}}` body and a plain one-line message.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


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
