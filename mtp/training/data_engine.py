"""The data engine (`mtp data`): the model's own answers to many, varied prompts, for both trainers.

Sources (each optional):
- GSM8K training prompts (`--gsm8k FILE`; a test split is refused);
- self-instruct tasks (`--self-instruct DIR|FILE`): every instance becomes a prompt (the instruction,
  then its input);
- prompts the model writes itself (`--self-written N`): N sampled continuations of a numbered list
  of three tasks (drawn from the training split of the self-instruct tasks) with a fourth; each
  is cleaned and deduplicated (against each other and the human tasks: word-set Jaccard >= 0.7);
- any JSONL of prompts (`--prompts FILE`, field `prompt`).
Every non-GSM8K source is split: a stable hash of the task (self-instruct) or of the text (others)
puts `--heldout-fraction` of it in `OUT/heldout/<source>.jsonl` (prompts only, for `mtp bench
--data prompts:...`), which no training run reads (`mtp train` refuses held-out paths by name).

Answers are greedy `ntp`, `--max-new-tokens` at most, through the one batching loop
(`mtp.training.data.generate`: full batches, finished rows refilled at once), appended to
`OUT/train.jsonl` as `{"id", "source", "category", "prompt_ids", "response_ids", "finish"}` (the
format `mtp train --examples` reads) and flushed line by line. A killed run resumes where it stopped
with nothing duplicated or lost: lines are keyed by prompt id; a torn last line is cut, a corrupt
line skipped and counted; the work order is a pure function of the settings (`OUT/manifest.json`,
which a resume must match). `OUT/card.json` / `card.md` describe the result (answers and tokens per
source, the length histogram, how many answers the length limit cut).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from mtp.core.decoding.sampling import SamplingParams
from mtp.core.runtime.artifacts import ArtifactError, base_hash
from mtp.core.runtime.checks import check_batch_size
from mtp.training import shards
from mtp.training.data import Job, generate, load_prompts, response_of
from mtp.training.eval_guard import check_not_evaluation

TRAIN = "train.jsonl"  # working files (append-only; sealed into shards when a run stops: `shards.seal`)
INSTRUCTIONS = "instructions.jsonl"
MANIFEST = shards.MANIFEST
LOCK = ".lock"
HELDOUT = "heldout"
SELF_INSTRUCT_FILES = ("seed_tasks.jsonl", "user_oriented_instructions.jsonl")
FEW_SHOT = "Tasks that users give an AI assistant:\n1. {0}\n2. {1}\n3. {2}\n4."  # continued as plain text
DUPLICATE_JACCARD = 0.7


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
            for i, inst in enumerate(instances):
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


def normalise(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def clean_instruction(text: str) -> str | None:
    """The task the model wrote as item 4 of FEW_SHOT (its first line), or None when unusable."""
    line = text.strip().split("\n", 1)[0].strip() if text.strip() else ""
    line = re.sub(r"^\s*(\d+[.)]|[-*])\s*", "", line)
    words = line.split()
    if not 4 <= len(words) <= 60 or line.endswith(":"):
        return None
    return line


class Deduplicator:
    """Near-duplicate test over word sets: `seen(t)` is True when t's normalised text was added, or
    when its word set has Jaccard >= DUPLICATE_JACCARD with an added one (the same float comparison
    for every pair as a scan over all of them would make).

    An added set is indexed by the first words of its prefix in one fixed order of words (rarest in
    `texts` and `vocabulary` first; `vocabulary` is only counted for that order). Two sets of
    Jaccard >= t share at least ceil(t * max(|A|, |B|)) words, so they share a word among the first
    |A| - ceil(t |A|) + 1 of A and the first |B| - ceil(t |B|) + 1 of B (prefix filtering): only the
    sets met there are compared. A resume replays ~10^4 written tasks in seconds, where the scan
    over every pair took minutes."""

    def __init__(self, texts=(), vocabulary=()):
        texts = list(texts)
        self.exact: set[str] = set()
        self.sets: list[frozenset] = []
        self._index: dict[str, list[int]] = collections.defaultdict(list)
        self._empty = False  # an added text with no words (only an empty set is its near-duplicate)
        freq = collections.Counter(w for t in (*texts, *vocabulary) for w in set(normalise(t).split()))
        self._rank = lambda w: (freq.get(w, 0), w)  # fixed for the index's life: new words rank rarest
        for t in texts:
            self.add(t)

    def _prefix(self, words: frozenset) -> list[str]:
        # o >= fl(t * |A u B|) >= fl(t * |A|) (rounding is monotone), so o >= ceil(fl(t * |A|))
        need = math.ceil(DUPLICATE_JACCARD * len(words))
        return sorted(words, key=self._rank)[: len(words) - need + 1]

    def seen(self, text: str) -> bool:
        norm = normalise(text)
        if norm in self.exact:
            return True
        words = frozenset(norm.split())
        if not words:
            return self._empty
        n, t = len(words), DUPLICATE_JACCARD
        candidates = {i for w in self._prefix(words) for i in self._index.get(w, ())}
        # o <= min(|A|, |B|) and fl(t * |A u B|) >= fl(t * max(|A|, |B|)): a size outside that skips the pair
        return any(
            n >= t * len(s) and len(s) >= t * n and len(words & s) >= t * len(words | s)
            for s in (self.sets[i] for i in sorted(candidates))
        )

    def add(self, text: str) -> None:
        norm = normalise(text)
        self.exact.add(norm)
        words = frozenset(norm.split())
        self.sets.append(words)
        if not words:
            self._empty = True
        for w in self._prefix(words):
            self._index[w].append(len(self.sets) - 1)


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


def manifest(cfg: DataConfig, engine) -> dict:
    # --self-written N is not a setting of the run but how far to take it: request j is fixed by
    # (seed, j), so a larger N later continues the same run
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("out", "batch_size", "self_written")}
    for k in ("gsm8k", "self_instruct", "prompts"):
        keep[k] = Path(keep[k]).name if keep[k] else None
    return {"format": "mtp-data", "version": 2, "base_hash": base_hash(engine.model), **keep}


def interleave(answers: list, writes: list) -> collections.deque:
    """One queue: the model's own requests spread evenly among the answers, in proportion (a partial
    run is a fair mix, and GSM8K does not crowd out the self-written requests early on)."""
    queue: collections.deque = collections.deque()
    w = 0
    for i, job in enumerate(answers):
        due = min(len(writes), i * len(writes) // max(1, len(answers)) + 1) if writes else 0
        queue.extend(writes[w:due])
        w = max(w, due)
        queue.append(job)
    queue.extend(writes[w:])
    return queue


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


@contextlib.contextmanager
def locked(out: Path):
    """Hold OUT/.lock for the duration: a second run (or seal) on the same folder is refused in one line."""
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ArtifactError(
                f"{out}: another `mtp data` run holds it (pid {other}); wait for it or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def check_folder(out: Path) -> dict | None:
    """The manifest of `--out` if it is an mtp data set, None if it is new or empty; refuses (without
    changing anything, and without a model) a file, anyone else's manifest.json, or a non-empty folder
    mtp did not write."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a directory")
    if (out / MANIFEST).exists():
        return shards.read_manifest(out)  # "not an mtp data set" for anyone else's manifest.json
    if out.exists() and any(p.name != LOCK for p in out.iterdir()):
        raise ArtifactError(f"{out} is not empty and not an mtp data set (no {MANIFEST}); choose another --out")
    return None


