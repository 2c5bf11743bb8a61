"""The evaluation prompts this project knows, as hashes: no training file may contain one.

A file's name can lie (a link `train.jsonl -> gsm8k/test.jsonl`, `my-eval-copy.jsonl`), its content
cannot: every reader of training or datastore data checks each prompt (`check_not_evaluation`): the
prompt readers (`data.load_prompts`, `mtp data`'s sources) the text, the token-id readers
(`data.check_examples_not_evaluation`: `--examples`, `mtp datastore build --data`) the prompt decoded
with the model's tokenizer. A prompt is refused when it holds a prompt of the GSM8K test split,
BIG-Bench Hard or the diverse held-out benchmark set (`mtp/assets/eval_prompts.json`, made by
`scripts/eval_prompt_hashes.py` with `write_hashes`), dressed as it may be:

- `normalise` keeps the words (letters and digits, lower-cased, accents, apostrophes and thousands
  separators dropped), so case, spacing and punctuation ("?" or " ?") do not matter, and drops a
  leading label ("Q:", "Question:", "Problem:", "Answer the question:", ... : `PREFIXES`);
- an evaluation prompt of at least `CONTAINED` words is found anywhere inside a prompt: after a
  chat template's system turn or a few-shot preamble, before a trailing instruction ("Let's think
  step by step"). Each is stored with the hash of its first `CONTAINED` words (its head), so a
  prompt of n words costs about n hashes;
- a shorter one (a BIG-Bench Hard boolean expression, a five-word request) only as the whole prompt
  or one whole line of it (the user's line of a chat template), so a short phrase inside a longer
  sentence does not match by chance.
Only hashes are stored, never the prompts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import unicodedata
from pathlib import Path

HASHES = Path(__file__).resolve().parent.parent / "assets" / "eval_prompts.json"
CONTAINED = 8  # an evaluation prompt of this many words or more is also found inside a longer prompt
# leading labels a copied prompt may carry, as normalised words (the longest is tried first)
PREFIXES = sorted(
    (
        tuple(p.split())
        for p in (
            "q",
            "question",
            "questions",
            "problem",
            "math problem",
            "word problem",
            "input",
            "prompt",
            "query",
            "task",
            "instruction",
            "user",
            "human",
            "answer the question",
            "answer the following question",
            "answer this question",
            "solve",
            "solve the problem",
            "solve this problem",
            "solve the following problem",
            "solve the following math problem",
            "solve the following question",
        )
    ),
    key=len,
    reverse=True,
)


def words(text: str) -> list[str]:
    """The words `normalise` keeps, in order."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"(?<=\d)[,_](?=\d{3}(?!\d))", "", text)  # 1,200 -> 1200
    text = re.sub(r"(?<=[a-z])['\u2019`](?=[a-z])", "", text)  # don't, don’t -> dont
    return re.findall(r"[a-z0-9]+", text)


def strip_prefix(ws: list[str]) -> list[str]:
    """`ws` without leading labels (`PREFIXES`, repeatedly: "Question: Problem: ..."); never all of it."""
    while True:
        p = next((p for p in PREFIXES if len(ws) > len(p) and tuple(ws[: len(p)]) == p), None)
        if p is None:
            return ws
        ws = ws[len(p) :]


def normalise(text: str) -> str:
    """What a prompt is compared by: its words (`words`), a leading label dropped (`strip_prefix`)."""
    return " ".join(strip_prefix(words(text)))


def _hash(ws) -> str:
    return hashlib.sha256(" ".join(ws).encode()).hexdigest()[:16]


def prompt_hash(text: str) -> str:
    return _hash(normalise(text).split())


def entry(text: str) -> list:
    """How the hashes file stores one evaluation prompt: [hash, words, hash of its first CONTAINED words]."""
    ws = strip_prefix(words(text))
    return [_hash(ws), len(ws), _hash(ws[:CONTAINED])]


def hash_sets(sets: dict[str, list[str]]) -> dict[str, list[list]]:
    """{set name: its prompts' entries (`entry`), sorted, without repeats and empty prompts}."""
    return {name: sorted({tuple(entry(t)) for t in texts if words(t)}) for name, texts in sets.items()}


def write_hashes(path, sets: dict[str, list[str]]) -> dict[str, int]:
    """Write the hashes file of `sets` ({set name: prompts}) to `path`; returns entries per set."""
    hashed = hash_sets(sets)
    Path(path).write_text(
        json.dumps(
            {
                "hash": "sha256 (first 16 hex digits) of a prompt's normalised words (mtp.training.eval_guard.normalise)",  # noqa: E501
                "entry": f"[hash, number of words, hash of the first {CONTAINED} words]",
                "contained": CONTAINED,
                "sets": {name: [list(e) for e in es] for name, es in hashed.items()},
            }
        )
        + "\n"
    )
    return {name: len(es) for name, es in hashed.items()}


@functools.lru_cache(maxsize=4)
def index(path: Path) -> tuple[dict, dict]:
    """The hashes file at `path` as ({hash: set name}, {head hash: [(words, hash, set name)]} of the
    prompts with at least CONTAINED words); a missing file knows no prompt."""
    whole, heads = {}, {}
    if not Path(path).exists():
        return whole, heads
    data = json.loads(Path(path).read_text())
    if data.get("contained") != CONTAINED:
        raise ValueError(
            f"{path} was made by another version of mtp's evaluation guard; "
            "regenerate it with scripts/eval_prompt_hashes.py"
        )
    for name, entries in data["sets"].items():
        for h, n, head in entries:
            whole[h] = name
            if n >= CONTAINED:
                heads.setdefault(head, []).append((n, h, name))
    return whole, heads


def known() -> dict[str, str]:
    """{hash of a whole evaluation prompt: the set it belongs to} (the shipped file)."""
    return index(HASHES)[0]


def evaluation_set(text: str) -> str | None:
    """The evaluation set `text` holds a prompt of (see the module docstring), else None."""
    whole, heads = index(HASHES)
    ws = strip_prefix(words(text))
    for line in [ws] + [strip_prefix(words(line)) for line in text.splitlines()]:
        if line and _hash(line) in whole:
            return whole[_hash(line)]
    for i in range(len(ws) - CONTAINED + 1):
        for n, h, name in heads.get(_hash(ws[i : i + CONTAINED]), ()):
            if _hash(ws[i : i + n]) == h:
                return name
    return None


def check_not_evaluation(texts, source, names=None) -> None:
    """Raise a one-line ValueError when any of `texts` holds a known evaluation prompt; `names[i]`
    says which item text i is in the message (default "prompt i+1")."""
    for n, text in enumerate(texts):
        found = evaluation_set(text)
        if found is not None:
            what = names[n] if names is not None else f"prompt {n + 1}"
            raise ValueError(
                f"{Path(str(source)).name}: {what} is a prompt of the {found} evaluation set; "
                "evaluation prompts are never trained on or built into a datastore"
            )
