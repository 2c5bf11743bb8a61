"""What a trained drafter is worth on an engine people run across machines (issue 52): llama.cpp's RPC
backend on a simulated cluster (`mtp.interop.llamacpp_rpc`: N `ggml-rpc-server` workers on loopback, each
link delayed D ms per direction), plain, with mtp's exported EAGLE-3 drafter on the head node, and with
llama.cpp's n-gram drafts; beside it mtp's own `mtp pipeline` at the same N and D.

    python benchmarks/llamacpp_rpc.py --nodes 2,4 --delays 0,1,5,20 --data gsm8k:$MTP_DATA_DIR/gsm8k/test.jsonl \
        --data prompts:benchmarks/results/final/diverse60.jsonl --limit 50,30 --max-new-tokens 128 --out runs/rpc
    python benchmarks/llamacpp_rpc.py --report runs/rpc-a runs/rpc-b --out benchmarks/results/rpc   # merge + plot

Protocol, per node count N: one cluster; each mode's llama-server loads the target across it at delay 0, decodes
one untimed warm-up (llama.cpp's RPC client asks the workers about every new graph shape once), then decodes
the block's prompts, each at every delay in an order rotated per prompt. The prompts are split into `--blocks`
and the modes' order rotates per block, so drift on shared cores falls on all modes alike. Greedy, one thread
per worker and for the head; tokens/s is llama-server's decoding after the prompt pass ((n - 1) tokens over
`predicted_ms`); tokens/pass n / (n - accepted drafts), counting the prompt's pass as mtp does.

EAGLE-3 draft count (`--draft auto`, as `mtp bench --profile` chooses it, per N and D): a pilot with 3 drafts
on the first `--pilot` prompts, llama.cpp's t(q) on the cluster at D (`llama-bench --rpc`), and
`llamacpp_profile.advise`; `--draft N[:P]` fixes it. The drafter runs on the head (`-devd none`).

mtp pipeline (`--pipeline-strategies`, first `--pipeline-limit` prompts): N stages of `mtp.pipeline` on the
same token ids, each message delayed D ms (`--link-delay-ms`), decode phase after the prompt pass.

Writes into --out: records.jsonl (one line per prompt and configuration), results.jsonl (one row per set,
engine, nodes, delay_ms, mode: tokens_per_s, tokens_per_pass, ms_per_pass, speedup over the engine's plain
decoding, identical_to_plain and differing_prompts, round_trips_per_pass_per_link as the relays count them,
one_way_delays_per_pass: the extra ms per pass over delay 0, in units of D), meta.json (arguments, CPU, draft
advice) and rpc_speedup.png. `--report DIR...` pools finished runs into results.jsonl and the plot only, and
with `--explain` adds to each row the logit margins where its outputs leave plain's (see `explain`).
Bad input (a delay that is negative or not a number, a port in use, a drafter for another model, a worker that
dies or hangs) ends the run with one line and exit status 2 (1 for a failed worker).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from mtp.cli import main as mtp_main
from mtp.core.decoding.decode import Sequence, stream
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.engine import Engine, EngineConfig
from mtp.core.runtime.artifacts import base_hash, read_json
from mtp.eval.bench import load_data
from mtp.interop import llamacpp_env, llamacpp_profile
from mtp.interop.llamacpp_export import MANIFEST, is_llamacpp_export
from mtp.interop.llamacpp_rpc import Cluster, ClusterError, ClusterServer, cluster_t_of_q, parse_delays
from mtp.pipeline.launch import launch_local
from mtp.pipeline.stages import run_stage
from mtp.pipeline.transport import PipelineConfig

MODES = ("plain", "eagle3", "ngram")
PILOT_DRAFTS = 3  # drafts per step of the pilot the advice reads (llama.cpp peers' default)
WARMUP_TOKENS = 48
CTX = 2048


def lscpu() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model name", "CPU family", "Model", "CPU(s)", "Vendor ID", "Hypervisor vendor")
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines()) if k.strip() in keep}


def int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected whole numbers separated by commas") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{what} {text!r}: expected whole numbers >= 1")
    return vals


# ------------------------------------------------------------------------------------------------ inputs


def load_prompts(engine, data: list[str], limits: list[int]) -> list[dict]:
    """[{"source", "index", "ids"}] of every --data spec's first limit items, chat-formatted token ids."""
    if len(limits) not in (1, len(data)):
        raise ValueError(f"--limit gives {len(limits)} values for {len(data)} --data specs (give 1 or one each)")
    out = []
    for spec, limit in zip(data, limits * len(data) if len(limits) == 1 else limits):
        kind, items = load_data(spec, limit)
        out += [
            {"source": f"{kind}:{Path(spec.split(':', 1)[1]).name}", "index": i, "ids": engine.encode(it["prompt"])}
            for i, it in enumerate(items)
        ]
    return out


