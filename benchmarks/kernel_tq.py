"""t(q) per `--weights` choice and per engine: the cost of one forward pass of q tokens over a cache, for
mtp's kernels (`native`, `native-int8`, `float32`), the torch path, and llama.cpp on the same GGUF.

    python benchmarks/kernel_tq.py --threads 2 [--weights native,native-int8,float32,torch] \
        [--qs 1,2,4,8,16,32] [--cache-len 300] [--rounds 3] [--llamacpp FILE.gguf ...] [--out FILE]

Every choice is loaded once; the rounds then alternate over them (each round times every q of every
choice: `mtp.core.policy.costmodel.measure`, median of `--repeats`), so drift falls on all alike; the printed
t(q) is the median over rounds, with t(2)/t(1) and t(8)/t(1). llama.cpp's t(q) comes from `llama-bench -p
q -n 0 -d cache-len` (`mtp.interop.llamacpp_profile.measure`, the `make llamacpp` build) for each
`--llamacpp` file (the shipped Q4_1 file is `smollm2-135m`; the F32 export is `mtp export --format
llamacpp`'s). Also printed: where one 1-token pass of the first choice spends its time (torch profiler:
linears, attention, the rest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp.core.engine import Engine, EngineConfig
from mtp.core.policy.costmodel import measure
from mtp.core.runtime.cache import KVCache
from mtp.core.runtime.loading import resolve
from mtp.eval.bench import environment


def split_profile(model, cache_len: int) -> dict[str, float]:
    """Milliseconds of one 1-token pass by kind of op (torch profiler, self CPU time, 5 passes averaged)."""
    cache = KVCache.for_model(model, 1, cache_len + 1)
    tok, pos = torch.tensor([[17]]), torch.tensor([[cache_len]])
    kinds = {"linears": 0.0, "attention": 0.0, "rest": 0.0}
    with torch.inference_mode():
        model(tok, pos, cache)
        with torch.profiler.profile() as prof:
            for _ in range(5):
                model(tok, pos, cache)
    for ev in prof.key_averages():
        name = ev.key
        kind = (
            "linears"
            if "linear" in name or "mkldnn" in name or "addmm" in name or name == "aten::mm"
            else "attention"
            if "attention" in name
            else "rest"
        )
        kinds[kind] += ev.self_cpu_time_total / 1000 / 5
    return {k: round(v, 2) for k, v in kinds.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", default="native,native-int8,float32,torch")
    p.add_argument("--qs", default="1,2,4,8,16,32")
    p.add_argument("--cache-len", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llamacpp", action="append", default=[], help="a GGUF for llama-bench (smollm2-135m: shipped)")
    p.add_argument("--out", help="write the numbers as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    qs = [int(q) for q in args.qs.split(",")]
    choices = args.weights.split(",")
    engines = {w: Engine.load(EngineConfig(adapter="none", proposer="lookup", weights=w)) for w in choices}
    for w, e in engines.items():
        print(f"{w}: {e.weights_line}", file=sys.stderr)
    runs: dict[str, list[dict[int, float]]] = {w: [] for w in choices}
    for r in range(args.rounds):
        order = choices[r % len(choices) :] + choices[: r % len(choices)]
        for w in order:
            cost = measure(engines[w].model, qs, cache_len=args.cache_len, repeats=args.repeats)
            runs[w].append(cost.points)
    table = {w: {q: statistics.median(run[q] for run in rs) * 1000 for q in qs} for w, rs in runs.items()}
    for path in args.llamacpp:
        from mtp.interop import llamacpp_profile

        target = resolve(path) if path == "smollm2-135m" else Path(path)
        t = llamacpp_profile.measure(target, qs, depth=args.cache_len, threads=args.threads, repeats=args.rounds)
        table[f"llama.cpp {target.name}"] = {q: t[q] * 1000 for q in qs if q in t}
    print(f"t(q) in ms, cache {args.cache_len}, {args.threads} threads; {environment().get('cpu')}")
    print(f"{'engine':<44}" + "".join(f"{'t(' + str(q) + ')':>9}" for q in qs) + f"{'t2/t1':>8}{'t8/t1':>8}")
    for name, t in table.items():
        r2 = t.get(2, float("nan")) / t[1]
        r8 = t.get(8, float("nan")) / t[1]
        print(f"{name:<44}" + "".join(f"{t.get(q, float('nan')):>9.2f}" for q in qs) + f"{r2:>8.2f}{r8:>8.2f}")
    split = {w: split_profile(engines[w].model, args.cache_len) for w in choices}
    print("one 1-token pass, ms by kind (profiler, self CPU time): " + json.dumps(split))
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "t_ms": table,
                    "split_ms": split,
                    "weights": {w: e.weights_line for w, e in engines.items()},
                    "env": environment(),
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
