"""Write mtp/assets/eval_prompts.json: hashes of every evaluation prompt the project knows.

    python scripts/eval_prompt_hashes.py --data-dir $MTP_DATA_DIR
GSM8K test questions, BIG-Bench Hard inputs, and the diverse held-out benchmark prompts
(benchmarks/results/final/diverse60.jsonl). Only hashes are kept (`mtp.training.eval_guard`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mtp.training.eval_guard import HASHES, prompt_hash

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    args = ap.parse_args()
    data = Path(args.data_dir)
    jsonl = lambda p: [json.loads(x) for x in p.read_text().splitlines() if x.strip()]  # noqa: E731
    sets = {
        "GSM8K test": sorted({prompt_hash(r["question"]) for r in jsonl(data / "gsm8k" / "test.jsonl")}),
        "BIG-Bench Hard": sorted({prompt_hash(e["input"]) for f in sorted((data / "bbh").glob("*.json"))
                                  for e in json.loads(f.read_text())["examples"]}),
        "diverse held-out": sorted({prompt_hash(r["prompt"])
                                    for r in jsonl(ROOT / "benchmarks" / "results" / "final" / "diverse60.jsonl")}),
    }
    HASHES.write_text(json.dumps({"hash": "sha256 of the lower-cased words, first 16 hex digits", "sets": sets}) + "\n")
    print({k: len(v) for k, v in sets.items()}, "->", HASHES)


if __name__ == "__main__":
    main()
