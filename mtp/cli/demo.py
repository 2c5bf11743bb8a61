"""`make demo` / `python -m mtp.cli.demo`: the embedded SmolLM2-135M decodes a few prompts with plain
next-token decoding and with MTP strategies, alternating prompt by prompt, and prints tokens per
forward pass and tokens/s side by side (metrics from mtp.core.decoding.metrics)."""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from mtp.core.decoding.metrics import merge
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.engine import Engine, EngineConfig
from mtp.core.runtime.checks import check_threads

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Count from 1 to 20, separated by commas.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    console = Console(width=min(Console().width, 80))
    console.print(f"loading {args.model} (the first start converts it and compiles the kernels, once) ...")
    check_threads(args.threads)
    engines = {"mask": Engine.load(EngineConfig(model=args.model, threads=args.threads))}
    engines["lookup"] = Engine(engines["mask"].loaded, EngineConfig(model=args.model, proposer="lookup"))
    runs = [("ntp", "mask"), ("verify:3", "lookup")]
    try:
        engines["heads"] = Engine.load(EngineConfig(model=args.model, proposer="heads", adapter="none"))
        runs.append(("verify:4", "heads"))
    except ValueError:
        console.print("[yellow]no MTP heads for this model")
    if engines["mask"].mask_id is not None:
        runs += [("verify:4", "mask"), ("conf_adapt:0.9:4", "mask")]
    else:
        console.print("[yellow]no MTP adapter for this model")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    stats = {r: [] for r in runs}
    same = {r: 0 for r in runs}
    engines["mask"].generate(PROMPTS[0], "ntp", SamplingParams(max_new_tokens=8))  # warm-up, not timed
    total, n = len(PROMPTS) * len(runs), 0
    with torch.inference_mode():
        for i, prompt in enumerate(PROMPTS):
            order = runs[i % len(runs) :] + runs[: i % len(runs)]  # rotate so drift cancels
            outs = {}
            for strategy, proposer in order:
                n += 1
                res = engines[proposer].generate(prompt, strategy, params)
                outs[(strategy, proposer)] = res
                stats[(strategy, proposer)].append(res)
                console.print(
                    f"[{n}/{total}] prompt {i + 1}, {strategy} ({proposer}): "
                    f"{res.summary['tokens_per_forward']:.2f} tokens/pass, "
                    f"{res.summary['tokens_per_s']:.0f} tokens/s",
                    highlight=False,
                )
            for r in runs:
                same[r] += outs[r].token_ids == outs[("ntp", "mask")].token_ids
    console.print(f"[bold]{PROMPTS[0]}[/bold]")
    console.print(stats[runs[-1]][0].text)
    table = Table(title=f"{args.model}: {len(PROMPTS)} prompts, {args.max_new_tokens} new tokens, greedy")
    for col in ("strategy", "proposer", "tokens/pass", "tokens/s", "speedup", "= ntp"):
        table.add_column(col, justify="right", no_wrap=True)  # 6 columns fit 80 characters
    base = None
    for r in runs:
        m = merge([x.stats for x in stats[r]])
        base = base or m["tokens_per_s"]
        table.add_row(
            r[0],
            r[1] if r[0] != "ntp" else "-",
            f"{m['tokens_per_forward']:.2f}",
            f"{m['tokens_per_s']:.1f}",
            f"{m['tokens_per_s'] / base:.2f}x",
            f"{same[r]}/{len(PROMPTS)}",
        )
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
