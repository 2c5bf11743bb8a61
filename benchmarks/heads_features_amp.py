"""Speed and drift of the heads' hidden-state extraction under bf16 autocast (`--amp`) against fp32.

Runs `heads_train.extract_features` over the same answers of an `mtp data` JSONL, fp32 and bf16
interleaved (`--repeat` rounds; the first round warms the kernels), and prints rows per second for each,
the relative norm of the hidden-state difference and how often the trunk's greedy token still agrees.

    python benchmarks/heads_features_amp.py --examples runs/mix-v1-shards1-12.jsonl --start 3000 --n 24 \
        --threads 2 --out benchmarks/results/heads_amp
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from mtp.core.engine import Engine, EngineConfig
from mtp.training.data import load_examples
from mtp.training.heads_train import extract_features


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", required=True)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    examples = load_examples(args.examples)[args.start : args.start + args.n]
    model = Engine.load(EngineConfig(adapter="none", pack=False)).model
    feats, rows = {}, []
    for rnd in range(args.repeat):
        for mode in ("fp32", "bf16"):
            t0 = time.perf_counter()
            feats[mode] = extract_features(model, examples, amp=mode == "bf16")
            dt = time.perf_counter() - t0
            rec = {
                "round": rnd,
                "mode": mode,
                "rows": len(feats[mode]["hidden"]),
                "seconds": round(dt, 2),
                "rows_per_s": round(len(feats[mode]["hidden"]) / dt, 1),
            }
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    a, b = feats["fp32"], feats["bf16"]
    cpu = next(
        (
            x.split(":", 1)[1].strip()
            for x in Path("/proc/cpuinfo").read_text().splitlines()
            if x.startswith("model name")
        ),
        platform.processor(),
    )
    summary = {
        "hidden_rel_diff": round(float((a["hidden"] - b["hidden"]).norm() / a["hidden"].norm()), 5),
        "agree_fp32": round(float(a["agree"].float().mean()), 4),
        "agree_bf16": round(float(b["agree"].float().mean()), 4),
        "targets_equal": bool(torch.equal(a["ahead"], b["ahead"])),
        "examples": f"{args.examples}[{args.start}:{args.start + args.n}]",
        "threads": args.threads,
        "cpu": cpu,
        "bf16_native": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "torch": torch.__version__,
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "results.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in [*rows, summary])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
