"""MTP's value as pipeline link latency grows (issue 7): tokens/s and the speedup over `ntp` for
each (stages, link delay, strategy), measured in one run, with the cost model's prediction beside.

Protocol: one pipeline session per stage count (`mtp.pipeline.stages.launch_local`). The link delay
travels in every message header, so the same processes serve every delay, and stage 0 interleaves
all (delay, strategy) pairs prompt by prompt, the order rotated each round, so drift (other jobs
on shared cores) falls on all points alike; one untimed warm-up first. Greedy decoding: every delay
yields the same tokens and passes, only time changes. tokens/s counts the decoding after the
prompt pass (the prefill is the same for every strategy).

Prediction: every pass at delay 0 is timed (stage 0's forward call, all stages included), giving a
`mtp.core.policy.costmodel.CostModel` t(q) of the pipeline over block size q; at delay D a run is predicted to
take sum over its passes of [t(q) + pipeline_comm_time(P, D)] plus its measured non-forward time at
delay 0 (proposing, accepting), and the predicted speedup is the ratio of those to ntp's.

    python benchmarks/pipeline_latency.py --out runs/pipeline            # the full sweep
    python benchmarks/pipeline_latency.py --stages 2 --delays 0,5 --prompts 1 --max-new-tokens 16
    python benchmarks/pipeline_latency.py --predict stages=8,latency_ms=0.5,pass_ms=40,tokens_per_pass=3

Writes results.jsonl, summary.json and speedup_vs_latency.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from mtp.core.decoding import metrics
from mtp.core.decoding.decode import Sequence, stream
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.policy import costmodel
from mtp.pipeline import pricing
from mtp.pipeline.launch import launch_local
from mtp.pipeline.stages import run_stage
from mtp.pipeline.transport import PipelineConfig

PROMPTS = [  # fixed, GSM8K-style (the task the adapter is distilled on)
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "A baker makes 24 muffins per tray and bakes 5 trays. He sells 96 muffins. How many are left?",
    "Tom has 3 boxes with 12 pencils each. He gives 10 pencils to his sister. How many pencils does he have now?",
    "A train travels 60 km per hour for 3 hours and then 40 km per hour for 2 hours. How far does it go?",
]


class TimedModel:
    """Wraps the pipeline model and records (block tokens, seconds) of every forward call."""

    def __init__(self, pipe):
        self.pipe, self.config, self.passes = pipe, pipe.config, []

    @property
    def device(self):
        return self.pipe.device

    def new_cache(self, rows, capacity):
        return self.pipe.new_cache(rows, capacity)

    def __call__(self, tokens, *args, **kwargs):  # tokens: [B, T]
        t0 = time.perf_counter()
        out = self.pipe(tokens, *args, **kwargs)
        self.passes.append((tokens.shape[0] * tokens.shape[1], time.perf_counter() - t0))
        return out


def parse_spec(spec: str) -> tuple[Strategy, str | None]:
    """`verify:4@lookup` -> (verify:4, lookup): a strategy with its own proposer."""
    strategy, _, proposer = spec.partition("@")
    return Strategy.parse(strategy), proposer or None


def _bench_stage(rank: int, world: int, args) -> int:
    from mtp.core.engine import Engine, EngineConfig

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    adapter = "none" if args.adapter == "untrained" else args.adapter
    wants = {parse_spec(s)[1] or args.proposer for s in args.strategies}
    engine = Engine.load(
        EngineConfig(
            model=args.model,
            adapter=adapter,
            proposer="heads" if any("heads" in w.split("+") for w in wants) else "mask",
        )
    )
    if args.adapter == "untrained":  # no trained adapter yet: the mask token and zero LoRA, same on every stage
        from mtp.core.runtime.adapter import add_adapters

        torch.manual_seed(0)
        add_adapters(engine.model, n_used_tokens=len(engine.tokenizer))
    elif engine.mask_id is None and any(
        not engine.can_propose(parse_spec(s)[1] or args.proposer) and parse_spec(s)[0].k > 1 for s in args.strategies
    ):
        raise ValueError("mask strategies need an adapter: pass --adapter DIR or --adapter untrained")
    config = PipelineConfig(timeout_s=args.timeout_s)
    run_stage(rank, world, engine.model, config, lambda pipe: _sweep(engine, pipe, world, args))
    return 0


def _sweep(engine, pipe, world: int, args) -> None:
    timed = TimedModel(pipe)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompts = [engine.encode(p) for p in PROMPTS[: args.prompts]]
    specs = args.strategies

    def decode(ids, spec, max_new=None):
        strategy, prop = parse_spec(spec)
        prop = "mask" if strategy.k == 1 else prop or args.proposer  # ntp: no proposer work, no hidden states
        proposer = engine.proposer(prop)
        p = params if max_new is None else SamplingParams(max_new_tokens=max_new)
        seq = Sequence(list(ids), strategy, p, proposer, eos_ids=engine.loaded.eos_ids)
        timed.passes = []
        with torch.inference_mode():
            for _ in stream(timed, seq, engine.mask_id):
                pass
        return seq, list(timed.passes)

    for spec in specs:  # untimed warm-up
        decode(prompts[0], spec, max_new=4)
    # every (delay, strategy) pair visits every prompt once per repeat, in an order rotated each
    # round, so the machine's drift (other jobs on shared cores) falls on all points alike
    pairs = [(d, spec) for d in args.delays for spec in specs]
    rounds = [(rep, j) for rep in range(args.repeats) for j in range(len(prompts))]
    with open(args.partial, "a") as out:
        for n, (rep, j) in enumerate(rounds):
            shift = (n * (len(specs) + 1)) % len(pairs)
            for delay, spec in pairs[shift:] + pairs[:shift]:
                pipe.link.delay_s = delay / 1000
                seq, passes = decode(prompts[j], spec)
                st = seq.stats
                rec = {
                    "stages": world,
                    "delay_ms": delay,
                    "strategy": spec,
                    "prompt": j,
                    "repeat": rep,
                    "tokens": st.tokens,
                    "passes": st.forward_passes,
                    "wall_s": st.wall_s,
                    "ttft_s": st.ttft_s,
                    "chunks": st.chunks,
                    "blocks": [q for q, _ in passes],
                    "forward_s": [t for _, t in passes],
                }
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(
                    f"  stages={world} delay={delay:g}ms {spec:<22} prompt {j}: {st.tokens} tokens, "
                    f"{st.forward_passes} passes, {st.tokens / st.wall_s:.1f} tokens/s",
                    flush=True,
                )


# ------------------------------------------------------------------------------------- analysis


def _decode_phase(r: dict) -> dict:
    """A run without its prompt pass (the same prefill for every strategy: it only dilutes and adds noise)."""
    return {
        "tokens": r["tokens"] - r["chunks"][0],
        "wall_s": r["wall_s"] - r["ttft_s"],
        "chunks": r["chunks"][1:],
        "blocks": r["blocks"][1:],
        "forward_s": r["forward_s"][1:],
    }


def summarize(records: list[dict]) -> list[dict]:
    """One row per (stages, delay, strategy): measured decode tokens/s (after the prompt pass) and the
    speedup over ntp, beside the prediction from the delay-0 cost model plus the link term."""
    rows = []
    for P in sorted({r["stages"] for r in records}):
        recs = [dict(r, **_decode_phase(r)) for r in records if r["stages"] == P and len(r["chunks"]) > 1]
        base = [r for r in recs if r["delay_ms"] == min(x["delay_ms"] for x in recs)]
        # cost model of this pipeline at delay 0: mean forward time per block size (means, not
        # medians: what is predicted is a sum of pass times, scheduler hiccups included)
        by_q: dict[int, list[float]] = {}
        for r in base:
            for q, t in zip(r["blocks"], r["forward_s"]):
                by_q.setdefault(q, []).append(t)
        cost = costmodel.CostModel({q: sum(ts) / len(ts) for q, ts in by_q.items()})
        overhead = {}  # strategy -> non-forward seconds per pass at delay 0 (propose, accept, commit)
        for spec in {r["strategy"] for r in base}:
            rs = [r for r in base if r["strategy"] == spec]
            overhead[spec] = sum(r["wall_s"] - sum(r["forward_s"]) for r in rs) / sum(len(r["chunks"]) for r in rs)
        ntp_spec = next((s for s in overhead if parse_spec(s)[0].plain), None)
        for delay in sorted({r["delay_ms"] for r in recs}):
            at = [r for r in recs if r["delay_ms"] == delay]
            measured, predicted = {}, {}
            for spec in sorted({r["strategy"] for r in at}):
                rs = [r for r in at if r["strategy"] == spec]
                tokens, wall = sum(r["tokens"] for r in rs), sum(r["wall_s"] for r in rs)
                chunks = [c for r in rs for c in r["chunks"]]
                blocks = [q for r in rs for q in r["blocks"]]
                pred_wall = sum(
                    cost.pass_time(q) + pricing.pipeline_comm_time(P, delay / 1000) + overhead.get(spec, 0.0)
                    for q in blocks
                )
                measured[spec] = metrics.tokens_per_s(tokens, wall)
                predicted[spec] = metrics.tokens_per_s(tokens, pred_wall)
                rows.append(
                    {
                        "stages": P,
                        "delay_ms": delay,
                        "strategy": spec,
                        "tokens": tokens,
                        "passes": len(chunks),
                        "tokens_per_forward": metrics.tokens_per_forward(chunks),
                        "mean_block_tokens": metrics.mean_block_tokens(blocks),
                        "ms_per_pass": 1000 * wall / len(chunks),
                        "tokens_per_s": measured[spec],
                        "predicted_tokens_per_s": predicted[spec],
                    }
                )
            for row in rows:
                if row["stages"] == P and row["delay_ms"] == delay and ntp_spec:
                    row["speedup"] = metrics.speedup(measured[row["strategy"]], measured[ntp_spec])
                    row["predicted_speedup"] = metrics.speedup(predicted[row["strategy"]], predicted[ntp_spec])
                    row["speedup_over_tokens_per_forward"] = row["speedup"] / row["tokens_per_forward"]
                    row["prediction_error"] = row["predicted_speedup"] / row["speedup"] - 1
    return rows


def table(rows: list[dict]) -> str:
    cols = [
        "stages",
        "delay ms",
        "strategy",
        "tokens/pass",
        "ms/pass",
        "tokens/s",
        "speedup",
        "predicted",
        "pred err",
        "speedup/(tokens/pass)",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [
            r["stages"],
            f"{r['delay_ms']:g}",
            r["strategy"],
            f"{r['tokens_per_forward']:.2f}",
            f"{r['ms_per_pass']:.0f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r.get('speedup', 0):.2f}",
            f"{r.get('predicted_speedup', 0):.2f}",
            f"{100 * r.get('prediction_error', 0):+.0f}%",
            f"{r.get('speedup_over_tokens_per_forward', 0):.2f}",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for P in sorted({r["stages"] for r in rows}):
        for spec in sorted({r["strategy"] for r in rows if r["stages"] == P}):
            rs = sorted((r for r in rows if r["stages"] == P and r["strategy"] == spec), key=lambda r: r["delay_ms"])
            if parse_spec(spec)[0].plain:
                continue
            xs = [r["delay_ms"] for r in rs]
            (line,) = ax.plot(xs, [r["speedup"] for r in rs], "o-", label=f"{spec}, {P} stages")
            ax.plot(xs, [r["predicted_speedup"] for r in rs], "--", color=line.get_color(), alpha=0.6)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("link delay per message (ms)")
    ax.set_ylabel("speedup over ntp (tokens/s)")
    ax.set_title("MTP speedup vs pipeline link latency (dashed: cost model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--adapter", default="auto", help="adapter dir, auto (shipped), none, or untrained")
    p.add_argument("--proposer", default="mask", help="mask, heads or lookup, for strategies without @PROPOSER")
    p.add_argument("--stages", default="2,4")
    p.add_argument("--delays", default="0,1,2,5,10,20", help="link delays in ms")
    p.add_argument(
        "--strategies",
        default="ntp,verify:4,conf_adapt:0.9:4,verify:4@heads,conf_adapt:0.9@heads",
        help="comma list; STRATEGY@PROPOSER picks a proposer (e.g. verify:4@lookup); conf_adapt:0.9 "
        "with the mask adapter at K 4: deeper guesses are almost never kept at tau 0.9, "
        "and each would add a mask to every pass",
    )
    p.add_argument("--prompts", type=int, default=2, help=f"how many of the {len(PROMPTS)} fixed prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="rounds over all prompts (more: less noise)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per stage (0: cores / stages)")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", default="runs/pipeline_latency")
    p.add_argument("--predict", metavar="SPEC", help="only print the cost model's prediction for a cluster")
    p.add_argument(
        "--analyze",
        nargs="+",
        metavar="RESULTS_JSONL",
        help="no run: pool these results.jsonl files (e.g. two runs) and write the table and plot to --out",
    )
    args = p.parse_args(argv)
    if args.predict:
        print(pricing.predict_cluster(**pricing.parse_cluster(args.predict))["text"])
        return 0
    if args.analyze:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return report([json.loads(line) for f in args.analyze for line in open(f) if line.strip()], out, vars(args))
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.proposer not in ("mask", "heads", "lookup"):
        raise SystemExit("--proposer must be mask, heads or lookup")
    # label every MTP strategy with its proposer unless it is the mask token's
    args.strategies = [
        s if "@" in s or parse_spec(s)[0].k == 1 or args.proposer == "mask" else f"{s}@{args.proposer}"
        for s in args.strategies
    ]
    if not any(parse_spec(s)[0].plain for s in args.strategies):
        args.strategies.insert(0, "ntp")
    args.delays = [float(x) for x in args.delays.split(",")]
    stages = [int(x) for x in args.stages.split(",")]
    if not 1 <= args.prompts <= len(PROMPTS):
        raise SystemExit(f"--prompts must be 1..{len(PROMPTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.partial = str(out / "results.jsonl")
    open(args.partial, "w").close()
    for P in stages:
        print(f"pipeline with {P} stages", flush=True)
        rc = launch_local(P, _bench_stage, (args,))
        if rc:
            print(f"stages={P}: the pipeline failed (exit {rc})", file=sys.stderr)
            return rc
    return report([json.loads(line) for line in open(args.partial)], out, vars(args))


def report(records: list[dict], out: Path, args: dict) -> int:
    rows = summarize(records)
    (out / "summary.json").write_text(json.dumps({"args": args, "rows": rows}, indent=1))
    print(table(rows))
    try:
        plot(rows, out / "speedup_vs_latency.png")
        print(f"wrote {out / 'speedup_vs_latency.png'}")
    except ImportError:
        print("matplotlib missing: no plot (pip install matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