def open_folder(out: Path, want: dict | None) -> dict:
    """The folder's manifest (created from `want` for a new folder); refuses a folder mtp did not
    write (`check_folder`), or one made with other settings."""
    have = check_folder(out)
    if have is not None:
        if want is not None:
            diff = [k for k in want if k != "version" and have.get(k) != want[k]]
            if diff:
                raise ValueError(
                    f"{out} holds a data set made with other settings ({diff[0]}: "
                    f"{have.get(diff[0])!r}, now {want[diff[0]]!r}); choose another --out"
                )
        return have
    if want is None:
        raise ArtifactError(f"{out} is not an mtp data set (no {MANIFEST})")
    out.mkdir(parents=True, exist_ok=True)
    have = {**want, "shards": []}
    shards.write_manifest(out, have)
    return have


def seal(out, log=None) -> list[dict]:
    """Seal the working files of OUT into new shards (`shards.seal`), under the folder's lock."""
    out = Path(out)
    open_folder(out, None)
    with locked(out):
        added = shards.seal(out)
    for e in added:
        (log or (lambda m: print(m, file=sys.stderr, flush=True)))(
            f"data: sealed {e['lines']:,} lines into {out / e['file']}"
        )
    return added


def run(engine, cfg: DataConfig, progress: bool | None = None, log=None) -> dict:
    """Generate (or resume) the data set in cfg.out; seal what was made into new shards when it
    stops (done, Ctrl-C or SIGTERM); return its card."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(cfg.out)
    open_folder(out, manifest(cfg, engine))
    skipped: collections.Counter = collections.Counter()  # prompts over --max-prompt-tokens, per source
    with locked(out):
        try:
            _run(engine, cfg, out, progress, log, skipped)
        finally:
            for e in shards.seal(out):
                log(f"data: sealed {e['lines']:,} lines into {out / e['file']}")
            card = write_card(out, cfg, skipped)  # once, also after Ctrl-C or a failure
    return card


def _run(engine, cfg: DataConfig, out: Path, progress, log, skipped: collections.Counter) -> None:
    prompts = file_prompts(cfg)
    train = [p for p in prompts if not is_heldout(p, cfg)]
    heldout = [p for p in prompts if is_heldout(p, cfg)]
    done, bad = shards.read(out, "train")
    written, bad_w = shards.read(out, "instructions")
    if bad or bad_w:
        log(f"data: skipped {bad + bad_w} corrupt line(s)")

    # self-written prompts: replay the instruction log in file order (what was kept, and where)
    human = [p.meta["instruction"] for p in prompts if p.source == "self_instruct"]
    examples = sorted({p.meta["instruction"] for p in train if p.source == "self_instruct"})
    if cfg.self_written and len(examples) < 3:
        raise ValueError(
            f"--self-written needs at least 3 self-instruct training tasks to imitate, found "
            f"{len(examples)} (raise --limit or lower --heldout-fraction)"
        )
    log(f"data: replaying {len(written):,} self-written requests on disk") if written else None
    dedup = Deduplicator(human, vocabulary=[rec.get("text", "") for rec in written.values()])
    written_kept: list[Prompt] = []

    def judge(key: str, text: str) -> Prompt | None:
        task = clean_instruction(text)
        if task is None or dedup.seen(task):
            return None
        dedup.add(task)
        return Prompt(key, "self_written", task, "self-written", group=normalise(task))

    for key, rec in written.items():
        p = judge(key, rec.get("text", ""))
        if p is not None:
            written_kept.append(p)
    heldout += [p for p in written_kept if is_heldout(p, cfg)]

    chat = lambda text: engine.encode(text, chat=True)  # noqa: E731
    greedy = SamplingParams(max_new_tokens=cfg.max_new_tokens)

    def answer_job(p: Prompt) -> Job | None:
        ids = chat(p.text)
        if len(ids) > cfg.max_prompt_tokens:
            skipped[p.source] += 1
            return None
        return Job(p.id, ids, greedy, {"source": p.source, "category": p.category})

    answers = [answer_job(p) for p in train + [p for p in written_kept if not is_heldout(p, cfg)] if p.id not in done]
    answers = sorted((j for j in answers if j is not None), key=lambda j: stable_fraction("order:" + j.key, cfg.seed))
    writes = []
    if examples and cfg.self_written:
        for j in range(cfg.self_written):
            key = f"sw-{j}"
            if key in written:
                continue
            rng = random.Random(cfg.seed * 1_000_003 + j)
            ids = engine.encode(FEW_SHOT.format(*rng.sample(examples, 3)), chat=False)
            writes.append(
                Job(
                    key,
                    ids,
                    SamplingParams(
                        temperature=0.9, top_p=0.95, seed=cfg.seed * 7919 + j, max_new_tokens=64, stop=["\n"]
                    ),
                    {"kind": "instruction"},
                )
            )
    queue = interleave(answers, writes)
    # a row holds an answer (prompt <= --max-prompt-tokens) or a written request (few-shot prompt + 64 tokens)
    longest_write = max((len(j.prompt_ids) + j.params.max_new_tokens for j in writes), default=0)
    capacity = max(cfg.max_prompt_tokens + cfg.max_new_tokens, longest_write) + 1
    write_heldout(out, heldout)
    total = len(done) + len(answers)
    log(
        f"data: {len(done)} answers on disk, {len(answers)} to generate, {len(writes)} prompts for the model "
        f"to write; held out: {len(heldout)} prompts -> {out / HELDOUT}"
    )
    if not queue:
        return
    kept = {"requests": 0, "kept": 0}

    tokens = {"n": 0}
    t0 = time.perf_counter()
    bar = None
    if progress if progress is not None else sys.stderr.isatty():
        bar = Progress(
            TextColumn("data"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} answers"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
        )
        task = bar.add_task("data", total=total, completed=len(done), info="")
        bar.start()
    last_log = [time.perf_counter()]
    with (
        open(out / TRAIN, "a", encoding="utf-8") as f_train,
        open(out / INSTRUCTIONS, "a", encoding="utf-8") as f_written,
        open(out / HELDOUT / "self_written.jsonl", "a", encoding="utf-8") as f_held,
    ):

        def finish(job: Job, seq) -> None:
            if job.meta.get("kind") == "instruction":
                text = engine.decode_text(seq.output)
                f_written.write(
                    json.dumps(
                        {"id": job.key, "prompt_ids": job.prompt_ids, "response_ids": list(seq.output), "text": text}
                    )
                    + "\n"
                )
                f_written.flush()
                p = judge(job.key, text)
                kept["requests"] += 1
                if p is None:
                    return
                kept["kept"] += 1
                if is_heldout(p, cfg):
                    f_held.write(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n")
                    f_held.flush()
                    return
                nxt = answer_job(p)
                if nxt is not None:
                    queue.appendleft(nxt)  # answered as soon as a row frees up, not after everything else
                    if bar is not None:
                        bar.update(task, total=bar.tasks[0].total + 1)
                return
            rec = {
                "id": job.key,
                **job.meta,
                "prompt_ids": job.prompt_ids,
                "response_ids": response_of(engine, seq),
                "finish": seq.finish_reason,
            }
            f_train.write(json.dumps(rec) + "\n")
            f_train.flush()
            done[job.key] = rec
            rate = tokens["n"] / max(time.perf_counter() - t0, 1e-9)
            if bar is not None:
                bar.update(task, completed=len(done), info=f"{tokens['n']:,} tokens, {rate:.0f} tokens/s")
            elif time.perf_counter() - last_log[0] > 30:
                last_log[0] = time.perf_counter()
                log(f"data: {len(done)} answers, {tokens['n']:,} tokens generated, {rate:.0f} tokens/s")

        def on_pass(n: int) -> None:
            tokens["n"] += n

        try:
            generate(engine, queue, cfg.batch_size, finish, capacity, on_pass)
        finally:
            if bar is not None:
                bar.stop()
            if kept["requests"]:
                log(
                    f"data: the model wrote {kept['requests']:,} requests, {kept['kept']:,} kept "
                    f"(the rest unusable or near-duplicates)"
                )


def first_word(text: str) -> str:
    """The request's first word, lower-cased, without punctuation ("" for none)."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    return words[0] if words else ""


