"""llama-server with mtp's EAGLE-3 drafter against llama-server plain, on a whole prompt set: is the
speculative text identical to the plain text, and how many tokens does each target pass make?

    make llamacpp
    mtp export --format llamacpp --drafter shipped --outtype f32 --out runs/llamacpp/export-f32
    python benchmarks/llamacpp_acceptance.py --export runs/llamacpp/export-f32 \
        --data gsm8k:$MTP_DATA_DIR/gsm8k/test.jsonl --limit 100 --out runs/llamacpp/acceptance-gsm8k100.json
    python benchmarks/llamacpp_acceptance.py --export runs/llamacpp/export-f32 \
        --data prompts:benchmarks/results/final/diverse60.jsonl --limit 60 --out runs/llamacpp/acceptance-diverse60.json

Both servers run side by side (one thread each, one slot), every prompt on both, the order alternating per
prompt. Prompts are the chat-formatted token ids `mtp bench` sends; greedy; `--max-new-tokens` (256, as the
tune and trees runs). Tokens per pass come from llama-server's own timings, as in `mtp bench`
(`mtp.eval.peers.llamacpp_tokens_per_pass`). `--ours RESULTS` (an `mtp tune` run's results.json) prints mtp's
own `verify:4@eagle3` tokens/pass on the same prompts beside it. Writes per-prompt records to --out.
"""
import argparse
import json
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--export", required=True, help="an `mtp export --format llamacpp` folder")
p.add_argument("--data", required=True)
p.add_argument("--limit", type=int, default=100)
p.add_argument("--max-new-tokens", type=int, default=256)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--ours", help="an `mtp tune` results.json holding verify:4@eagle3")
p.add_argument("--out", required=True)
a = p.parse_args()

from mtp.core.engine import Engine, EngineConfig  # noqa: E402
from mtp.eval.bench import load_data  # noqa: E402
from mtp.eval.llamacpp_env import environment  # noqa: E402
from mtp.eval.llamacpp_server import LlamaServer  # noqa: E402
from mtp.eval.peers import LLAMACPP_DRAFTS, llamacpp_tokens_per_pass  # noqa: E402

export = Path(a.export)
man = json.loads((export / "export.json").read_text())
engine = Engine.load(EngineConfig(threads=a.threads))
eos = set(engine.loaded.eos_ids)
_, items = load_data(a.data, a.limit)
prompts = [engine.encode(it["prompt"], chat=True) for it in items]


def cut(ids):
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


draft_max = int(man.get("draft_tokens", LLAMACPP_DRAFTS))
plain = LlamaServer(str(export / man["target"]), None, threads=a.threads, ctx=engine.context_window)
spec = LlamaServer(str(export / man["target"]), "eagle3", str(export / man["drafter"]), threads=a.threads,
                   ctx=engine.context_window, draft_max=draft_max)
records, started = [], time.perf_counter()
with plain, spec:
    for n, ids in enumerate(prompts):
        order = [("plain", plain), ("eagle3", spec)][:: 1 if n % 2 == 0 else -1]
        rec = {"prompt": n}
        for name, server in order:
            t0 = time.perf_counter()
            out = server.complete(ids, a.max_new_tokens)
            rec[name] = {"ids": cut(out["ids"]), "timings": out["timings"], "wall_s": time.perf_counter() - t0}
        rec["identical"] = rec["plain"]["ids"] == rec["eagle3"]["ids"]
        records.append(rec)
        print(f"{n + 1}/{len(prompts)}: {len(rec['plain']['ids'])} tokens, identical {rec['identical']}, "
              f"accepted {rec['eagle3']['timings'].get('draft_n_accepted')}/{rec['eagle3']['timings'].get('draft_n')}"
              f" [{time.perf_counter() - started:.0f}s]", flush=True)

timings = [r["eagle3"]["timings"] for r in records]
tpp = llamacpp_tokens_per_pass(timings)
drafts = sum(t.get("draft_n", 0) for t in timings)
accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
wall = {k: sum(r[k]["wall_s"] for r in records) for k in ("plain", "eagle3")}
toks = {k: sum(len(r[k]["ids"]) for r in records) for k in ("plain", "eagle3")}
summary = {"data": a.data, "prompts": len(records), "max_new_tokens": a.max_new_tokens, "threads": a.threads,
           "draft_max": draft_max, "identical": sum(r["identical"] for r in records),
           "tokens_per_pass": tpp, "drafts": drafts, "accepted": accepted,
           "tokens_per_s": {k: toks[k] / wall[k] for k in wall}, "environment": environment()}
if a.ours:
    mine = [r for r in json.loads(Path(a.ours).read_text())["rows"] if r["name"] == "verify:4@eagle3"]
    if mine:
        summary["ours_tokens_per_pass"] = mine[0]["tokens_per_forward"]
Path(a.out).parent.mkdir(parents=True, exist_ok=True)
Path(a.out).write_text(json.dumps({"summary": summary, "records": records}, indent=1))
print(json.dumps({k: v for k, v in summary.items() if k != "environment"}))
