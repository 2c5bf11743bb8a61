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

The parts, one module each: the sources and the held-out split (`mtp.training.data_sources`), the prompts
the model writes (`mtp.training.self_written`), the folder (`mtp.training.data_folder`) and the card
(`mtp.training.data_card`); here, a run: its work planned (`_run`) and generated (`_generate`). Their
names are importable from here.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from mtp.core.decoding.sampling import SamplingParams
from mtp.training import shards
from mtp.training.data import Job, generate, response_of
from mtp.training.data_card import first_word, write_card
from mtp.training.data_folder import (
    INSTRUCTIONS,
    LOCK,
    MANIFEST,
    TRAIN,
    check_folder,
    locked,
    manifest,
    open_folder,
    seal,
)
from mtp.training.data_sources import (
    HELDOUT,
    DataConfig,
    Prompt,
    content_id,
    file_prompts,
    is_heldout,
    read_self_instruct,
    stable_fraction,
    write_heldout,
)
from mtp.training.self_written import (
    DUPLICATE_JACCARD,
    FEW_SHOT,
    Deduplicator,
    Judge,
    clean_instruction,
    normalise,
    write_requests,
)

__all__ = [  # what callers import from here (the parts' modules hold them)
    "DUPLICATE_JACCARD",
    "FEW_SHOT",
    "HELDOUT",
    "INSTRUCTIONS",
    "LOCK",
    "MANIFEST",
    "TRAIN",
    "DataConfig",
    "Deduplicator",
    "Prompt",
    "check_folder",
    "clean_instruction",
    "content_id",
    "file_prompts",
    "first_word",
    "generate",
    "interleave",
    "is_heldout",
    "locked",
    "normalise",
    "read_self_instruct",
    "run",
    "seal",
    "write_card",
]


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
    """The work of a run, planned from what is on disk: the answers missing (in a work order fixed by the
    settings), the self-written requests not yet made (the ones on disk replayed in file order: what was
    kept, and where), the held-out prompts written; then generated (`_generate`)."""
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
    judge = Judge(human, vocabulary=[rec.get("text", "") for rec in written.values()])
    written_kept: list[Prompt] = []
    for key, rec in written.items():
        p = judge(key, rec.get("text", ""))
        if p is not None:
            written_kept.append(p)
    heldout += [p for p in written_kept if is_heldout(p, cfg)]

    answer_job = _Answerer(engine, cfg, skipped)
    answers = [answer_job(p) for p in train + [p for p in written_kept if not is_heldout(p, cfg)] if p.id not in done]
    answers = sorted((j for j in answers if j is not None), key=lambda j: stable_fraction("order:" + j.key, cfg.seed))
    writes = (
        write_requests(engine, cfg.self_written, cfg.seed, examples, written) if examples and cfg.self_written else []
    )
    queue = interleave(answers, writes)
    # a row holds an answer (prompt <= --max-prompt-tokens) or a written request (few-shot prompt + 64 tokens)
    longest_write = max((len(j.prompt_ids) + j.params.max_new_tokens for j in writes), default=0)
    capacity = max(cfg.max_prompt_tokens + cfg.max_new_tokens, longest_write) + 1
    write_heldout(out, heldout)
    log(
        f"data: {len(done)} answers on disk, {len(answers)} to generate, {len(writes)} prompts for the model "
        f"to write; held out: {len(heldout)} prompts -> {out / HELDOUT}"
    )
    if queue:
        meter = _Meter(len(done) + len(answers), len(done), progress, log)
        _generate(engine, cfg, out, queue, capacity, _Sink(engine, cfg, judge, answer_job, queue, done, meter), log)


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


class _Answerer:
    """A prompt's greedy answer job (its chat-encoded prompt, at most --max-new-tokens); None for a prompt
    over --max-prompt-tokens, counted per source in `skipped`."""

    def __init__(self, engine, cfg: DataConfig, skipped: collections.Counter):
        self.engine, self.cfg, self.skipped = engine, cfg, skipped
        self.greedy = SamplingParams(max_new_tokens=cfg.max_new_tokens)

    def __call__(self, p: Prompt) -> Job | None:
        ids = self.engine.encode(p.text, chat=True)
        if len(ids) > self.cfg.max_prompt_tokens:
            self.skipped[p.source] += 1
            return None
        return Job(p.id, ids, self.greedy, {"source": p.source, "category": p.category})


