"""Quality loss of an output against its reference (the `ntp` output of the same prompt), per item,
for a tolerance to be stated in: `mtp tune --metric`, `mtp serve --deploy`'s rollout window.

- exact:  1 if the token ids differ, else 0 (1 - exact match);
- answer: 1 if the GSM8K-style final answers differ, else 0 (1 - answer agreement; two outputs
          without a readable answer agree, the rule `mtp bench` uses);
- rougeL: 1 - ROUGE-L F1 of the text against the reference text (`mtp.core.metrics.rouge_l`); 0 for
          identical texts (ROUGE scores 0 for texts it cannot tokenise, e.g. empty or non-Latin ones).

The loss of a set of outputs is the mean over items, so a tolerance of 0.02 means "at most 2 % of
answers change" (answer, exact) or "ROUGE-L at least 0.98 on average" (rougeL).
"""
from __future__ import annotations

from mtp.core import metrics
from mtp.core.deploy import METRICS, check_metric
from mtp.eval.gsm8k import extract_answer

__all__ = ["METRICS", "item_loss", "mean_loss"]


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