def ensure_export(path: Path, engine) -> dict:
    """The `mtp export --format llamacpp` folder at `path` (written with the shipped drafter when missing),
    checked against the engine's weights: {"target", "drafter", "manifest"}."""
    if not path.exists():
        print(f"exporting the shipped drafter and its target to {path} (mtp export --format llamacpp)", flush=True)
        if mtp_main(["export", "--format", "llamacpp", "--drafter", "shipped", "--out", str(path)]) != 0:
            raise ValueError(f"mtp export --format llamacpp --out {path} failed")
    if not (path / MANIFEST).is_file() or not is_llamacpp_export(path):
        raise ValueError(f"--export {path} is not an `mtp export --format llamacpp` folder")
    man = read_json(path / MANIFEST, "llama.cpp export manifest")
    have = base_hash(engine.model)
    if man.get("base_hash") != have:
        raise ValueError(
            f"--export {path}: its drafter was trained for base weights {man.get('base_hash')}, "
            f"{engine.loaded.name} has {have}"
        )
    return {"target": path / man["target"], "drafter": path / man["drafter"], "manifest": man}


# ------------------------------------------------------------------------------------------- llama.cpp


def server_for(cluster: Cluster, export: dict, mode: str, draft: tuple[int, float | None] | None) -> ClusterServer:
    """A llama-server of `mode` across the cluster, loaded at delay 0 and warmed up (one untimed request), with
    `rt_per_pass`: the round trips one decoding pass costs each link, counted by the relays on the warm-up
    prompt once every graph shape is known (a 1-token request's count, the prompt pass, subtracted)."""
    cluster.set_delay(0)
    extra: tuple[str, ...] = ()
    if mode == "eagle3" and draft and draft[1] is not None:
        extra = ("--spec-draft-p-min", f"{draft[1]:.2f}")
    server = ClusterServer(
        cluster,
        export["target"],
        None if mode == "plain" else mode,
        export["drafter"] if mode == "eagle3" else None,
        threads=1,
        ctx=CTX,
        draft_max=draft[0] if mode == "eagle3" and draft else PILOT_DRAFTS,
        extra=extra,
    )
    try:
        server.complete(export["warmup_ids"], WARMUP_TOKENS)
        one = decode(server, cluster, export["warmup_ids"], 1, set())
        full = decode(server, cluster, export["warmup_ids"], WARMUP_TOKENS, set())
    except BaseException:
        server.close()
        raise
    passes = full["predicted_n"] - full["draft_n_accepted"]
    server.rt_per_pass = (full["round_trips"] - one["round_trips"]) / max(1, passes - 1) / cluster.nodes
    return server


def decode(server: ClusterServer, cluster: Cluster, ids: list[int], max_new: int, eos: set[int]) -> dict:
    trips = [r.round_trips for r in cluster.relays]
    t0 = time.perf_counter()
    rec = server.complete(ids, max_new)
    t = rec["timings"]
    out = rec["ids"]
    cut = next((i for i, tok in enumerate(out) if tok in eos), len(out))
    return {
        "ids": out[:cut],
        "predicted_n": t.get("predicted_n", 0),
        "predicted_ms": t.get("predicted_ms", 0.0),
        "draft_n": t.get("draft_n", 0),
        "draft_n_accepted": t.get("draft_n_accepted", 0),
        "round_trips": sum(r.round_trips - b for r, b in zip(cluster.relays, trips)),
        "wall_s": time.perf_counter() - t0,
    }


