"""What `mtp tune` is asked (`TuneConfig`), checked before the model loads: the tolerance and metric, the
sizes of each section's work, and the data (`tune_data`: a GSM8K folder read as its evaluation split, a
GSM8K training split refused)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtp.core.policy import deploy as D


@dataclass
class TuneConfig:
    data: str
    tolerance: float
    metric: str | None = None  # default: answer for gsm8k, rougeL for prompts
    latency_ms: float | None = None  # a target ms per token, reported against
    limit: int | None = 100
    max_new_tokens: int = 256
    probe: int = 8  # prompts a decoded candidate decodes (batched)
    calibrate: int = 48  # prompts a decoded calibration run decodes (each held out once, two folds)
    measure: int = 8  # prompts the finalists decode one at a time
    measure_rows: int = 3  # finalists besides ntp
    measure_all: bool = False  # measure every qualifying candidate (a full sweep, for checking the choice)
    batch: int = 32
    candidates: str | None = None
    profile_repeats: int = 3

    def __post_init__(self):
        D.check_tolerance(self.tolerance)
        if self.metric is not None:
            D.check_metric(self.metric)
        for name in (
            "limit",
            "max_new_tokens",
            "probe",
            "calibrate",
            "measure",
            "measure_rows",
            "batch",
            "profile_repeats",
        ):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.latency_ms is not None and not self.latency_ms > 0:
            raise ValueError(f"--latency-ms must be > 0, got {self.latency_ms}")
        self.data = tune_data(self.data, self.limit)


GSM8K_TEST = "GSM8K test"  # the evaluation guard's name of the GSM8K test questions (`eval_guard`)


def tune_data(spec, limit: int | None) -> str:
    """--data as tune reads it, checked before the model loads. `gsm8k:DIR` becomes `gsm8k:DIR/test.jsonl`
    (the evaluation split, never train.jsonl; a folder without it is one line: `gsm8k.resolve`), so the
    log, results and deploy.json name the file read. A GSM8K training split is refused: a file named
    train* none of whose (first `limit`) questions is a GSM8K test question (the evaluation guard's hashes).
    mtp's proposers (mask adapter, heads, EAGLE-3 drafter, suffix datastore) learn from GSM8K train,
    so their acceptance there, hence the speed tune measures and the configuration it picks, would be
    that of prompts they were trained on, not of the traffic the deploy file serves. Other specs are
    returned as given (`load_data` checks them)."""
    kind, sep, path = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind != "gsm8k" or not sep or not path or not Path(path).expanduser().exists():
        return spec
    from mtp.eval import gsm8k
    from mtp.training.eval_guard import evaluation_set

    file = gsm8k.resolve(Path(path).expanduser())
    name, target = file.name, file.resolve().name  # a link's own name and its target's
    if file.is_file() and any(n.lower().startswith("train") for n in (name, target)):
        items = gsm8k.load(file, limit)
        if items and not any(evaluation_set(it["question"]) == GSM8K_TEST for it in items):
            shown = name if name == target else f"{name} -> {target}"
            raise ValueError(
                f"--data gsm8k:{file} is a training split (named {shown}, no GSM8K test question in "
                "it): mtp's proposers learn from GSM8K train, so tuning on it overstates their "
                f"acceptance and speed; tune on the evaluation split (gsm8k:DIR/{gsm8k.EVAL_SPLIT}) "
                "or held-out prompts:FILE of your own"
            )
    return f"gsm8k:{file}" if file != Path(path) else spec
