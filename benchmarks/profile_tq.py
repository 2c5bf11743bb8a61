"""t(q): the cost of one forward pass that feeds q tokens, on this machine, via mtp.core.policy.costmodel.

    python benchmarks/profile_tq.py [--model smollm2-135m] [--device cpu|cuda] [--threads N]
        [--cache-len 300] [--batch 1] [--repeats 5] [--qmax 32] [--random-config config.json] [--out t.json]

Prints t(q), t(q)/t(1) (the tokens per pass a q-token block needs to break even) and the linear fit.
`--pack compare` times the same weights with and without the oneDNN packing of `mtp.core.runtime.model.pack_weights`
(the engine's CPU default), one round of each after the other so drift falls on both alike.
`--random-config` builds a randomly initialised model from a HF config.json instead of loading
weights: the time of a pass does not depend on the weights' values, so the profile of a machine
where the weights cannot travel (an accelerator box) is the same as with the real model.
"""

from __future__ import annotations

import argparse
import json

import torch

from mtp.core.policy.costmodel import measure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--random-config", default=None, help="HF config.json: random weights of that shape")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--cache-len", type=int, default=300)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--qmax", type=int, default=32)
    p.add_argument(
        "--pack",
        choices=["on", "off", "compare"],
        default="on",
        help="CPU float32: packed weights (the engine's default), plain, or both side by side",
    )
    p.add_argument("--out", default=None, help="write the cost model as JSON here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.random_config:
        from mtp.core.runtime.model import ModelConfig, Transformer

        with open(args.random_config) as f:
            cfg = ModelConfig.from_hf(json.load(f))
        torch.manual_seed(0)
        model = Transformer(cfg).to(device=args.device, dtype=dtype).eval().requires_grad_(False)
        name = f"random weights of {args.random_config}"
    else:
        from mtp.core.runtime.loading import load

        model = load(args.model, dtype=dtype, device=args.device).model
        name = args.model
    from mtp.core.runtime.model import pack_weights

    qs = range(1, args.qmax + 1)
    if args.pack == "compare":
        compare_packing(model, name, qs, args)
        return
    if args.pack == "on":
        pack_weights(model)
    cost = measure(model, qs, args.cache_len, args.batch, args.repeats)
    cost.meta.update(model=name, dtype=args.dtype)
    t1 = cost.pass_time(1)
    a, b = cost.linear_fit()
    print(
        f"# {name} on {args.device} ({args.dtype}, {torch.get_num_threads()} threads), batch {args.batch}, "
        f"cache {args.cache_len}"
    )
    print("q\tms\tt(q)/t(1) (= tokens per pass needed to break even with a q-token block)")
    for q, t in cost.points.items():
        print(f"{q}\t{t * 1e3:.2f}\t{t / t1:.2f}")
    print(f"linear fit: {a * 1e3:.2f} ms + {b * 1e3:.3f} ms/token")
    if args.out:
        cost.save(args.out)


def compare_packing(model, name: str, qs, args) -> None:
    from mtp.core.decoding import metrics
    from mtp.core.runtime.model import pack_weights, unpack_weights

    if not pack_weights(model):
        raise SystemExit("packing does not apply here (needs CPU, float32 and oneDNN)")
    rounds: dict[str, list[dict]] = {"plain": [], "packed": []}
    for _ in range(args.repeats):
        for label in rounds:
            pack_weights(model) if label == "packed" else unpack_weights(model)
            rounds[label].append(measure(model, qs, args.cache_len, args.batch, 1).points)
    t = {label: {q: metrics.median_spread([r[q] for r in rs])[0] for q in qs} for label, rs in rounds.items()}
    print(
        f"# {name}, {torch.get_num_threads()} threads, batch {args.batch}, cache {args.cache_len}, "
        f"median of {args.repeats} alternating rounds"
    )
    print("q\tplain ms\tpacked ms\tplain/packed\tt(q)/t(1) plain\tt(q)/t(1) packed")
    for q in qs:
        a, b = t["plain"][q], t["packed"][q]
        print(f"{q}\t{a * 1e3:.2f}\t{b * 1e3:.2f}\t{a / b:.2f}\t{a / t['plain'][1]:.2f}\t{b / t['packed'][1]:.2f}")


if __name__ == "__main__":
    main()