def advise(cluster, export, pilot, delays, max_new, log) -> dict:
    """{delay: llamacpp_profile.advise(...)}: a 3-draft pilot at each delay, then t(q) on the cluster at it."""
    timings: dict[float, list[dict]] = {d: [] for d in delays}
    with server_for(cluster, export, "eagle3", (PILOT_DRAFTS, None)) as server:
        for p in pilot:
            for d in delays:
                cluster.set_delay(d)
                r = server.complete(p["ids"], max_new)
                timings[d].append(r["timings"])
    out = {}
    for d in delays:
        cluster.set_delay(d)
        t = cluster_t_of_q(cluster, export["target"])
        adv = llamacpp_profile.advise(t, timings[d])
        out[d] = {**{k: v for k, v in adv.items() if k != "rates"}, "t_q_s": t}
        log(f"  N={cluster.nodes} D={d:g} ms: {llamacpp_profile.advice_line('eagle3', adv)}")
    cluster.set_delay(0)
    return out


def run_llamacpp(nodes, args, prompts, export, eos, records, log) -> dict:
    """Every mode and delay on one cluster of `nodes` workers; appends to `records`; returns the advice used."""
    with Cluster(nodes, 0, threads=1, port=args.rpc_port) as cluster:
        advice, draft = {}, {}
        if "eagle3" in args.modes:
            if args.draft == "auto":
                advice = advise(cluster, export, prompts[: args.pilot], args.delays, args.max_new_tokens, log)
            draft = {d: fixed_or_advised(args.draft, advice.get(d)) for d in args.delays}
        for b in range(args.blocks):
            block = prompts[b :: args.blocks]
            for mode in args.modes[b % len(args.modes) :] + args.modes[: b % len(args.modes)]:
                # eagle3: one server per distinct draft setting; plain and ngram: one server for every delay
                settings = {draft[d] for d in args.delays} if mode == "eagle3" else {None}
                for setting in sorted(settings, key=str):
                    delays = [d for d in args.delays if mode != "eagle3" or draft[d] == setting]
                    with server_for(cluster, export, mode, setting) as server:
                        run_block(cluster, server, block, delays, mode, setting, args, eos, records, log)
    return {str(d): a for d, a in advice.items()}


def run_block(cluster, server, block, delays, mode, setting, args, eos, records, log) -> None:
    """Each prompt of `block` at each delay (the order rotated per prompt), appended to `records`."""
    for j, p in enumerate(block):
        for d in delays[j % len(delays) :] + delays[: j % len(delays)]:
            cluster.set_delay(d)
            rec = decode(server, cluster, p["ids"], args.max_new_tokens, eos)
            where = {"set": args.set, "engine": "llama.cpp", "nodes": cluster.nodes, "delay_ms": d, "mode": mode}
            draft = list(setting) if setting else None
            rec.update(source=p["source"], index=p["index"], draft=draft, rt_per_pass=server.rt_per_pass)
            records.append({**where, **rec})
            n, ms = rec["predicted_n"], rec["predicted_ms"]
            rate = (n - 1) / ms * 1e3 if ms else 0.0
            log(f"  N={cluster.nodes} D={d:g} {mode:<6} {p['source']}#{p['index']}: {n} tokens, {rate:.1f} tokens/s")


def fixed_or_advised(spec: str, adv: dict | None) -> tuple[int, float | None]:
    """--draft N[:P] or the advice (at least 1 draft: a row with the drafter must draft)."""
    if spec != "auto":
        n, _, p = spec.partition(":")
        return int(n), float(p) if p else None
    return max(1, adv["n_max"]), round(adv["p_min"], 2) if adv["n_max"] >= 1 else None


