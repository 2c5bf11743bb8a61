"""Quality loss of an output against its reference (the `ntp` output of the same prompt), per item,
for a tolerance to be stated in: `mtp tune --metric`, `mtp serve --deploy`'s rollout window.

- exact:  1 if the token ids differ, else 0 (1 - exact match);
- answer: 1 if the GSM8K-style final answers differ, else 0 (1 - answer agreement; two outputs
          without a readable answer agree, the rule `mtp bench` uses; `extract_answer` reads them);
- rougeL: 1 - ROUGE-L F1 of the text against the reference text (`mtp.core.decoding.metrics.rouge_l`); 0 for
          identical texts (ROUGE scores 0 for texts it cannot tokenise, e.g. empty or non-Latin ones).

The loss of a set of outputs is the mean over items, so a tolerance of 0.02 means "at most 2 % of
answers change" (answer, exact) or "ROUGE-L at least 0.98 on average" (rougeL).
"""

from __future__ import annotations

import re

from mtp.core.decoding import metrics
from mtp.core.policy.deploy import METRICS, check_metric

__all__ = ["METRICS", "extract_answer", "item_loss", "mean_loss", "normalize"]

_NUMBER = r"-?[$]?\s?\d[\d,]*(?:\.\d+)?"
HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_THE_ANSWER = re.compile(r"answer\s*(?:is|:)\s*[:=]?\s*\**\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY = re.compile(_NUMBER)


def normalize(text: str | None) -> str | None:
    """'$1,200.00' -> '1200'; '-3.50' -> '-3.5'; None or no digits -> None."""
    if text is None:
        return None
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", s):
        return None
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    if s in ("-0", ""):
        s = "0"
    return s


def extract_answer(text: str) -> str | None:
    """The final answer of a solution text, normalised (None when it has no number)."""
    for pattern in (HASHES, _THE_ANSWER):
        hits = pattern.findall(text)
        if hits:
            return normalize(hits[-1])
    hits = _ANY.findall(text)
    return normalize(hits[-1]) if hits else None


def item_loss(metric: str, ids: list[int], text: str, ref_ids: list[int], ref_text: str) -> float:
    check_metric(metric)
    if metric == "exact":
        return 0.0 if list(ids) == list(ref_ids) else 1.0
    if metric == "answer":
        return 0.0 if (extract_answer(text) or "") == (extract_answer(ref_text) or "") else 1.0
    if text == ref_text:  # identical: no loss, also for texts ROUGE cannot tokenise (empty, non-Latin scripts)
        return 0.0
    return 1.0 - metrics.rouge_l([text], [ref_text])


def mean_loss(metric: str, outputs: list[tuple[list[int], str]], refs: list[tuple[list[int], str]]) -> float | None:
    """Mean item loss of outputs [(ids, text)] against refs [(ids, text)]; None if there are none."""
    if len(outputs) != len(refs):
        raise ValueError(f"mean_loss: {len(outputs)} outputs against {len(refs)} references")
    if not outputs:
        return None
    return sum(item_loss(metric, i, t, ri, rt) for (i, t), (ri, rt) in zip(outputs, refs)) / len(outputs)
