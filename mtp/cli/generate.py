"""`mtp generate`: decode one prompt with a strategy and print the text and its metrics.

Also home of the option set every decoding command shares (model, adapter, strategy, sampling),
so `mtp bench`, `mtp serve` and `mtp pipeline` map onto the same flags."""
from __future__ import annotations

import argparse
import json
import sys

from mtp.core.engine import Engine, EngineConfig
from mtp.core.strategy import Strategy


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file, or smollm2-135m (default)")
    p.add_argument("--adapter", default="auto",
                   help="MTP adapter directory; 'auto' = the shipped one for the default model; 'none' = no adapter")
    p.add_argument("--proposer", default="mask",
                   help="where proposals come from: mask (default), mask-single (verify: masks only after the "
                   "last draft), heads, lookup")
    p.add_argument("--heads", default="auto", help="MTP heads checkpoint directory (for --proposer heads)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU float32: oneDNN-packed weights, faster small-block passes (default on)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default="ntp", help="ntp | static:K | conf_adapt:TAU[:KMAX] | verify:K")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template (default on)")


def engine_config(args) -> EngineConfig:
    return EngineConfig(model=args.model, adapter=args.adapter, proposer=args.proposer, heads=args.heads,
                        threads=args.threads, device=args.device, pack=getattr(args, "pack", True))


def add_cli(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--show-chunks", action="store_true", help="colour each forward pass's tokens")
    p.set_defaults(func=run)


def read_prompt(args) -> str:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("empty prompt")
    return prompt


def run(args) -> int:
    Strategy.parse(args.strategy)  # fail on a malformed strategy before loading anything
    prompt = read_prompt(args)
    engine = Engine.load(engine_config(args))
    result = engine.generate(prompt, args.strategy, engine.sampling(args), chat=args.chat)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    if args.show_chunks:
        print(engine.render_chunks(result))
    else:
        print(result.text)
    s = result.summary
    print(f"[{result.strategy}] {len(result.token_ids)} tokens, {s['forward_passes']} passes, "
          f"{s['tokens_per_forward']:.2f} tokens/forward, {s['tokens_per_s']:.1f} tokens/s, "
          f"finish={result.finish_reason}", file=sys.stderr)
    return 0