# ----------------------------------------------------------------------------------------- mtp pipeline


def _pipeline_stage(rank: int, world: int, cfg: dict) -> int:
    torch.set_num_threads(1)
    engine = Engine.load(EngineConfig(adapter="none", proposer="heads"))
    run_stage(
        rank,
        world,
        engine.model,
        PipelineConfig(timeout_s=120.0),
        lambda pipe: _pipeline_sweep(engine, pipe, world, cfg),
    )
    return 0


def _pipeline_sweep(engine, pipe, world: int, cfg: dict) -> None:
    def run(ids, spec, max_new):
        strategy, _, prop = spec.partition("@")
        strategy = Strategy.parse(strategy)
        proposer = engine.proposer("mask" if strategy.k == 1 else prop or "heads")
        seq = Sequence(
            list(ids), strategy, SamplingParams(max_new_tokens=max_new), proposer, eos_ids=engine.loaded.eos_ids
        )
        with torch.inference_mode():
            for _ in stream(pipe, seq, engine.mask_id):
                pass
        return seq

    for spec in cfg["strategies"]:  # untimed warm-up
        pipe.link.delay_s = 0
        run(cfg["prompts"][0]["ids"], spec, 8)
    with open(cfg["partial"], "a") as out:
        for j, p in enumerate(cfg["prompts"]):
            pairs = [(d, s) for d in cfg["delays"] for s in cfg["strategies"]]
            shift = j % len(pairs)
            for d, spec in pairs[shift:] + pairs[:shift]:
                pipe.link.delay_s = d / 1000
                seq = run(p["ids"], spec, cfg["max_new"])
                st = seq.stats
                rec = {
                    "engine": "mtp pipeline",
                    "nodes": world,
                    "delay_ms": d,
                    "mode": spec,
                    "source": p["source"],
                    "index": p["index"],
                    "ids": list(seq.output),
                    "tokens": st.tokens,
                    "passes": st.forward_passes,
                    "first_chunk": st.chunks[0] if st.chunks else 0,
                    "wall_s": st.wall_s,
                    "ttft_s": st.ttft_s,
                }
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(
                    f"  pipeline N={world} D={d:g} {spec}: {st.tokens} tokens, {st.forward_passes} passes", flush=True
                )


