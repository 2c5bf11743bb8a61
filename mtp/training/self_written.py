"""The prompts the model writes itself (`mtp data --self-written N`): request j is a sampled continuation
of a numbered list of three tasks drawn (by seed and j) from the self-instruct training tasks
(`write_requests`, FEW_SHOT); what it wrote is cleaned to one task (`clean_instruction`) and kept when it
is new: no near-duplicate (word-set Jaccard >= DUPLICATE_JACCARD, `Deduplicator`) of a human task or of
one kept before (`Judge`)."""

from __future__ import annotations

import collections
import math
import random
import re

from mtp.core.decoding.sampling import SamplingParams
from mtp.training.data import Job
from mtp.training.data_sources import Prompt

FEW_SHOT = "Tasks that users give an AI assistant:\n1. {0}\n2. {1}\n3. {2}\n4."  # continued as plain text
DUPLICATE_JACCARD = 0.7


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


class Judge:
    """Whether what the model wrote is kept: cleaned to one task, and no near-duplicate of a human task
    (given first) or of one kept before; `judge(key, text)` is the kept prompt (keyed `key`) or None."""

    def __init__(self, human: list[str], vocabulary: list[str]):
        self.dedup = Deduplicator(human, vocabulary=vocabulary)

    def __call__(self, key: str, text: str) -> Prompt | None:
        task = clean_instruction(text)
        if task is None or self.dedup.seen(task):
            return None
        self.dedup.add(task)
        return Prompt(key, "self_written", task, "self-written", group=normalise(task))


def write_requests(engine, n: int, seed: int, examples: list[str], written: dict) -> list[Job]:
    """Requests 0..n-1 for the model to write a task, but those already in `written`: request j continues
    FEW_SHOT with three of `examples` drawn by (seed, j), sampled by (seed, j), one line of 64 tokens at most."""
    writes = []
    for j in range(n):
        key = f"sw-{j}"
        if key in written:
            continue
        rng = random.Random(seed * 1_000_003 + j)
        ids = engine.encode(FEW_SHOT.format(*rng.sample(examples, 3)), chat=False)
        writes.append(
            Job(
                key,
                ids,
                SamplingParams(temperature=0.9, top_p=0.95, seed=seed * 7919 + j, max_new_tokens=64, stop=["\n"]),
                {"kind": "instruction"},
            )
        )
    return writes
