"""How far SmolLM2-135M's greedy text moves when its projections and LM head run on mtp's small-row
kernels (`mtp.core.runtime.kernels`) instead of today's float32 `F.linear`, per activation mode:

  torch     today's path (the loader's float32 weights, F.linear)
  f32act    the kernels on the GGUF blocks as stored, float32 activations (exact weights; only the
            reduction order differs from torch)
  int8      the kernels with int8 activations per row per 32-block (linear_int8)
  int8-nohead  int8 activations in the projections, float32 activations in the LM head

    python benchmarks/kernel_text_drift.py --tokens 64 --out /tmp/kernel_text_drift.json

For each prompt: greedy continuations under each mode, the first position where a mode's tokens leave
torch's, and (teacher-forced on torch's continuation) the share of positions whose top-1 token agrees
and the largest |logit difference|. Also the time of one M=1 decoding pass per mode. The model is not
changed on disk: each `Linear`'s forward is replaced in this process only (the wiring the next
milestone puts into mtp/core/runtime/model.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp.core.decoding.decode import generate
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.runtime import kernels
from mtp.core.runtime.cache import KVCache
from mtp.core.runtime.kernels.qlinear import gguf_weights, linear, linear_int8
from mtp.core.runtime.loading import load, resolve
from mtp.core.runtime.model import Linear

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a prime number is.",
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?"
    ),
    "Give me three tips for learning a new language.",
    "Translate 'good morning' into Spanish and German.",
]


def install(model, weights: dict, mode: str) -> int:
    """Point every Linear at the kernels (mode f32act / int8) or back at F.linear (torch)."""
    n = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear):
            continue
        if mode == "torch":
            mod.__dict__.pop("forward", None)
            continue
        kw = weights[f"{name}.weight"]
        if mode == "f32act" and not torch.equal(kw.dequantize(), mod.weight):
            raise SystemExit(f"{name}: the kernel weight does not dequantise to the loader's float32 values")
        fn = (
            linear
            if mode == "f32act" or kw.fmt == "f32" or (mode == "int8-nohead" and name == "lm_head")
            else linear_int8
        )

        def forward(x, gate=None, kw=kw, fn=fn, bias=mod.bias):
            return fn(x, kw, bias)

        mod.forward = forward
        n += 1
    return n


def teacher_forced(model, ids: list[int], n_prompt: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0, n_prompt - 1 : -1].float()


def pass_ms(model, ctx: int = 64, reps: int = 20) -> float:
    """Median ms of one M=1 decoding pass (KV cache holding `ctx` positions)."""
    cache = KVCache.for_model(model, 1, ctx + 1)
    tok = torch.tensor([[1]])
    times = []
    with torch.inference_mode():
        model(torch.ones(1, ctx, dtype=torch.long), cache=cache)
        for _ in range(reps):
            t0 = time.perf_counter()
            model(tok, positions=torch.tensor([[ctx]]), cache=cache)
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def decode_modes(loaded, weights, args, report: dict) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Per mode: its M=1 pass time (into `report`), and (prompt ids, greedy continuation) of every prompt."""
    model, tok = loaded.model, loaded.tokenizer
    params = SamplingParams(max_new_tokens=args.tokens)
    outs = {}
    for mode in args.modes:
        install(model, weights, mode)
        report["pass_ms"][mode] = pass_ms(model)
        outs[mode] = []
        for prompt in PROMPTS[: args.prompts]:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            seq = generate(model, ids, "ntp", params, eos_ids=loaded.eos_ids)
            outs[mode].append((ids, list(seq.output)))
    return outs


def compare(loaded, weights, modes: list[str], outs: dict, i: int, ids: list[int], ref_out: list[int]) -> dict:
    """Prompt i's continuation in each mode against the reference `ref_out`: where it first diverges, its
    text, and teacher-forced on the reference, its top-1 agreement and largest logit difference with the
    torch (else the first) mode's."""
    model, tok = loaded.model, loaded.tokenizer
    row = {"prompt": PROMPTS[i], "modes": {}}
    forced = {}
    for mode in modes:
        install(model, weights, mode)
        forced[mode] = teacher_forced(model, ids + ref_out, len(ids)) if ref_out else None
    for mode in modes:
        out = outs[mode][i][1]
        diverge = next(
            (j for j, (a, b) in enumerate(zip(out, ref_out)) if a != b),
            None if len(out) == len(ref_out) else min(len(out), len(ref_out)),
        )
        entry = {
            "first_divergence": diverge,
            "identical": out == ref_out,
            "text": tok.decode(out, skip_special_tokens=True),
        }
        if forced[mode] is not None:
            base = forced[modes[0] if "torch" not in forced else "torch"]
            entry["top1_agree"] = float((forced[mode].argmax(-1) == base.argmax(-1)).float().mean())
            entry["max_abs_logit_diff"] = float((forced[mode] - base).abs().max())
        row["modes"][mode] = entry
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--modes", nargs="+", default=["torch", "f32act", "int8"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not kernels.load():
        sys.exit(f"kernel_text_drift: the kernels are not available ({kernels.why_unavailable()})")
    loaded = load("smollm2-135m")
    weights = gguf_weights(resolve("smollm2-135m"))
    report = {
        "threads": args.threads,
        "tokens": args.tokens,
        "isa": kernels.ISA_NAMES[kernels.resolve_isa()],
        "pass_ms": {},
        "prompts": [],
    }
    outs = decode_modes(loaded, weights, args, report)
    ref = outs.get("torch") or outs[args.modes[0]]
    for i, (ids, ref_out) in enumerate(ref):
        report["prompts"].append(compare(loaded, weights, args.modes, outs, i, ids, ref_out))
    install(loaded.model, weights, "torch")
    for mode in args.modes:
        rows = [r["modes"][mode] for r in report["prompts"]]
        same = sum(r["identical"] for r in rows)
        agree = [r.get("top1_agree", 1.0) for r in rows]
        div = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
        print(
            f"{mode:>7}: pass {report['pass_ms'][mode]:.2f} ms (M=1, {args.threads} thread(s)); "
            f"{same}/{len(rows)} continuations identical to torch; first divergence at tokens {div or '-'}; "
            f"teacher-forced top-1 agreement {min(agree):.3f}..{max(agree):.3f} (mean {sum(agree) / len(agree):.3f}); "
            f"max |dlogit| {max(r.get('max_abs_logit_diff', 0.0) for r in rows):.3g}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
