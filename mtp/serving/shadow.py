"""Shadow mode: test an MTP strategy on live traffic against plain decoding before switching over.

`mtp serve --shadow-rate R` decodes a fraction R of the requests that used an MTP strategy a second
time with `ntp`, in the background after the answer was sent, and appends one JSON line per request
to the shadow log:

- exact_match: the MTP output's token ids equal the ntp output's;
- first_divergence: index of the first differing token (the shorter length when one output is a
  prefix of the other; null when identical);
- answer / shadow_answer / answer_agree: GSM8K-style final answers (`mtp.core.policy.quality.extract_answer`) and
  whether they agree (null when neither text has a number);
- latency_s / shadow_latency_s / latency_ratio: decoding time (admission to last token, queueing
  excluded) of the MTP request and of its ntp shadow, and their ratio (< 1: MTP was faster).

`mtp shadow-report LOG` summarises a log per strategy.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

from mtp.core.decoding.metrics import percentile
from mtp.core.policy.quality import extract_answer


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ; None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(ids: list[int], text: str, shadow_ids: list[int], shadow_text: str) -> dict:
    """Divergence of one MTP output from its ntp shadow."""
    answer, shadow_answer = extract_answer(text), extract_answer(shadow_text)
    agree = None if answer is None and shadow_answer is None else answer == shadow_answer
    div = first_divergence(ids, shadow_ids)
    return {
        "exact_match": div is None,
        "first_divergence": div,
        "answer": answer,
        "shadow_answer": shadow_answer,
        "answer_agree": agree,
    }


def check_log_path(path: str | Path) -> Path:
    """A file path the shadow log can append to (its folder is created), else a one-line error."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--shadow-log {path} is a directory; give a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ValueError(f"--shadow-log {path}: cannot append to it ({e.strerror or e})") from None
    return path


class ShadowLog:
    """Appends records as JSON lines; safe to call from several threads."""

    def __init__(self, path: str | Path):
        self.path = check_log_path(path)
        self.lock = threading.Lock()

    def write(self, record: dict) -> None:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **record}
        line = json.dumps(record)
        with self.lock, open(self.path, "a") as f:
            f.write(line + "\n")


def read_log(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"shadow log not found: {path}")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n}: not a JSON line") from None
        if not isinstance(row, dict) or "exact_match" not in row:
            raise ValueError(f"{path}:{n}: not a shadow record (no 'exact_match')")
        records.append(row)
    return records


def summarize(records: list[dict]) -> dict:
    """Per strategy and overall: counts, exact-match rate, divergence index, answer agreement, latency."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r.get("strategy", "?"), []).append(r)
    if len(groups) > 1:
        groups["all"] = list(records)
    out = {}
    for name, rows in groups.items():
        divs = [r["first_divergence"] for r in rows if r.get("first_divergence") is not None]
        agree = [r["answer_agree"] for r in rows if r.get("answer_agree") is not None]
        ratios = [r["latency_ratio"] for r in rows if r.get("latency_ratio")]
        tpf = [r["tokens_per_forward"] for r in rows if r.get("tokens_per_forward")]
        out[name] = {
            "requests": len(rows),
            "exact_match_rate": sum(bool(r["exact_match"]) for r in rows) / len(rows),
            "first_divergence_median": statistics.median(divs) if divs else None,
            "answer_compared": len(agree),
            "answer_agreement_rate": sum(agree) / len(agree) if agree else None,
            "latency_ratio_p50": percentile(ratios, 50),
            "latency_ratio_p95": percentile(ratios, 95),
            "tokens_per_forward_mean": sum(tpf) / len(tpf) if tpf else None,
        }
    return out


def format_summary(summary: dict) -> str:
    def f(v, pct=False):
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if pct else f"{v:.2f}" if isinstance(v, float) else str(v)

    head = (
        f"{'strategy':<22} {'n':>5} {'exact':>7} {'1st div':>8} {'answers agree':>14} "
        f"{'latency ratio p50/p95':>22} {'tok/fwd':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        agree = f"{f(s['answer_agreement_rate'], True)} ({s['answer_compared']})"
        lat = f"{f(s['latency_ratio_p50'])} / {f(s['latency_ratio_p95'])}"
        lines.append(
            f"{name:<22} {s['requests']:>5} {f(s['exact_match_rate'], True):>7} "
            f"{f(s['first_divergence_median']):>8} {agree:>14} {lat:>22} "
            f"{f(s['tokens_per_forward_mean']):>8}"
        )
    return "\n".join(lines)
