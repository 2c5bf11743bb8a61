"""What `mtp bench` decodes: the prompts (`load_data`: a GSM8K file or a prompts JSONL) and the rows
(`parse_strategies`: the sweep list, each entry a `Spec`, with `ntp` first as the reference).
Both refuse bad input with a one-line ValueError before any model work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtp.core.decoding.proposers import check_proposer
from mtp.core.decoding.strategy import SWEEP_LIMIT, Strategy, expand_sweep, split_list
from mtp.eval import gsm8k


def load_data(spec: str, limit: int | None = None) -> tuple[str, list[dict]]:
    """`gsm8k:PATH` or `prompts:PATH` -> (kind, [{"prompt", "gold"?, "category"?}]) of the first `limit`
    items; a prompts line's optional 'category' is kept (results then break down by it)."""
    kind, sep, path = (spec or "").partition(":")
    if not sep or kind not in ("gsm8k", "prompts") or not path:
        raise ValueError(f"bad --data {spec!r}; expected gsm8k:PATH or prompts:PATH")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"data not found: {path}")
    items = gsm8k.load(p, limit) if kind == "gsm8k" else _prompts(p, limit)
    if not items:
        raise ValueError(f"no items in {path}")
    return kind, items


def _prompts(p: Path, limit: int | None) -> list[dict]:
    """The first `limit` items of a prompts JSONL: a 'prompt' string, or a 'turns' list whose first turn is
    the prompt (MT-Bench / Spec-Bench style); an optional 'category' is kept."""
    items = []
    for n, line in enumerate(gsm8k.read_lines(p), 1):
        row = gsm8k.parse_json_line(line, p, n)
        prompt = row.get("prompt")
        if prompt is None and isinstance(row.get("turns"), list) and row["turns"]:
            first = row["turns"][0]  # MT-Bench / Spec-Bench style: the first turn is the prompt
            prompt = first.get("content") if isinstance(first, dict) else first
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{p}:{n}: needs a non-empty 'prompt' string or a 'turns' list")
        items.append({"prompt": prompt, **({"category": str(row["category"])} if row.get("category") else {})})
        if limit is not None and len(items) >= limit:
            break
    return items


@dataclass(frozen=True)
class Spec:
    """An engine row: a strategy, with its own proposer when written `verify:4@mask-single`."""

    strategy: Strategy
    proposer: str | None = None  # None: the engine's --proposer

    def __str__(self) -> str:
        return str(self.strategy) + (f"@{self.proposer}" if self.proposer else "")


def parse_strategies(text: str) -> list[Spec]:
    """The sweep list with `ntp` first (always run: it is the reference), duplicates dropped."""
    out = [Spec(Strategy.parse("ntp"))]
    seen = set(out)
    pieces = split_list("ntp" if text is None else text)
    if not pieces:
        raise ValueError(f"--strategies {text!r} names no strategy; e.g. verify:4,conf_adapt:0.9")
    for piece in pieces:
        strategy, at, proposer = piece.partition("@")
        proposer = proposer.strip() or None
        if not strategy.strip() or (at and proposer is None):
            raise ValueError(
                f"--strategies: {piece!r} needs a strategy before '@' and a proposer after it, e.g. verify:4@heads"
            )
        if proposer is not None:
            check_proposer(proposer)
        for s in expand_sweep(strategy):
            spec = Spec(s, proposer)
            if spec not in seen:
                seen.add(spec)
                out.append(spec)
        if len(out) > SWEEP_LIMIT:
            raise ValueError(f"--strategies expands to more than {SWEEP_LIMIT} rows")
    return out
