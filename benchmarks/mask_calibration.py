"""How many decoded prompts the mask adapter's calibration needs: its (confidence, right) pairs from
`verify:4` chains (what `mtp tune` records), then `mtp.tune.calibrate.fit_held_out` (two-fold cross-fitted ECE)
on the first 16, 32, 48, ... of them.

    python benchmarks/mask_calibration.py --data gsm8k:$MTP_DATA_DIR/gsm8k/test.jsonl --limit 64 \
        --out runs/cal/gsm8k64.json
    python benchmarks/mask_calibration.py --data prompts:benchmarks/results/final/diverse60.jsonl --limit 60 \
        --out runs/cal/diverse60.json

Writes the pairs per prompt to --out (a second run with the same --out only re-scores them) and prints one
line per prompt count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mtp.core.decoding.strategy import Strategy
from mtp.core.engine import Engine, EngineConfig
from mtp.eval.bench import load_data
from mtp.tune.calibrate import fit_held_out
from mtp.tune.offline import chain_pairs, decode_all


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    out = Path(a.out)
    if not out.is_file():
        engine = Engine.load(EngineConfig(threads=a.threads))
        _, items = load_data(a.data, a.limit)
        prompts = [engine.encode(it["prompt"], chat=True) for it in items]
        stats = decode_all(engine, prompts, Strategy.parse("verify:4"), "mask", 256, 8, record=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([chain_pairs(o) for o in stats.outputs]))
    pairs = json.loads(out.read_text())
    for m in (16, 24, 32, 48, 64):
        if m > len(pairs):
            break
        _, rep = fit_held_out(pairs[:m])
        print(
            f"{m} prompts: {rep['test_pairs']} guesses, ECE {rep['ece_before']:.3f} -> {rep['ece_after']:.3f} "
            f"(noise floor {rep['ece_floor']:.3f}; {rep['ece_before'] / rep['ece_after']:.1f}x lower)"
        )


if __name__ == "__main__":
    main()
