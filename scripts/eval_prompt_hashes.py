"""Write mtp/assets/eval_prompts.json: hashes of every evaluation prompt the project knows.

    python scripts/eval_prompt_hashes.py --data-dir $MTP_DATA_DIR    (or just: MTP_DATA_DIR=... python ...)
GSM8K test questions, BIG-Bench Hard inputs, and the diverse held-out benchmark prompts
(benchmarks/results/final/diverse60.jsonl). Only hashes are kept (`mtp.training.eval_guard`); run it
again whenever `eval_guard.normalise` or the sets change.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from mtp.training.eval_guard import HASHES, write_hashes

ROOT = Path(__file__).resolve().parent.parent


def eval_prompts(data: Path) -> dict[str, list[str]]:
    """{set name: its prompts} from the evaluation data under `data` (MTP_DATA_DIR) and the repository."""
    jsonl = lambda p: [json.loads(x) for x in p.read_text().splitlines() if x.strip()]  # noqa: E731
    return {
        "GSM8K test": [r["question"] for r in jsonl(data / "gsm8k" / "test.jsonl")],
        "BIG-Bench Hard": [
            e["input"] for f in sorted((data / "bbh").glob("*.json")) for e in json.loads(f.read_text())["examples"]
        ],
        "diverse held-out": [r["prompt"] for r in jsonl(ROOT / "benchmarks" / "results" / "final" / "diverse60.jsonl")],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data-dir",
        default=os.environ.get("MTP_DATA_DIR"),
        help="the evaluation data: gsm8k/test.jsonl, bbh/*.json (default $MTP_DATA_DIR)",
    )
    args = ap.parse_args()
    if not args.data_dir or not (Path(args.data_dir) / "gsm8k" / "test.jsonl").is_file():
        ap.error("give --data-dir (or set MTP_DATA_DIR) to a folder holding gsm8k/test.jsonl and bbh/")
    print(write_hashes(HASHES, eval_prompts(Path(args.data_dir))), "->", HASHES)


if __name__ == "__main__":
    main()
