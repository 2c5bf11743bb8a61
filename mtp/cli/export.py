"""`mtp export`: write a trained drafter in a format another serving engine loads (vLLM EAGLE-3)."""
from __future__ import annotations

from mtp.core.engine import SHIPPED
from mtp.core.export import FORMATS, export_vllm_eagle3


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a trained drafter for another serving engine (vLLM EAGLE-3)",
                       description="Write an EAGLE-3 drafter directory that vLLM loads unmodified: "
                                   "speculative_config={'method': 'eagle3', 'model': OUT, ...}.")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--drafter", required=True,
                   help="directory written by `mtp train-eagle3`, or 'shipped' (the drafter shipped for SmolLM2-135M)")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    drafter = SHIPPED["smollm2-135m"] / "eagle3" if args.drafter == "shipped" else args.drafter
    cfg = export_vllm_eagle3(drafter, args.out)
    layers = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    print(f"vLLM EAGLE-3 drafter written to {args.out} (layers {layers}, draft vocabulary {cfg['draft_vocab_size']})")
    print(f'  LLM(model=BASE, speculative_config={{"method": "eagle3", "model": "{args.out}", '
          f'"num_speculative_tokens": 3}})')
    return 0
