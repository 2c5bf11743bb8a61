"""An `mtp data` folder's card (`write_card`): card.json and card.md, answers and tokens per source and
category, the length histogram, how many answers the length limit cut, the held-out prompts, and what the
self-written requests span (their first words). Read from the folder only."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

from mtp.training import shards
from mtp.training.data_folder import open_folder
from mtp.training.data_sources import HELDOUT, DataConfig


def first_word(text: str) -> str:
    """The request's first word, lower-cased, without punctuation ("" for none)."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    return words[0] if words else ""


EDGES = [0, 16, 32, 64, 128, 192, 256, 384, 512, 1024, 1 << 30]  # the length histogram's bins


def write_card(out: Path, cfg: DataConfig | None = None, skipped: dict | None = None) -> dict:
    """card.json and card.md: answers and tokens per source and category, length histogram, answers cut
    short. Reads the folder only (shards and working file; a torn line is not cut); refuses a folder
    that is not an mtp data set. The length limit reported is the stored one."""
    out = Path(out)
    stored = open_folder(out, None)
    max_new = stored.get("max_new_tokens", cfg.max_new_tokens if cfg else None)
    done, bad = shards.read(out, "train", repair=False)
    per, per_cat, hist = _tally(done)
    heldout = {}
    for f in sorted((out / HELDOUT).glob("*.jsonl")) if (out / HELDOUT).exists() else []:
        heldout[f.stem] = sum(1 for line in f.read_text(encoding="utf-8").splitlines() if line.strip())
    written, _ = shards.read(out, "instructions", repair=False)
    firsts = collections.Counter(
        first_word(r.get("text", "")) for k, r in written.items() if done.get(k, {}).get("source") == "self_written"
    )
    card = {
        "answers": sum(s["answers"] for s in per.values()),
        "response_tokens": sum(s["response_tokens"] for s in per.values()),
        "cut_by_length_limit": sum(s["cut"] for s in per.values()),
        "max_new_tokens": max_new,
        "shards": [e["file"] for e in stored.get("shards", [])],
        "by_source": per,
        "by_category": per_cat,
        "length_histogram": {
            f"{EDGES[i]}-{EDGES[i + 1] - 1 if EDGES[i + 1] < 1 << 30 else ''}": c
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
    shards.write_text_atomic(out / "card.md", _markdown(out.name, card))
    return card


def _tally(done: dict) -> tuple[dict, dict, list[int]]:
    """Per source and per "source: category": answers, response and prompt tokens, answers cut by the
    length limit; and the answers per bin of response length (EDGES)."""
    per: dict[str, dict] = {}
    per_cat: dict[str, dict] = {}
    hist = [0] * (len(EDGES) - 1)
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
        hist[next(i for i in range(len(hist)) if n < EDGES[i + 1])] += 1
    return per, per_cat, hist


def _markdown(name: str, card: dict) -> str:
    """card.md: the card's figures as text and tables."""
    total, firsts = card["answers"], card["self_written_first_words"]
    lines = [
        f"# Data card: {name}",
        "",
        f"{card['answers']:,} answers, {card['response_tokens']:,} response tokens; "
        f"{card['cut_by_length_limit']:,} cut by the {card['max_new_tokens']}-token limit; "
        f"{len(card['shards'])} sealed shard(s).",
        "",
        "| source | answers | share | response tokens | mean length | cut |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for source, s in sorted(card["by_source"].items()):
        lines.append(
            f"| {source} | {s['answers']:,} | {s['answers'] / max(total, 1):.0%} | {s['response_tokens']:,} | "
            f"{s['response_tokens'] / max(s['answers'], 1):.0f} | {s['cut']:,} |"
        )
    lines += ["", "| source: category | answers | response tokens |", "| --- | --- | --- |"]
    lines += [
        f"| {k} | {v['answers']:,} | {v['response_tokens']:,} |"
        for k, v in sorted(card["by_category"].items(), key=lambda kv: -kv[1]["answers"])
    ]
    if firsts["distinct"]:  # self-written requests have no category: their first word shows what kinds they span
        lines += [
            "",
            f"Self-written requests answered, by first word: {firsts['distinct']:,} distinct; the most common: "
            + ", ".join(f"{w or '(empty)'} {c:,}" for w, c in firsts["top"])
            + ".",
        ]
    lines += ["", "| response length | answers |", "| --- | --- |"]
    lines += [f"| {k} | {v:,} |" for k, v in card["length_histogram"].items()]
    heldout = card["heldout_prompts"]
    lines += [
        "",
        "Held out (prompts only, never trained on): " + (", ".join(f"{k} {v}" for k, v in heldout.items()) or "none"),
    ]
    return "\n".join(lines) + "\n"
