"""The options every decoding command shares (`generate`, `bench`, `serve`, `tune`, `pipeline`, and a
pipeline stage under torchrun) and what they build, all checked before a model loads: a bad flag costs
a one-line error (`mtp.cli.errors`), never a load."""

from __future__ import annotations

import argparse
import sys

from mtp.core.decoding.proposers import AUTO, REGISTRY, SHIPPED_DEFAULT, check_proposer, resolve_default
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import USAGE, Strategy
from mtp.core.engine import EngineConfig
from mtp.core.runtime import kernels
from mtp.core.runtime.checks import check_device, check_threads, valid_text
from mtp.core.runtime.loading import model_context
from mtp.core.runtime.weights import QUANTIZE, check_weights


def add_model_args(p: argparse.ArgumentParser, proposer_default: str = "mask") -> None:
    """proposer_default: `auto` for generate and serve (`mtp.core.decoding.proposers.resolve_default`)."""
    p.add_argument("--model", default="smollm2-135m", help="HF directory, .gguf file, or smollm2-135m (default)")
    p.add_argument(
        "--adapter",
        default="auto",
        help="MTP adapter directory; 'auto' = the shipped one for the default model; 'none' = no adapter",
    )
    auto = ", ".join(f"{m}: {v}" for m, v in SHIPPED_DEFAULT.items())
    p.add_argument(
        "--proposer",
        default=proposer_default,
        help="where proposals come from: mask, mask-single (verify: masks only after the "
        "last draft), heads, eagle3, lookup, suffix, a merge such as eagle3+suffix+lookup, or auto "
        f"(the shipped model's fastest measured merge ({auto}), else mask); default {proposer_default}",
    )
    p.add_argument("--heads", default="auto", help="MTP heads checkpoint directory (for --proposer heads)")
    p.add_argument("--eagle3", default="auto", help="EAGLE-3 drafter directory (for --proposer eagle3)")
    p.add_argument(
        "--datastore", default="auto", help="suffix datastore directory (for --proposer suffix; `mtp datastore build`)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument(
        "--weights",
        default="native",
        help="what runs the model on CPU: native (default; the GGUF's own Q4_1/Q8_0 blocks on mtp's "
        "batch-invariant kernels, float32 where the model has no blocks; the float32 model's exact "
        "arithmetic), native-int8 (the same blocks with int8 activations: faster, other text), float32 (the "
        "kernels on float32 weights), torch (oneDNN-packed float32, not batch-invariant)",
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZE,
        default=None,
        help="quantise a float32 (safetensors) checkpoint's linears to these GGUF blocks at load, so --weights "
        "native runs them (the model becomes the quantised model on every path); GGUF models are blocks already",
    )
    p.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prepare the weights for CPU inference as --weights says (default on; --no-pack: plain torch)",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    strategies = USAGE.removeprefix("expected one of: ").replace(", ", " | ")
    p.add_argument("--strategy", default="ntp", help=f"{strategies} (default %(default)s)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="the most tokens to generate (default %(default)s)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply the model's chat template (default on)",
    )


def engine_config(args) -> EngineConfig:
    """The engine the flags describe, checked (proposer, threads, device) before anything loads;
    `--proposer auto` resolved for the model (and kept in args: later checks read the real name)."""
    kernels.check_isa_env()
    off = tuple(k for k in ("heads", "eagle3", "datastore") if getattr(args, k, "auto") in (None, "", "none"))
    args.proposer = resolve_default(args.proposer, args.model, off) if args.proposer == AUTO else args.proposer
    spec = check_proposer(args.proposer)
    for part in spec.parts or (args.proposer,):  # an asset the user turned off is named as such
        asset = REGISTRY[part].asset
        if asset in off:
            raise ValueError(
                f"--proposer {args.proposer} needs --{asset} DIR, but --{asset} is "
                f"{getattr(args, asset)!r} (that turns {asset} off)"
            )
    return EngineConfig(
        model=args.model,
        adapter=args.adapter,
        proposer=args.proposer,
        heads=args.heads,
        eagle3=getattr(args, "eagle3", "auto"),
        datastore=getattr(args, "datastore", "auto"),
        threads=check_threads(args.threads),
        device=check_device(args.device),
        pack=getattr(args, "pack", True),
        weights=check_weights(getattr(args, "weights", "native")),
        quantize=getattr(args, "quantize", None),
    )


def sampling_params(args) -> SamplingParams:
    """SamplingParams from the flags (its checks are the server's too); stop strings valid UTF-8;
    `--max-new-tokens` below 1 is named as the flag."""
    stop = [valid_text(s, f"--stop string {s!r}") for s in args.stop or []]
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=stop,
    )


def check_context(args) -> None:
    """`--max-new-tokens` against the model's context window, read from its config or GGUF header
    without loading weights (a prompt takes at least one token of it): for the commands where it is an
    exact limit (generate, bench, pipeline), not a per-request cap clamped to the window (serve)."""
    if getattr(args, "max_new_tokens", None) is None:
        return
    context = model_context(args.model)
    if context is not None and args.max_new_tokens >= context:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} does not fit the context window of {args.model} "
            f"({context} tokens, prompt included): at most {context - 1}"
        )


def check_decoding_args(args) -> Strategy:
    """Every decoding flag, before the model loads: strategy (K capped), sampling, engine flags. (A command
    whose `--max-new-tokens` is an exact limit, not a cap clamped to the window as `serve`'s, also calls
    `check_context`.)"""
    strategy = Strategy.parse(args.strategy)
    sampling_params(args)
    engine_config(args)
    return strategy


def read_prompt(args) -> str:
    """The positional prompt, or stdin (decoded as UTF-8, strictly)."""
    if args.prompt is not None:
        prompt = args.prompt
    else:
        raw = getattr(sys.stdin, "buffer", None)
        try:
            prompt = raw.read().decode("utf-8") if raw is not None else sys.stdin.read()
        except UnicodeDecodeError:
            raise ValueError("the prompt read from stdin is not valid UTF-8 text") from None
    prompt = valid_text(prompt)
    if not prompt.strip():
        raise ValueError("empty prompt")
    return prompt
