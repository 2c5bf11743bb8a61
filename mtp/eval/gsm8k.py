"""GSM8K: the zero-shot chat prompt, and final-answer extraction and normalisation.

Gold answers end in `#### N`; model answers are read, in order of trust, from `#### N`, then
"the answer is N", then the last number in the text. Numbers are compared after normalising:
commas, `$` and spaces stripped, a trailing `.0`/`.00` dropped, a final `.` removed
("1,200.00" == "$1200" == "1200.").
"""

from __future__ import annotations

import json
from pathlib import Path

from mtp.core.policy.quality import HASHES, normalize

PROMPT = "{question}\nSolve the problem step by step, then finish with: The answer is N."


def gold_answer(answer_field: str) -> str | None:
    """The normalised number after `####` in a GSM8K `answer` field."""
    hits = HASHES.findall(answer_field)
    return normalize(hits[-1]) if hits else None


EVAL_SPLIT = "test.jsonl"  # what a GSM8K folder is read for: its evaluation split, never train.jsonl


def resolve(path: str | Path) -> Path:
    """The file `gsm8k:PATH` reads: PATH itself, or a folder's evaluation split (`EVAL_SPLIT`); a folder
    without one is a one-line error (its train.jsonl is never read in its place)."""
    path = Path(path)
    if path.is_dir():
        if not (path / EVAL_SPLIT).is_file():
            raise ValueError(
                f"gsm8k:{path} is a folder without {EVAL_SPLIT}: a GSM8K folder is read for its "
                f"evaluation split ({EVAL_SPLIT}), never its training split; give gsm8k:FILE"
            )
        return path / EVAL_SPLIT
    return path


def load(path: str | Path, limit: int | None = None) -> list[dict]:
    """GSM8K JSONL -> [{"prompt", "gold", "question"}]; a directory means its test.jsonl (`resolve`)."""
    path = resolve(path)
    items = []
    for n, line in enumerate(read_lines(path), 1):
        row = parse_json_line(line, path, n)
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{path}:{n}: a GSM8K line needs 'question' and 'answer' fields")
        items.append(
            {
                "prompt": PROMPT.format(question=row["question"].strip()),
                "question": row["question"],
                "gold": gold_answer(row["answer"]),
            }
        )
        if limit is not None and len(items) >= limit:
            break
    return items


def parse_json_line(line: str, path, n: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        raise ValueError(f"{path}:{n}: not a JSON line") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{n}: expected a JSON object")
    return row


def read_lines(path: Path):
    """Non-empty lines of a text file; an unreadable file is a one-line ValueError."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield line
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
