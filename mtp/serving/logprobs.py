"""OpenAI's log-probability shapes, built from the records of `mtp.core.decoding.decode` (`TokenLogprob`).

- chat: `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
  bytes}]}]}`;
- completions: `choices[].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}],
  text_offset}`, the echoed prompt first (its first token's log-probability and alternatives null).
A token's text is its own decoding (special tokens included), its `bytes` that text's UTF-8 bytes;
`text_offset` is where the token starts in the choice's text (the echoed prompt included). JSON has no
infinity: a log-probability of -inf is sent as FLOOR, as vLLM does.
"""

from __future__ import annotations

from typing import Callable

from mtp.core.decoding.decode import TokenLogprob

FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, FLOOR)


class Pieces:
    """Each token's own text (cached: the vocabulary is fixed)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            text = self.cache[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


def chat_content(records: list[TokenLogprob], piece: Callable[[int], str]) -> list[dict]:
    def entry(token: int, logprob: float) -> dict:
        text = piece(token)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    return [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, v) for t, v in r.top]} for r in records]


def text_offsets(ids: list[int], decode: Callable[[list[int]], str], start: int = 0) -> list[int]:
    """Where each token's text starts in decode(ids), plus `start`: the sum of the tokens' own texts
    where those add up to the whole, else each prefix decoded (a character split over tokens)."""
    pieces = [decode([t]) for t in ids]
    if "".join(pieces) == decode(ids):
        out, at = [], start
        for p in pieces:
            out.append(at)
            at += len(p)
        return out
    return [start + len(decode(ids[:i])) for i in range(len(ids))]


def completion_logprobs(
    tokens: list[int],
    records: list[TokenLogprob | None],
    offsets: list[int],
    piece: Callable[[int], str],
) -> dict:
    """The completions shape for `tokens` (a None record: a token without one, the prompt's first)."""
    return {
        "tokens": [piece(t) for t in tokens],
        "token_logprobs": [None if r is None else _lp(r.logprob) for r in records],
        "top_logprobs": [None if r is None else {piece(t): _lp(v) for t, v in r.top} for r in records],
        "text_offset": offsets,
    }
