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

from mtp.core.engine import Engine, EngineConfig
from mtp.eval.bench import load_data
from mtp.eval.peers import llamacpp_tokens_per_pass, make_peer, parse_baselines
from mtp.interop.llamacpp_env import environment


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--export", required=True, help="an `mtp export --format llamacpp` folder")
    p.add_argument("--data", required=True)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ours", help="an `mtp tune` results.json holding verify:4@eagle3")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    engine = Engine.load(EngineConfig(threads=a.threads))
    _, items = load_data(a.data, a.limit)
    prompts = [engine.encode(it["prompt"], chat=True) for it in items]
    # the `mtp bench` peers: they read the export folder, start llama-server, cut at EOS and keep the timings
    names = parse_baselines(f"llamacpp-server:{a.export},llamacpp-server-eagle3:{a.export}")
    plain, spec = (make_peer(n) for n in names)
    for peer in (plain, spec):
        peer.setup(engine)
    records, started = [], time.perf_counter()
    try:
        for n, ids in enumerate(prompts):
            rec = {"prompt": n}
            for name, peer in [("plain", plain), ("eagle3", spec)][:: 1 if n % 2 == 0 else -1]:
                t0 = time.perf_counter()
                rec[name] = {
                    "ids": peer.generate(ids, a.max_new_tokens),
                    "timings": peer.timings[-1],
                    "wall_s": time.perf_counter() - t0,
                }
            rec["identical"] = rec["plain"]["ids"] == rec["eagle3"]["ids"]
            records.append(rec)
            t = rec["eagle3"]["timings"]
            print(
                f"{n + 1}/{len(prompts)}: {len(rec['plain']['ids'])} tokens, identical {rec['identical']}, accepted "
                f"{t.get('draft_n_accepted')}/{t.get('draft_n')} [{time.perf_counter() - started:.0f}s]",
                flush=True,
            )
    finally:
        for peer in (plain, spec):
            peer.server.close()

    timings = [r["eagle3"]["timings"] for r in records]
    wall = {k: sum(r[k]["wall_s"] for r in records) for k in ("plain", "eagle3")}
    toks = {k: sum(len(r[k]["ids"]) for r in records) for k in ("plain", "eagle3")}
    summary = {
        "data": a.data,
        "prompts": len(records),
        "max_new_tokens": a.max_new_tokens,
        "threads": a.threads,
        "draft_max": spec.draft_max,
        "identical": sum(r["identical"] for r in records),
        "tokens_per_pass": llamacpp_tokens_per_pass(timings),
        "drafts": sum(t.get("draft_n", 0) for t in timings),
        "accepted": sum(t.get("draft_n_accepted", 0) for t in timings),
        "tokens_per_s": {k: toks[k] / wall[k] for k in wall},
        "environment": environment(),
    }
    if a.ours:
        mine = [r for r in json.loads(Path(a.ours).read_text())["rows"] if r["name"] == "verify:4@eagle3"]
        if mine:
            summary["ours_tokens_per_pass"] = mine[0]["tokens_per_forward"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"summary": summary, "records": records}, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "environment"}))


if __name__ == "__main__":
    main()
