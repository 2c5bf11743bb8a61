"""Two `mtp bench` runs' answers to the same prompts, side by side: how often they agree.

Used for issue 23's number-format question (the same `ntp` row decoded in float32 and in bfloat16):
per prompt, whether the texts are identical, where they first differ (in tokens of the model's
tokenizer), whether the extracted GSM8K answers agree, and each run's accuracy against the gold
answers. Reads OUT/outputs.jsonl of each run (`strategy`, `prompt_index`, `text`).

    python benchmarks/compare_outputs.py --a benchmarks/results/trees/gsm8k100 --b runs/bf16/gsm8k100-bf16 \\
        --row ntp --gsm8k $MTP_DATA_DIR/gsm8k/test.jsonl --out benchmarks/results/dtype/gsm8k100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mtp.core.decoding import metrics
from mtp.core.policy import quality
from mtp.eval import gsm8k


def texts(run: Path, row: str) -> dict[int, str]:
    out = {}
    for line in open(run / "outputs.jsonl"):
        r = json.loads(line)
        if r["strategy"] == row:
            out[r["prompt_index"]] = r["text"]
    if not out:
        raise SystemExit(f"no {row!r} row in {run / 'outputs.jsonl'}")
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="first mtp bench --out folder")
    ap.add_argument("--b", required=True, help="second mtp bench --out folder")
    ap.add_argument("--row", default="ntp", help="the strategy row to compare")
    ap.add_argument("--gsm8k", help="GSM8K jsonl whose first N items were the prompts (gold answers)")
    ap.add_argument("--model", default=None, help="tokenizer for token positions (default: the default model)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from mtp.core.runtime import loading

    tok = loading.load(args.model or loading.DEFAULT_MODEL).tokenizer
    a, b = texts(Path(args.a), args.row), texts(Path(args.b), args.row)
    common = sorted(set(a) & set(b))
    gold = [it["gold"] for it in gsm8k.load(args.gsm8k, max(common) + 1)] if args.gsm8k else None
    per = []
    for j in common:
        ia, ib = tok.encode(a[j]), tok.encode(b[j])
        ans_a, ans_b = quality.extract_answer(a[j]), quality.extract_answer(b[j])
        per.append(
            {
                "prompt_index": j,
                "identical": a[j] == b[j],
                "first_difference_token": first_difference(ia, ib),
                "answer_a": ans_a,
                "answer_b": ans_b,
                "gold": None if gold is None else gold[j],
            }
        )
    diffs = [p["first_difference_token"] for p in per if p["first_difference_token"] is not None]
    summary = {
        "a": args.a,
        "b": args.b,
        "row": args.row,
        "prompts": len(per),
        "identical": sum(p["identical"] for p in per),
        "answer_agreement": metrics.match_rate([p["answer_b"] for p in per], [p["answer_a"] for p in per]),
        "first_difference_median": sorted(diffs)[len(diffs) // 2] if diffs else None,
        "first_difference_min_max": [min(diffs), max(diffs)] if diffs else None,
    }
    if gold is not None:
        summary["accuracy_a"] = metrics.match_rate([p["answer_a"] for p in per], [p["gold"] for p in per])
        summary["accuracy_b"] = metrics.match_rate([p["answer_b"] for p in per], [p["gold"] for p in per])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "prompts": per}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
