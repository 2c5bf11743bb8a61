"""The diverse evaluation prompts: a fixed sample of an `mtp data` run's held-out prompts.

`mtp data` holds out a share of every non-GSM8K source (OUT/heldout/*.jsonl: self-instruct tasks
and the model's self-written requests) that no training run reads. This picks `--per-group`
prompts from each of three groups, in a stable hash order of their ids: self-instruct seed tasks,
self-instruct user-oriented tasks, self-written requests; and writes a `mtp bench --data prompts:`
file whose `category` is the group (bench then reports tokens per pass per group).

    python benchmarks/diverse_split.py --heldout $MTP_CACHE_DIR/data/mix-v1/heldout --per-group 20 \\
        --out benchmarks/results/final/diverse60.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path


def group(rec: dict) -> str:
    i = rec["id"]
    if i.startswith("si-user_oriented"):
        return "self-instruct user-oriented"
    if i.startswith("si-"):
        return "self-instruct seed task"
    return "self-written"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heldout", required=True, help="an `mtp data` run's heldout/ folder")
    ap.add_argument("--per-group", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = [
        json.loads(x)
        for f in sorted(Path(args.heldout).glob("*.jsonl"))
        for x in f.read_text(encoding="utf-8").splitlines()
        if x.strip()
    ]
    order = sorted(rows, key=lambda r: hashlib.sha256(f"diverse:{r['id']}".encode()).hexdigest())
    picked = []
    for g in ("self-instruct seed task", "self-instruct user-oriented", "self-written"):
        got = [r for r in order if group(r) == g][: args.per_group]
        if len(got) < args.per_group:
            raise SystemExit(f"only {len(got)} held-out prompts in group {g!r}")
        picked += [{"id": r["id"], "category": g, "prompt": r["prompt"]} for r in got]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in picked), encoding="utf-8")
    print(f"{len(picked)} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
