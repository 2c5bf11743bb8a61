"""Where `mtp data`'s prompts come from (`file_prompts`): GSM8K training questions, self-instruct tasks
(every instance a prompt), any JSONL of prompts; each keyed by its content (`content_id`), so an
identical prompt is answered once and a resume finds it wherever it moved. What `mtp data` is asked
(`DataConfig`) and which prompts are held out (`is_heldout`: a stable hash of the task or text puts
`--heldout-fraction` of every non-GSM8K source in OUT/heldout/, written by `write_heldout`, never trained on).
"""

from __future__ import annotations

import collections
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from mtp.core.runtime.checks import check_batch_size
from mtp.training.data import load_prompts
from mtp.training.eval_guard import check_not_evaluation

HELDOUT = "heldout"
SELF_INSTRUCT_FILES = ("seed_tasks.jsonl", "user_oriented_instructions.jsonl")


@dataclass
class DataConfig:
    out: str
    gsm8k: str | None = None
    self_instruct: str | None = None
    prompts: str | None = None
    self_written: int = 0
    max_new_tokens: int = 256
    max_prompt_tokens: int = 768
    heldout_fraction: float = 0.2
    batch_size: int = 32
    seed: int = 0
    limit: int | None = None  # at most this many prompts per file source (smoke runs)

    def __post_init__(self):
        if not (self.gsm8k or self.self_instruct or self.prompts or self.self_written):
            raise ValueError("no source: give --gsm8k, --self-instruct, --prompts and/or --self-written N")
        if self.self_written and not self.self_instruct:
            raise ValueError("--self-written needs --self-instruct (its tasks are the examples the model imitates)")
        if self.self_written < 0 or self.max_new_tokens < 1 or self.max_prompt_tokens < 1:
            raise ValueError("--self-written must be >= 0; --max-new-tokens, --max-prompt-tokens >= 1")
        check_batch_size(self.batch_size, "--batch-size")  # the cache's rows are zero-filled up front
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"--heldout-fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")


@dataclass
class Prompt:
    id: str
    source: str  # gsm8k | self_instruct | self_written | prompts
    text: str
    category: str = ""
    group: str = ""  # what the held-out split hashes (a task: all its instances on one side)
    meta: dict = field(default_factory=dict)


def stable_fraction(key: str, seed: int) -> float:
    """A number in [0, 1) fixed by (key, seed): the split and the work order never depend on runs."""
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def is_heldout(p: Prompt, cfg: DataConfig) -> bool:
    return p.source != "gsm8k" and stable_fraction("heldout:" + (p.group or p.text), cfg.seed) < cfg.heldout_fraction


def read_self_instruct(path) -> list[Prompt]:
    """Prompts from self-instruct task files (a folder holding them, or one file)."""
    path = Path(path)
    files = [path / f for f in SELF_INSTRUCT_FILES if (path / f).exists()] if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"--self-instruct {path}: no task files ({', '.join(SELF_INSTRUCT_FILES)})")
    out = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
                instruction, instances = task["instruction"].strip(), task.get("instances") or [{}]
                tid = str(task.get("id", f"{f.stem}-{n}"))
            except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
                raise ValueError(f"{f.name} line {n}: not a self-instruct task (instruction, instances)") from None
            category = str(task.get("motivation_app") or task.get("name") or "")
            for inst in instances:
                given = (inst.get("input") or "").strip() if isinstance(inst, dict) else ""
                text = instruction + (f"\n\n{given}" if given else "")
                out.append(
                    Prompt(
                        content_id(f"si-{tid}", text),
                        "self_instruct",
                        text,
                        category,
                        group=tid,
                        meta={"instruction": instruction},
                    )
                )
    if not out:
        raise ValueError(f"--self-instruct {path}: no tasks")
    return out


def content_id(prefix: str, text: str) -> str:
    """A prompt's key in the output log: its source and a hash of its text, so a resume finds it
    wherever it moved in its file (and a different file of the same name is not mistaken for it)."""
    return f"{prefix}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _unique(prompts: list[Prompt]) -> list[Prompt]:
    seen: set[str] = set()
    return [p for p in prompts if not (p.id in seen or seen.add(p.id))]


def file_prompts(cfg: DataConfig) -> list[Prompt]:
    """Every prompt of the file sources, keyed by content (an identical prompt twice is answered once);
    none that is trained on (held-out ones are not) is an evaluation prompt (`eval_guard`)."""
    out: list[Prompt] = []
    if cfg.gsm8k:
        rows = load_prompts(cfg.gsm8k, "question", None, cfg.limit, hint='GSM8K lines need "question"')
        out += [Prompt(content_id("gsm8k", r["prompt"]), "gsm8k", r["prompt"], "math word problems") for r in rows]
    if cfg.self_instruct:
        tasks = read_self_instruct(cfg.self_instruct)[: cfg.limit]
        trained = [p for p in tasks if not is_heldout(p, cfg)]
        check_not_evaluation([p.text for p in trained], cfg.self_instruct, [f"task {p.group}" for p in trained])
        out += tasks
    if cfg.prompts:
        rows = load_prompts(cfg.prompts, "prompt", None, cfg.limit, hint='--prompts lines need "prompt"')
        out += [Prompt(content_id("p", r["prompt"]), "prompts", r["prompt"]) for r in rows]
    return _unique(out)


def write_heldout(out: Path, prompts: list[Prompt]) -> dict[str, int]:
    """Held-out prompts per source as JSONL for `mtp bench --data prompts:FILE`; returns counts."""
    by_source: dict[str, list[Prompt]] = collections.defaultdict(list)
    for p in prompts:
        by_source[p.source].append(p)
    (out / HELDOUT).mkdir(parents=True, exist_ok=True)
    for source, rows in by_source.items():
        tmp = out / HELDOUT / f".{source}.jsonl.tmp"
        tmp.write_text(
            "".join(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n" for p in rows),
            encoding="utf-8",
        )
        tmp.replace(out / HELDOUT / f"{source}.jsonl")
    return {s: len(r) for s, r in by_source.items()}
