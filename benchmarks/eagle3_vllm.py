"""EAGLE-3 drafter against the shipped MTP heads in our engine, and the exported drafter inside vLLM,
on the same prompts, greedy, in one run.

    python benchmarks/eagle3_vllm.py --eagle3 DIR --data $MTP_DATA_DIR/gsm8k/test.jsonl|PROMPTS.jsonl [--limit 20]
        [--max-new-tokens 128] [--k 4] [--threads 1] [--vllm] [--out runs/eagle3]

Our engine: per prompt `ntp`, `verify:K --proposer heads` (shipped heads) and `verify:K --proposer eagle3`
decode in turn (order rotated by prompt); each output is checked against ntp's (lossless). Reported:
tokens per pass, acceptance by position, tokens/s. With --vllm (needs `make vllm`): the drafter is
exported (`mtp export --format vllm-eagle3`) and vLLM decodes the same token-id prompts plain and with
`method: eagle3`, K-1 speculative tokens; reported: output identical to vLLM plain (and to our ntp),
vLLM's mean acceptance length (1 + accepted / drafts) and tokens/s. Writes results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from mtp.core.decoding import metrics
from mtp.core.decoding.decode import Sequence
from mtp.core.decoding.proposers.heads import load_heads_proposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.engine import SHIPPED, Engine, EngineConfig
from mtp.eval import gsm8k
from mtp.interop.vllm_env import run_vllm, strip_eos, target_dir
from mtp.interop.vllm_export import export_vllm_eagle3


def read_prompts(path: str, limit: int) -> list[str]:
    """GSM8K lines get `mtp bench`'s GSM8K prompt; other lines their 'prompt' field (e.g. a held-out split)."""
    first = json.loads(open(path, encoding="utf-8").readline())
    if "question" in first:
        return [p["prompt"] for p in gsm8k.load(path, limit)]
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:limit]


def decode(engine, ids, strategy, proposer, max_new):
    seq = Sequence(
        list(ids),
        Strategy.parse(strategy),
        SamplingParams(max_new_tokens=max_new),
        proposer,
        eos_ids=engine.loaded.eos_ids,
    )
    t0 = time.perf_counter()
    for _ in engine.stream(seq):
        pass
    return seq, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eagle3", required=True)
    ap.add_argument("--data", required=True, help="GSM8K JSONL (question/answer), or any JSONL with a 'prompt' field")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--out", default="runs/eagle3")
    args = ap.parse_args()
    engine = Engine.load(EngineConfig(adapter="none", proposer="eagle3", eagle3=args.eagle3, threads=args.threads))
    rows = {
        "ntp": ("ntp", engine.proposer("lookup")),
        f"verify:{args.k} heads": (
            f"verify:{args.k}",
            load_heads_proposer(engine.model, SHIPPED["smollm2-135m"] / "heads"),
        ),
        f"verify:{args.k} eagle3": (f"verify:{args.k}", engine.proposer("eagle3")),
    }
    prompts = [engine.encode(p) for p in read_prompts(args.data, args.limit)]
    decode(engine, prompts[0], "verify:2", rows[f"verify:{args.k} eagle3"][1], 8)  # warm-up
    res = {name: {"chunks": [], "tokens": 0, "wall_s": 0.0, "identical": 0, "outputs": []} for name in rows}
    names = list(rows)
    for i, ids in enumerate(prompts):
        order = names[i % len(names) :] + names[: i % len(names)]
        outs = {}
        for name in order:
            strategy, proposer = rows[name]
            seq, wall = decode(engine, ids, strategy, proposer, args.max_new_tokens)
            r = res[name]
            r["chunks"] += seq.stats.chunks
            r["tokens"] += len(seq.output)
            r["wall_s"] += wall
            outs[name] = seq.output
            r["outputs"].append(seq.output)
        for name in names:
            res[name]["identical"] += int(outs[name] == outs["ntp"])
        print(
            f"prompt {i + 1}/{len(prompts)}: "
            + ", ".join(f"{n} {metrics.tokens_per_forward(res[n]['chunks']):.2f}" for n in names),
            file=sys.stderr,
            flush=True,
        )
    table = {}
    for name, r in res.items():
        table[name] = {
            "tokens_per_pass": round(metrics.tokens_per_forward(r["chunks"]), 4),
            "acceptance_by_position": [round(a, 4) for a in metrics.acceptance_by_position(r["chunks"], args.k)],
            "tokens_per_s": round(r["tokens"] / r["wall_s"], 2),
            "identical_to_ntp": r["identical"],
            "prompts": len(prompts),
        }
    out = {"args": vars(args), "engine": table}
    if args.vllm:
        with tempfile.TemporaryDirectory() as tmp:
            export_vllm_eagle3(args.eagle3, Path(tmp) / "vllm")
            recs = run_vllm(
                target_dir(),
                prompts,
                args.max_new_tokens,
                [
                    {"name": "vllm"},
                    {
                        "name": "vllm-eagle3",
                        "speculative_config": {
                            "method": "eagle3",
                            "model": str(Path(tmp) / "vllm"),
                            "num_speculative_tokens": args.k - 1,
                        },
                    },
                ],
                log=lambda e: (
                    Path(args.out).mkdir(parents=True, exist_ok=True) or (Path(args.out) / "vllm.log").write_text(e)
                ),
            )
        eos = set(engine.loaded.eos_ids)
        plain = [strip_eos(o, eos) for o in recs[0]["outputs"]]
        for rec in recs:
            outs = [strip_eos(o, eos) for o in rec["outputs"]]
            rec["identical_to_vllm_plain"] = sum(a == b for a, b in zip(outs, plain))
            rec["identical_to_our_ntp"] = sum(a == b for a, b in zip(outs, res["ntp"]["outputs"]))
            rec.pop("outputs")
        out["vllm"] = recs
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({"engine": table, "vllm": out.get("vllm")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
