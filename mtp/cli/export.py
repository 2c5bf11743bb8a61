"""`mtp export`: write a trained drafter in a format another serving engine loads: vLLM's EAGLE-3 folder
(`vllm-eagle3`), or llama.cpp's GGUF pair, target model and drafter (`llamacpp`, needs `make llamacpp`)."""

from __future__ import annotations

import shlex

from mtp.core.decoding.proposers.eagle3 import read_drafter_config
from mtp.core.engine import SHIPPED
from mtp.core.runtime import loading
from mtp.interop import llamacpp_env
from mtp.interop.llamacpp_export import (
    DRAFT_TOKENS,
    OUTTYPES,
    check_drafter_for,
    check_outtype,
    check_p_min,
    export_llamacpp,
)
from mtp.interop.vllm_export import FORMATS, export_vllm_eagle3, refuse_heads

LLAMACPP = "llamacpp"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a trained drafter for another serving engine (vLLM, llama.cpp)",
        description="Write an EAGLE-3 drafter directory that vLLM loads unmodified "
        "(speculative_config={'method': 'eagle3', 'model': OUT, ...}), or with "
        "--format llamacpp the target model and drafter as GGUF files for "
        "llama-server --spec-type draft-eagle3 (OUT/README.md has the command).",
    )
    p.add_argument("--format", required=True, choices=FORMATS + (LLAMACPP,))
    p.add_argument(
        "--drafter",
        required=True,
        help="directory written by `mtp train-eagle3`, or 'shipped' (the drafter shipped for SmolLM2-135M)",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--model",
        default=loading.DEFAULT_MODEL,
        help="llamacpp: the target model the drafter was trained on (default %(default)s)",
    )
    p.add_argument(
        "--outtype",
        default="f32",
        help=f"llamacpp: GGUF weight type, one of {', '.join(OUTTYPES)} (default %(default)s)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=DRAFT_TOKENS,
        help="llamacpp: drafts per step in the llama-server command (--spec-draft-n-max, default "
        "%(default)s; 1 pays best where a pass over more tokens costs much more, as on 2 cores)",
    )
    p.add_argument(
        "--draft-p-min",
        type=float,
        default=None,
        help="llamacpp: --spec-draft-p-min in the llama-server command (drafting stops below this draft "
        "probability; default llama.cpp's; `mtp bench --profile` advises one)",
    )
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    drafter = SHIPPED["smollm2-135m"] / "eagle3" if args.drafter == "shipped" else args.drafter
    refuse_heads(drafter)  # before any model loads
    if args.format == LLAMACPP:
        return run_llamacpp(args, drafter)
    cfg = export_vllm_eagle3(drafter, args.out)
    layers = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    print(f"vLLM EAGLE-3 drafter written to {args.out} (layers {layers}, draft vocabulary {cfg['draft_vocab_size']})")
    print(
        f'  LLM(model=BASE, speculative_config={{"method": "eagle3", "model": "{args.out}", '
        f'"num_speculative_tokens": 3}})'
    )
    return 0


def run_llamacpp(args, drafter) -> int:
    check_outtype(args.outtype)
    if not 1 <= args.draft_tokens <= 16:
        raise ValueError(f"--draft-tokens must be 1..16, got {args.draft_tokens}")
    check_p_min(args.draft_p_min)
    read_drafter_config(drafter)  # not a drafter: refused before the model loads
    loaded = loading.load(args.model)
    check_drafter_for(loaded, drafter)
    if llamacpp_env.converter() is None or llamacpp_env.converter_python() is None:
        raise ValueError(
            llamacpp_env.missing() or f"llama.cpp's converter environment is missing ({llamacpp_env.HINT})"
        )
    man = export_llamacpp(
        loaded,
        drafter,
        args.out,
        args.outtype,
        llamacpp_env.converter(),
        llamacpp_env.converter_python(),
        llamacpp_env.VERSION,
        tuple(llamacpp_env.run_flags()),
        args.draft_tokens,
        args.draft_p_min,
    )
    print(
        f"llama.cpp GGUF files written to {args.out}: {man['target']}, {man['drafter']} "
        f"(layers {man['aux_layers']}, draft vocabulary {man['draft_vocab']})"
    )
    print(f"  cd {shlex.quote(str(args.out))} && {shlex.join(man['server'])}")
    return 0