def run_pipeline(nodes: int, args, prompts: list[dict], out: Path) -> list[dict]:
    partial = out / f"pipeline-{nodes}.jsonl"
    partial.write_text("")
    cfg = {
        "strategies": args.pipeline_strategies,
        "delays": args.delays,
        "max_new": args.max_new_tokens,
        "prompts": prompts[: args.pipeline_limit],
        "partial": str(partial),
    }
    rc = launch_local(nodes, _pipeline_stage, (cfg,))
    if rc == 130:  # Ctrl-C: launch_local stopped the stages
        raise KeyboardInterrupt
    if rc:
        raise RuntimeError(f"mtp pipeline with {nodes} stages failed (exit {rc})")
    return [{"set": args.set, **json.loads(line)} for line in partial.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ analysis


def key(r: dict, mode: str | None = None) -> tuple:
    """(set, engine, nodes, delay_ms, mode): what one row of results.jsonl pools."""
    return (r.get("set", ""), r["engine"], r["nodes"], r["delay_ms"], mode or r["mode"])


def row_of(rs: list[dict]) -> dict:
    """Totals of one configuration's records: tokens/pass (prompt pass counted), decode tokens/s, ms/pass."""
    if rs[0]["engine"] == "llama.cpp":
        tokens = sum(r["predicted_n"] for r in rs)
        passes = tokens - sum(r["draft_n_accepted"] for r in rs)
        decode_s = sum(r["predicted_ms"] for r in rs) / 1e3
        decode_tokens = tokens - len(rs)  # llama-server's predicted_ms starts after the first token
    else:
        tokens, passes = sum(r["tokens"] for r in rs), sum(r["passes"] for r in rs)
        decode_s = sum(r["wall_s"] - r["ttft_s"] for r in rs)
        decode_tokens = tokens - sum(r["first_chunk"] for r in rs)
    s, eng, n, d, mode = key(rs[0])
    row = {"set": s, "engine": eng, "nodes": n, "delay_ms": d, "mode": mode, "prompts": len(rs), "tokens": tokens}
    row.update(passes=passes, tokens_per_pass=tokens / passes, tokens_per_s=decode_tokens / decode_s)
    row["ms_per_pass"] = 1e3 * decode_s / (passes - len(rs))
    if eng == "llama.cpp":
        row["round_trips_per_pass_per_link"] = sum(r["rt_per_pass"] for r in rs) / len(rs)
        if rs[0].get("draft"):
            row["spec_draft_n_max"], row["spec_draft_p_min"] = rs[0]["draft"]
    return row


def summarize(records: list[dict]) -> list[dict]:
    """One row per (set, engine, nodes, delay_ms, mode); speedup and identity against the same engine's plain
    decoding (llama.cpp `plain`, mtp `ntp`) on the same set, nodes and delay."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    rows = {k: row_of(rs) for k, rs in sorted(groups.items())}
    for k, row in rows.items():
        zero = rows.get((*k[:3], 0.0, k[4]))  # the same configuration on links without delay
        if zero and row["delay_ms"] > 0:  # the one-way delays each pass waited for in series
            row["one_way_delays_per_pass"] = (row["ms_per_pass"] - zero["ms_per_pass"]) / row["delay_ms"]
        ref = key(row, "plain" if row["engine"] == "llama.cpp" else "ntp")
        want = {(r["source"], r["index"]): r["ids"] for r in groups.get(ref, [])}
        mine = {(r["source"], r["index"]): r["ids"] for r in groups[k]}
        row["differing_prompts"] = sum(mine[p] != want[p] for p in mine if p in want)
        row["identical_to_plain"] = bool(want) and all(p in want for p in mine) and row["differing_prompts"] == 0
        if ref in rows:
            row["speedup"] = row["tokens_per_s"] / rows[ref]["tokens_per_s"]
            row["speedup_over_tokens_per_pass"] = row["speedup"] / row["tokens_per_pass"]
    return list(rows.values())


def table(rows: list[dict]) -> str:
    head = "| set | engine | N | D ms | mode | prompts | tokens/pass | ms/pass | tokens/s | speedup | same | RT/link |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['set']} | {r['engine']} | {r['nodes']} | {r['delay_ms']:g} | {r['mode']} | {r['prompts']} | "
            f"{r['tokens_per_pass']:.2f} | {r['ms_per_pass']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{r.get('speedup', 0):.2f} | {r['prompts'] - r['differing_prompts']}/{r['prompts']} | "
            f"{r.get('round_trips_per_pass_per_link', float('nan')):.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # optional: the plot only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["mode"] not in ("plain", "ntp") and "speedup" in r:
            series.setdefault((r["set"], r["engine"], r["nodes"], r["mode"]), []).append(r)
    for (s, eng, n, mode), rs in sorted(series.items()):
        rs.sort(key=lambda r: r["delay_ms"])
        label = f"{eng} {mode}, N={n} ({s}, {rs[0]['prompts']} prompts)"
        style = ("o-" if eng == "llama.cpp" else "s--") if len(rs) > 1 else "*"
        xs, ys = [r["delay_ms"] for r in rs], [r["speedup"] for r in rs]
        ax.plot(xs, ys, style, label=label, markersize=4 if len(rs) > 1 else 12)
        for r in rs:  # the draft count each llama.cpp EAGLE-3 point ran with (the profile's choice)
            if "spec_draft_n_max" in r:
                ax.annotate(f"n={r['spec_draft_n_max']}", (r["delay_ms"], r["speedup"]), fontsize=6,
                            textcoords="offset points", xytext=(3, 3))  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("link delay D per direction (ms)")
    ax.set_ylabel("speedup over the engine's plain decoding (tokens/s)")
    ax.set_title("Drafts across a simulated cluster: llama.cpp RPC and mtp pipeline")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def explain(records: list[dict], run_dirs: list[str]) -> dict[tuple, list[dict]]:
    """{row key: [difference]} for every output that leaves its engine's plain output: the first differing
    position, both tokens, and the float32 logit margin there between plain's token and the other (mtp's own
    float32 forward of the prompt and the common prefix). A margin near 0 is a near-tie, which llama.cpp's
    rounding of a multi-token batch (not a one-token pass) can flip. Prompts are rebuilt from each run's argv."""
    engine = Engine.load(EngineConfig(adapter="none", pack=False))
    prompt_ids = {}
    for d in run_dirs:
        args = parse(read_json(Path(d) / "meta.json", "run meta")["argv"][1:])
        prompts = load_prompts(engine, args.data, int_list(args.limit, "--limit"))
        label = set_label(args, prompts)
        prompt_ids.update({(label, p["source"], p["index"]): p["ids"] for p in prompts})
    plain = {(*key(r), r["source"], r["index"]): r["ids"] for r in records if r["mode"] in ("plain", "ntp")}
    out: dict[tuple, list[dict]] = {}
    for r in records:
        ref = plain.get((*key(r, "plain" if r["engine"] == "llama.cpp" else "ntp"), r["source"], r["index"]))
        if r["mode"] in ("plain", "ntp") or ref is None or ref == r["ids"]:
            continue
        at = next((i for i, (a, b) in enumerate(zip(ref, r["ids"])) if a != b), min(len(ref), len(r["ids"])))
        diff = {"source": r["source"], "index": r["index"], "position": at}
        if at < min(len(ref), len(r["ids"])):
            ids = torch.tensor([prompt_ids[(r.get("set", ""), r["source"], r["index"])] + ref[:at]])  # [1, T]
            with torch.inference_mode():
                logits = engine.model(ids)[0, -1].float()  # [vocab]
            diff.update(plain_token=ref[at], other_token=r["ids"][at])
            diff["logit_margin"] = round(float(logits[ref[at]] - logits[r["ids"][at]]), 4)
        out.setdefault(key(r), []).append(diff)
    return out


