"""Mask predictions supervised per second of a mask-token training step (`mtp train`), measured
side by side: each CONFIG (a label, a source tree and step settings) runs in its own process for
`--steps` optimizer steps per round, rounds interleaved so machine load falls on all alike; the
first step of each process is a warm-up, untimed.

A mask prediction is one supervised entry at a mask position (depth >= 2 of a span); the depth-1
entries (the model's own next token, which gated LoRA leaves untouched) are not counted.

    python benchmarks/train_throughput.py --examples EXAMPLES.jsonl --threads 1 \\
        --config before=OLD_TREE:12:8:hard --config after=.:48:8:ground-truth --out results.jsonl \\
        --config upper-half=.:48:8:ground-truth@15:30

TREE is a checkout of mtp (its `mtp/` package is imported from there), SPANS:K_MAX:TEACHER the step,
an optional @FROM:TO puts the LoRA on layers FROM..TO-1 only (`mtp train --lora-layers`; trees
that have it), and a final +amp runs the forward under bf16 autocast (`mtp train --amp on`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

STEP = r"""
import json, sys, time, torch
torch.set_num_threads({threads})
try:
    from mtp.core.engine import Engine, EngineConfig
    from mtp.core.runtime.adapter import add_adapters
    from mtp.training.data import load_examples
    from mtp.training import distill as D
except ImportError:  # the flat layout of older checkouts
    from mtp.engine import Engine, EngineConfig
    from mtp.adapter import add_adapters
    from mtp.data import load_examples
    from mtp import train as D
engine = Engine.load(EngineConfig(adapter="none", pack=False))
model = engine.model
examples = D.prepare_examples(load_examples({examples!r})[:{n_examples}], {seq_len})
params = add_adapters(model, 16, 32.0, n_used_tokens=len(engine.tokenizer){layers_arg})
model.train()
opt = torch.optim.AdamW(params, lr=1e-4)
B, total_s, masks = {batch}, 0.0, 0
for step in range({steps} + 1):
    gen = torch.Generator().manual_seed({seed} * 1000 + step)
    batch = D.make_batch([examples[({seed} * 7919 + step * B + i) % len(examples)] for i in range(B)],
                         model.config.mask_token_id, {spans}, {k_max}, {seq_len}, gen)
    t0 = time.perf_counter()
    s, p, t = D.forward_pair(model, model, None, batch, {teacher!r}, True, {amp})
    loss, agree = D.distill_loss(s, t, batch, {teacher!r}, p)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step:  # step 0 warms up
        total_s += time.perf_counter() - t0
        masks += int((batch.valid & (batch.depth >= 2)).sum())
print(json.dumps({{"seconds": total_s, "mask_predictions": masks}}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", required=True, help="JSONL of token ids (e.g. `mtp data`'s train.jsonl)")
    ap.add_argument("--config", action="append", required=True, help="LABEL=TREE:SPANS:K_MAX:TEACHER[@FROM:TO][+amp]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per config and round")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--n-examples", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="append the per-round records here (JSONL)")
    args = ap.parse_args()
    configs = []
    for spec in args.config:
        label, _, rest = spec.partition("=")
        amp = rest.endswith("+amp")
        rest = rest.removesuffix("+amp")
        rest, _, layers = rest.partition("@")
        tree, spans, k_max, teacher = rest.rsplit(":", 3)
        layers = tuple(int(x) for x in layers.split(":")) if layers else None
        configs.append((label, Path(tree).resolve(), int(spans), int(k_max), teacher, layers, amp))
    totals = {c[0]: [0.0, 0] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for label, tree, spans, k_max, teacher, layers, amp in order:
            code = STEP.format(
                threads=args.threads,
                examples=str(Path(args.examples).resolve()),
                n_examples=args.n_examples,
                seq_len=args.seq_len,
                batch=args.batch,
                steps=args.steps,
                seed=r,
                spans=spans,
                k_max=k_max,
                teacher=teacher,
                amp=amp,
                layers_arg=f", layers={layers}" if layers else "",
            )
            env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tree)
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            totals[label][0] += rec["seconds"]
            totals[label][1] += rec["mask_predictions"]
            rec.update(
                label=label,
                round=r,
                spans=spans,
                k_max=k_max,
                teacher=teacher,
                layers=layers,
                amp=amp,
                batch=args.batch,
                threads=args.threads,
                rate=rec["mask_predictions"] / rec["seconds"],
                time=time.time(),
            )
            print(json.dumps(rec), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    base = None
    for label, (s, n) in totals.items():
        rate = n / s
        base = base or rate
        print(f"{label:>12}: {rate:7.1f} mask predictions/s ({n} in {s:.0f} s), {rate / base:.2f}x {configs[0][0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
