"""The evaluation prompts this project knows, as hashes: no training file may contain one.

A file's name can lie (a link `train.jsonl -> gsm8k/test.jsonl`, `my-eval-copy.jsonl`), its content
cannot: every training prompt reader (`data.load_prompts`, `mtp data`'s sources) hashes each prompt
(lower-cased words, so spacing and case do not matter) and refuses the file when one matches a prompt
of the GSM8K test split, BIG-Bench Hard or the diverse held-out benchmark set
(`mtp/assets/eval_prompts.json`, made by `scripts/eval_prompt_hashes.py`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

HASHES = Path(__file__).resolve().parent.parent / "assets" / "eval_prompts.json"


def normalise(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def prompt_hash(text: str) -> str:
    return hashlib.sha256(normalise(text).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def known() -> dict[str, str]:
    """{hash: the evaluation set it belongs to}."""
    if not HASHES.exists():
        return {}
    return {h: name for name, hs in json.loads(HASHES.read_text())["sets"].items() for h in hs}


def check_not_evaluation(texts, source) -> None:
    """Raise a one-line ValueError when any of `texts` is a known evaluation prompt."""
    sets = known()
    for n, text in enumerate(texts, 1):
        name = sets.get(prompt_hash(text))
        if name is not None and normalise(text):
            raise ValueError(f"{Path(str(source)).name}: prompt {n} is a prompt of the {name} evaluation set; "
                             f"evaluation prompts are never trained on")
