"""The exported EAGLE-3 drafter served by vLLM across processes: tensor and pipeline parallel.

Exports `--eagle3` (`mtp export --format vllm-eagle3`) and runs vLLM (`.venv-vllm`, `make vllm`)
on the same token-id prompts, greedy, once per configuration: plain, eagle3 and ngram at tensor
parallel 1 and 3 (SmolLM2's 9 attention heads allow 1, 3, 9) and plain and eagle3 at pipeline
parallel 2. Each configuration is a fresh vLLM (its own worker processes). Reported per
configuration: output identical to plain TP 1 on every prompt, vLLM's mean acceptance length,
tokens/s, or the error vLLM stopped with. Writes results.json.

    python benchmarks/vllm_distributed.py --eagle3 DIR --data $MTP_DATA_DIR/gsm8k/test.jsonl --limit 3 \\
        --max-new-tokens 64 --out benchmarks/results/vllm_distributed
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from eagle3_vllm import read_prompts

from mtp.core.engine import Engine, EngineConfig
from mtp.interop.vllm_env import run_vllm, strip_eos, target_dir
from mtp.interop.vllm_export import export_vllm_eagle3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eagle3", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="verify:K: K-1 speculative tokens")
    ap.add_argument("--configs", default="", help="only these, e.g. 'plain tp1 pp1,eagle3 tp3 pp1' (default: all)")
    ap.add_argument("--out", default="runs/vllm_distributed")
    args = ap.parse_args()
    engine = Engine.load(EngineConfig(adapter="none"))
    prompts = [engine.encode(p) for p in read_prompts(args.data, args.limit)]
    eos = set(engine.loaded.eos_ids)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        drafter = Path(tmp) / "vllm"
        export_vllm_eagle3(args.eagle3, drafter)
        eagle3 = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": args.k - 1}
        ngram = {
            "method": "ngram",
            "num_speculative_tokens": args.k - 1,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        }
        configs = [
            ("plain", None, 1, 1),
            ("eagle3", eagle3, 1, 1),
            ("plain", None, 3, 1),
            ("eagle3", eagle3, 3, 1),
            ("ngram", ngram, 3, 1),
            ("plain", None, 1, 2),
            ("eagle3", eagle3, 1, 2),
        ]
        wanted = {c.strip() for c in args.configs.split(",") if c.strip()}
        if wanted:
            configs = [c for c in configs if f"{c[0]} tp{c[2]} pp{c[3]}" in wanted]
        recs, logs = [], []
        for method, spec, tp, pp in configs:  # one vLLM process tree per configuration
            name = f"{method} tp{tp} pp{pp}"
            print(f"{name} ...", file=sys.stderr, flush=True)
            try:
                rec = run_vllm(
                    target_dir(),
                    prompts,
                    args.max_new_tokens,
                    [
                        {
                            "name": name,
                            "speculative_config": spec,
                            "tensor_parallel_size": tp,
                            "pipeline_parallel_size": pp,
                        }
                    ],
                    log=logs.append,
                    allow_errors=True,
                    timeout=1200,
                )[0]
            except Exception as e:  # the runner itself died (e.g. a worker crash): that is the result
                rec = {"name": name, "error": f"{type(e).__name__}: {e}"}
            rec.update(method=method, tensor_parallel_size=tp, pipeline_parallel_size=pp)
            recs.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "outputs"}), file=sys.stderr, flush=True)
    (out / "vllm.log").write_text("\n".join(logs))
    base = [strip_eos(o, eos) for o in recs[0].get("outputs", [])]
    for rec in recs:
        if "outputs" in rec:
            outs = [strip_eos(o, eos) for o in rec.pop("outputs")]
            rec["identical_to_plain_tp1"] = f"{sum(a == b for a, b in zip(outs, base))}/{len(base)}"
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": recs}, indent=1))
    print("| configuration | identical to plain TP 1 | mean acceptance length | tokens/s | error |")
    print("|---|---|---|---|---|")
    for r in recs:
        print(
            f"| {r['name']} | {r.get('identical_to_plain_tp1', '—')} | {r.get('mean_acceptance_length') or '—'} "
            f"| {r.get('tokens_per_s', '—')} | {r.get('error', '')} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