class _Meter:
    """A run's progress: a bar (on a terminal, or when asked) of answers, tokens and tokens/s, else a log
    line at most every 30 seconds."""

    def __init__(self, total: int, completed: int, progress: bool | None, log):
        self.log, self.tokens = log, 0
        self.t0 = time.perf_counter()
        self.bar = None
        if progress if progress is not None else sys.stderr.isatty():
            self.bar = Progress(
                TextColumn("data"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} answers"),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
            )
            self.task = self.bar.add_task("data", total=total, completed=completed, info="")
            self.bar.start()
        self.last_log = time.perf_counter()

    def on_pass(self, n: int) -> None:
        self.tokens += n

    def one_more(self) -> None:
        """An answer was added to the work (a kept self-written request's)."""
        if self.bar is not None:
            self.bar.update(self.task, total=self.bar.tasks[0].total + 1)

    def answered(self, done: int) -> None:
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(self.task, completed=done, info=f"{self.tokens:,} tokens, {rate:.0f} tokens/s")
        elif time.perf_counter() - self.last_log > 30:
            self.last_log = time.perf_counter()
            self.log(f"data: {done} answers, {self.tokens:,} tokens generated, {rate:.0f} tokens/s")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class _Sink:
    """Where a run's finished jobs go, each flushed line by line: an answer to OUT/train.jsonl; a written
    request to OUT/instructions.jsonl, and when kept (`Judge`) its prompt to OUT/heldout/self_written.jsonl
    if held out, else its answer job to the front of the queue."""

    def __init__(self, engine, cfg: DataConfig, judge: Judge, answer_job: _Answerer, queue, done: dict, meter):
        self.engine, self.cfg, self.judge, self.answer_job = engine, cfg, judge, answer_job
        self.queue, self.done, self.meter = queue, done, meter
        self.requests = self.kept = 0
        self.files: dict = {}  # "train", "written", "held": the open working files (`_generate`)

    def finish(self, job: Job, seq) -> None:
        if job.meta.get("kind") == "instruction":
            self._written(job, seq)
        else:
            self._answered(job, seq)

    def _written(self, job: Job, seq) -> None:
        text = self.engine.decode_text(seq.output)
        f = self.files["written"]
        f.write(
            json.dumps({"id": job.key, "prompt_ids": job.prompt_ids, "response_ids": list(seq.output), "text": text})
            + "\n"
        )
        f.flush()
        p = self.judge(job.key, text)
        self.requests += 1
        if p is None:
            return
        self.kept += 1
        if is_heldout(p, self.cfg):
            self.files["held"].write(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n")
            self.files["held"].flush()
            return
        nxt = self.answer_job(p)
        if nxt is not None:
            self.queue.appendleft(nxt)  # answered as soon as a row frees up, not after everything else
            self.meter.one_more()

    def _answered(self, job: Job, seq) -> None:
        rec = {
            "id": job.key,
            **job.meta,
            "prompt_ids": job.prompt_ids,
            "response_ids": response_of(self.engine, seq),
            "finish": seq.finish_reason,
        }
        self.files["train"].write(json.dumps(rec) + "\n")
        self.files["train"].flush()
        self.done[job.key] = rec
        self.meter.answered(len(self.done))


def _generate(engine, cfg: DataConfig, out: Path, queue, capacity: int, sink: _Sink, log) -> None:
    """The queue through the one batching loop (`generate`), every finished job appended to its working
    file (`_Sink`); on the way out, however it ends, the progress stops and the written requests are counted."""
    with (
        open(out / TRAIN, "a", encoding="utf-8") as f_train,
        open(out / INSTRUCTIONS, "a", encoding="utf-8") as f_written,
        open(out / HELDOUT / "self_written.jsonl", "a", encoding="utf-8") as f_held,
    ):
        sink.files.update(train=f_train, written=f_written, held=f_held)
        try:
            generate(engine, queue, cfg.batch_size, sink.finish, capacity, sink.meter.on_pass)
        finally:
            sink.meter.stop()
            if sink.requests:
                log(
                    f"data: the model wrote {sink.requests:,} requests, {sink.kept:,} kept "
                    f"(the rest unusable or near-duplicates)"
                )
