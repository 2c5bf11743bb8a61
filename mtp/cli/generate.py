"""`mtp generate`: decode one prompt with a strategy and print the text and its metrics."""

from __future__ import annotations

import json
import sys

import jinja2

from mtp.cli.options import (
    add_model_args,
    add_sampling_args,
    check_context,
    check_decoding_args,
    engine_config,
    read_prompt,
    sampling_params,
)
from mtp.core.decoding.proposers import AUTO
from mtp.core.engine import Engine
from mtp.core.runtime.loading import chat_template_file


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    add_model_args(p, AUTO)  # the shipped model: its best measured merge (mtp.core.decoding.proposers)
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--show-chunks", action="store_true", help="colour each forward pass's tokens")
    p.set_defaults(func=run)


def run(args) -> int:
    check_decoding_args(args)  # every flag before loading anything
    check_context(args)  # --max-new-tokens against the model's window (its config or GGUF header)
    prompt = read_prompt(args)
    engine = Engine.load(engine_config(args))
    try:
        result = engine.generate(prompt, args.strategy, sampling_params(args), chat=args.chat)
    except jinja2.TemplateError as e:  # rendered once at load; this prompt makes it fail
        raise ValueError(
            f"{chat_template_file(engine.loaded.source)}: the chat template fails on this "
            f"prompt ({type(e).__name__}: {e})"
        ) from None
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    if args.show_chunks:
        print(engine.render_chunks(result))
    else:
        print(result.text)
    s = result.summary
    print(
        f"[{result.strategy}] {len(result.token_ids)} tokens, {s['forward_passes']} passes, "
        f"{s['tokens_per_forward']:.2f} tokens/forward, {s['tokens_per_s']:.1f} tokens/s, "
        f"finish={result.finish_reason}",
        file=sys.stderr,
    )
    return 0
