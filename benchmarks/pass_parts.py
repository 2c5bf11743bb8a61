"""Where one forward pass of q tokens spends its time: the whole pass (`model(...)`), the decoder layers
alone (`forward_layers`) and the final norm plus output head, over a cache of `--cache-len` positions.
Run it under two checkouts in alternating processes to compare them (the numbers are medians of
`--rounds` rounds of `--passes` passes each, the three parts interleaved within a round):

    for tree in OLD NEW OLD NEW; do PYTHONPATH=$tree python benchmarks/pass_parts.py --label $tree; done

`--stub-layers` replaces each layer's one-call kernel with the identity, so `layers` is the Python and
dispatch around the layers alone (the runner's bookkeeping). Prints one line per q.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp.core.engine import Engine, EngineConfig  # noqa: E402
from mtp.core.runtime.cache import KVCache  # noqa: E402


def median_ms(fn, passes: int) -> float:
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def parts(model, q: int, cache_len: int, rounds: int, passes: int) -> dict[str, float]:
    cache = KVCache.for_model(model, 1, cache_len + q)
    tokens = torch.randint(0, 1000, (1, q), generator=torch.Generator().manual_seed(q))
    positions = (cache_len + torch.arange(q)).view(1, q)
    with torch.inference_mode():
        x = model.embed_tokens(tokens)
        h = torch.randn(1, q, model.config.dim, generator=torch.Generator().manual_seed(0))

        def full():
            cache.lengths = [cache_len]
            model(tokens, positions, cache=cache)

        def layers():
            cache.lengths = [cache_len]
            model.forward_layers(x, positions, cache)

        def head():
            model.lm_head(model.norm(h))

        runs = {"full": full, "layers": layers, "head": head}
        for fn in runs.values():  # warm-up
            median_ms(fn, max(1, passes // 2))
        got = {k: [] for k in runs}
        for _ in range(rounds):
            for k, fn in runs.items():
                got[k].append(median_ms(fn, passes))
    return {k: round(statistics.median(v), 3) for k, v in got.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="native-int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--qs", default="1,8")
    ap.add_argument("--cache-len", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--passes", type=int, default=100)
    ap.add_argument("--stub-layers", action="store_true")
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    engine = Engine.load(EngineConfig(model=args.model, weights=args.weights, threads=args.threads, adapter="none"))
    model = engine.model
    if args.stub_layers:
        for calls in model.runner.layers.values():
            calls.whole = lambda x, *rest: x
    for q in (int(s) for s in args.qs.split(",")):
        got = parts(model, q, args.cache_len, args.rounds, args.passes)
        print(f"{args.label} {args.weights} q={q} ms: " + ", ".join(f"{k} {v}" for k, v in got.items()), flush=True)


if __name__ == "__main__":
    main()