def set_label(args, prompts: list[dict]) -> str:
    return args.set or "+".join(sorted({p["source"] for p in prompts})) + f" first {args.limit}"


def report(records: list[dict], out: Path, meta: dict | None, differences: dict | None = None) -> list[dict]:
    rows = summarize(records)
    for row in rows:
        if differences and differences.get(key(row)):
            row["differences"] = differences[key(row)]
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if meta is not None:
        (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(table(rows))
    plot(rows, out / "rpc_speedup.png")
    print(f"wrote {out / 'results.jsonl'} and {out / 'rpc_speedup.png'}")
    return rows


# ---------------------------------------------------------------------------------------------------- main


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="2,4", help="worker counts, e.g. 2,4")
    p.add_argument("--delays", default="0,1,5,20", help="link delays in ms per direction")
    p.add_argument("--data", action="append", help="gsm8k:PATH or prompts:PATH (repeatable)")
    p.add_argument("--limit", default="10", help="items per --data (one value, or one per --data: 50,30)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--modes", default="plain,eagle3,ngram")
    p.add_argument(
        "--export", default="runs/eagle3-gguf", help="`mtp export --format llamacpp` folder (made if missing)"
    )
    p.add_argument("--draft", default="auto", help="auto (the profile's advice per N and D) or N[:P_MIN]")
    p.add_argument("--pilot", type=int, default=2, help="prompts of the 3-draft pilot the advice reads")
    p.add_argument("--blocks", type=int, default=2, help="prompt blocks; the modes' order rotates per block")
    p.add_argument("--rpc-port", type=int, default=None, help="first worker port (default: free ports)")
    p.add_argument("--pipeline-strategies", default="ntp,tree:8@heads+suffix+lookup", help="'' for none")
    p.add_argument("--pipeline-limit", type=int, default=4, help="prompts for mtp pipeline (the first ones)")
    p.add_argument("--set", default=None, help="label of this prompt set in results.jsonl (default: from --data)")
    p.add_argument("--out", required=True)
    p.add_argument("--report", nargs="+", metavar="DIR", help="no run: merge these runs' records.jsonl into --out")
    p.add_argument("--explain", action="store_true", help="with --report: the logit margin where outputs differ")
    args = p.parse_args(argv)
    args.delays = parse_delays(args.delays)
    args.nodes = int_list(args.nodes, "--nodes")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        raise ValueError(f"--modes {args.modes}: choose from {', '.join(MODES)}")
    if "plain" not in args.modes:
        args.modes.insert(0, "plain")
    if args.draft != "auto":
        n, _, pm = args.draft.partition(":")
        try:
            ok = int(n) >= 1 and (not pm or 0 <= float(pm) <= 1)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--draft {args.draft!r}: expected auto or N[:P_MIN], N >= 1, 0 <= P_MIN <= 1")
    args.pipeline_strategies = [s.strip() for s in args.pipeline_strategies.split(",") if s.strip()]
    if args.pipeline_strategies and "ntp" not in args.pipeline_strategies:
        args.pipeline_strategies.insert(0, "ntp")
    for what in ("max_new_tokens", "pilot", "blocks", "pipeline_limit"):
        if getattr(args, what) < 1:
            raise ValueError(f"--{what.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    """The benchmark; Ctrl-C ends it with one line and status 130, every worker, llama-server and pipeline
    stage it started stopped first (their `with` blocks and `launch_local`); SIGTERM likewise, status 143."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups (`with` blocks) on SIGTERM too
    try:
        return run(argv)
    except KeyboardInterrupt:
        print("llamacpp_rpc: interrupted (Ctrl-C); every process it started is stopped", file=sys.stderr)
        return 130


def run(argv=None) -> int:
    try:
        args = parse(argv)
        out = Path(args.out)
        if args.report:
            recs = [
                json.loads(ln) for d in args.report for ln in (Path(d) / "records.jsonl").read_text().splitlines() if ln
            ]
            out.mkdir(parents=True, exist_ok=True)
            report(recs, out, None, explain(recs, args.report) if args.explain else None)
            return 0
        if not args.data:
            raise ValueError("--data gsm8k:PATH or prompts:PATH is required")
        gone = llamacpp_env.missing() or llamacpp_env.missing(llamacpp_env.RPC_SERVER)
        if gone:
            raise ValueError(gone)
        engine = Engine.load(EngineConfig(adapter="none", pack=False))  # the tokenizer and the weights' hash
        limits = int_list(args.limit, "--limit")
        prompts = load_prompts(engine, args.data, limits)
        args.set = set_label(args, prompts)
        export = ensure_export(Path(args.export), engine)
        export["warmup_ids"] = engine.encode("Count from one to twenty.")
        eos = set(engine.loaded.eos_ids)
        del engine
    except ValueError as e:
        print(f"llamacpp_rpc: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "argv": sys.argv if argv is None else ["benchmarks/llamacpp_rpc.py", *argv],
        "cpu": lscpu(),
        "llamacpp": llamacpp_env.environment(),
        "export": str(args.export),
        "started": time.strftime("%F %T"),
        "prompts": len(prompts),
        "advice": {},
    }
    records: list[dict] = []
    log = lambda s: print(s, flush=True)
    t0 = time.monotonic()
    try:
        for n in args.nodes:
            log(f"llama.cpp RPC, {n} workers")
            meta["advice"][str(n)] = run_llamacpp(n, args, prompts, export, eos, records, log)
            if args.pipeline_strategies:
                log(f"mtp pipeline, {n} stages")
                records += run_pipeline(n, args, prompts, out)
            with open(out / "records.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    except ClusterError as e:
        print(f"llamacpp_rpc: error: {e}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError) as e:
        print(f"llamacpp_rpc: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    report(records, out, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
