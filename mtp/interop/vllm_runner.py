"""Run vLLM on token-id prompts and print one JSON object per configuration (a script, not a module).

vLLM pins its own torch and transformers, so it lives in its own environment (`make vllm` builds
`.venv-vllm`) and mtp talks to it through this file, run by that environment's python:

    .venv-vllm/bin/python mtp/interop/vllm_runner.py JOB.json

JOB.json: {"model": HF_DIR, "prompts": [[ids], ...], "max_tokens": N, "runs": [{"name": str,
"speculative_config": {...} | null, "tensor_parallel_size": 1, "pipeline_parallel_size": 1}, ...]}.
Output, one line per run (or {"name", "error"} for a configuration vLLM refuses or fails on):
{"name", "outputs": [[ids], ...], "wall_s", "tokens_per_s", "drafts", "draft_tokens", "accepted",
"accepted_per_pos", "mean_acceptance_length"} (mean acceptance length = 1 + accepted / drafts, the
number vLLM's spec-decode metrics define). It imports nothing from mtp.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

# run as a script, its folder (mtp/eval) heads sys.path: drop it, so `vllm` is the package, not a file here
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402  (after the settings above, which vLLM reads on import)
from vllm.inputs import TokensPrompt  # noqa: E402


def spec_metrics(llm) -> dict:
    """vLLM's spec-decode counters (cumulative over this LLM's life)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    try:
        metrics = llm.get_metrics()
    except Exception:  # an older vLLM without get_metrics: no acceptance numbers
        return out
    for m in metrics:
        name = getattr(m, "name", "")
        if name == "vllm:spec_decode_num_drafts":
            out["drafts"] = int(m.value)
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in getattr(m, "values", [])]
    return out


def llm_kwargs(job: dict, spec: dict, max_num_seqs: int) -> dict:
    """LLM(...) arguments of one configuration: greedy-exact float32, eager, optional speculative
    config, tensor/pipeline parallel sizes (the CPU runner needs graph mode with the eager backend
    for pipeline parallel)."""
    pp = spec.get("pipeline_parallel_size", 1)
    kwargs = dict(
        model=job["model"],
        dtype="float32",
        max_model_len=job.get("max_model_len", 1024),
        max_num_seqs=max_num_seqs,
        enforce_eager=pp == 1,
        disable_log_stats=False,
        seed=0,
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        pipeline_parallel_size=pp,
    )
    if pp > 1:
        kwargs["compilation_config"] = {"mode": 2, "backend": "eager"}
    if spec.get("speculative_config"):
        kwargs["speculative_config"] = spec["speculative_config"]
    return kwargs


def run(job: dict, spec: dict) -> dict:
    llm = LLM(**llm_kwargs(job, spec, job.get("max_num_seqs", 4)))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=job.get("ignore_eos", False))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    before = spec_metrics(llm)
    t0 = time.perf_counter()
    outs = []
    for p in prompts:  # one at a time, as our engine's rows are measured
        outs.append(list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids))
    wall = time.perf_counter() - t0
    after = spec_metrics(llm)
    m = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    per_pos = [
        a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
        for i, a in enumerate(after["accepted_per_pos"])
    ]
    del llm
    gc.collect()
    n = sum(len(o) for o in outs)
    return {
        "name": spec["name"],
        "outputs": outs,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(n / wall, 3) if wall > 0 else 0.0,
        **m,
        "accepted_per_pos": per_pos,
        "mean_acceptance_length": round(1 + m["accepted"] / m["drafts"], 4) if m["drafts"] else None,
    }


def serve(job: dict) -> int:
    """`--serve JOB.json`: load one configuration (job["runs"][0]), then answer stdin lines
    {"prompt_ids": [...], "max_tokens": N} with {"ids": [...], "drafts", "accepted"} (cumulative counters),
    one line each, until stdin closes. Used by the vLLM peers of `mtp bench` (one load, many prompts)."""
    llm = LLM(**llm_kwargs(job, job["runs"][0], 1))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"])
        out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt_ids"])], params, use_tqdm=False)
        m = spec_metrics(llm)
        print(
            json.dumps({"ids": list(out[0].outputs[0].token_ids), "drafts": m["drafts"], "accepted": m["accepted"]}),
            flush=True,
        )
    return 0


def main() -> int:
    if sys.argv[1] == "--serve":
        with open(sys.argv[2]) as f:
            return serve(json.load(f))
    with open(sys.argv[1]) as f:
        job = json.load(f)
    for spec in job["runs"]:
        try:
            rec = run(job, spec)
        except Exception as e:  # a configuration vLLM cannot run is a result too: report it, go on
            rec = {
                "name": spec["name"],
                "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
            }
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