def write_card(out: Path, cfg: DataConfig | None = None, skipped: dict | None = None) -> dict:
    """card.json and card.md: answers and tokens per source and category, length histogram, answers cut
    short. Reads the folder only (shards and working file; a torn line is not cut); refuses a folder
    that is not an mtp data set. The length limit reported is the stored one."""
    out = Path(out)
    stored = open_folder(out, None)
    max_new = stored.get("max_new_tokens", cfg.max_new_tokens if cfg else None)
    done, bad = shards.read(out, "train", repair=False)
    per: dict[str, dict] = {}
    per_cat: dict[str, dict] = {}
    edges = [0, 16, 32, 64, 128, 192, 256, 384, 512, 1024, 1 << 30]
    hist = [0] * (len(edges) - 1)
    for rec in done.values():
        n = len(rec["response_ids"])
        for table, name in (
            (per, rec.get("source", "?")),
            (per_cat, f"{rec.get('source', '?')}: {rec.get('category') or '-'}"),
        ):
            s = table.setdefault(name, {"answers": 0, "response_tokens": 0, "prompt_tokens": 0, "cut": 0})
            s["answers"] += 1
            s["response_tokens"] += n
            s["prompt_tokens"] += len(rec["prompt_ids"])
            s["cut"] += rec.get("finish") == "length"
        hist[next(i for i in range(len(hist)) if n < edges[i + 1])] += 1
    heldout = {}
    for f in sorted((out / HELDOUT).glob("*.jsonl")) if (out / HELDOUT).exists() else []:
        heldout[f.stem] = sum(1 for line in f.read_text(encoding="utf-8").splitlines() if line.strip())
    written, _ = shards.read(out, "instructions", repair=False)
    firsts = collections.Counter(
        first_word(r.get("text", "")) for k, r in written.items() if done.get(k, {}).get("source") == "self_written"
    )
    total = sum(s["answers"] for s in per.values())
    card = {
        "answers": total,
        "response_tokens": sum(s["response_tokens"] for s in per.values()),
        "cut_by_length_limit": sum(s["cut"] for s in per.values()),
        "max_new_tokens": max_new,
        "shards": [e["file"] for e in stored.get("shards", [])],
        "by_source": per,
        "by_category": per_cat,
        "length_histogram": {
            f"{edges[i]}-{edges[i + 1] - 1 if edges[i + 1] < 1 << 30 else ''}": c
            for i, c in enumerate(hist)
            if c or i < len(hist) - 1
        },
        "heldout_prompts": heldout,
        "self_written_requests": len(written),
        "self_written_first_words": {"distinct": len(firsts), "top": firsts.most_common(15)},
        "skipped_prompts_too_long": dict(skipped or {}),
        "corrupt_lines_skipped": bad,
    }
    shards.write_text_atomic(out / "card.json", json.dumps(card, indent=1))
    lines = [
        f"# Data card: {out.name}",
        "",
        f"{card['answers']:,} answers, {card['response_tokens']:,} response tokens; "
        f"{card['cut_by_length_limit']:,} cut by the {max_new}-token limit; "
        f"{len(card['shards'])} sealed shard(s).",
        "",
        "| source | answers | share | response tokens | mean length | cut |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in sorted(per.items()):
        lines.append(
            f"| {name} | {s['answers']:,} | {s['answers'] / max(total, 1):.0%} | {s['response_tokens']:,} | "
            f"{s['response_tokens'] / max(s['answers'], 1):.0f} | {s['cut']:,} |"
        )
    lines += ["", "| source: category | answers | response tokens |", "| --- | --- | --- |"]
    lines += [
        f"| {k} | {v['answers']:,} | {v['response_tokens']:,} |"
        for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1]["answers"])
    ]
    if firsts:  # self-written requests have no category: their first word shows what kinds they span
        lines += [
            "",
            f"Self-written requests answered, by first word: {len(firsts):,} distinct; the most common: "
            + ", ".join(f"{w or '(empty)'} {c:,}" for w, c in firsts.most_common(15))
            + ".",
        ]
    lines += ["", "| response length | answers |", "| --- | --- |"]
    lines += [f"| {k} | {v:,} |" for k, v in card["length_histogram"].items()]
    lines += [
        "",
        "Held out (prompts only, never trained on): " + (", ".join(f"{k} {v}" for k, v in heldout.items()) or "none"),
    ]
    shards.write_text_atomic(out / "card.md", "\n".join(lines) + "\n")
    return card
