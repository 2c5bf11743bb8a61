"""The MTP-module size trade-off (seed 000), measured: MTP heads of several sizes, and the mask-token
adapter, against plain `ntp` decoding, in one run, on one machine.

    python benchmarks/heads_tradeoff.py --heads DIR [DIR ...] [--adapter DIR|auto|none]
        --data $MTP_DATA_DIR/gsm8k/test.jsonl [--limit 8] [--max-new-tokens 128] [--k 2,3,4]
        [--threads 2] [--out runs/heads-tradeoff]        (--heads DIR@2,4: only those K for DIR)

Every candidate runs `verify:K` (lossless: its greedy output must equal ntp's, checked), for each K
in --k up to its number of depths + 1. Per prompt, ntp and every candidate decode in turn, the order
rotated prompt by prompt, after one untimed warm-up. Reported per candidate (mtp.core.decoding.metrics):
acceptance by position, tokens per pass, drafting ms per pass (the heads' own time, measured
inside the proposer), verification ms per pass (the rest of the wall time), and the net speedup =
tokens/s over ntp's tokens/s on the same prompts. Writes results.json, table.md and tradeoff.png
(net speedup against module parameters, the mask adapter as one more point).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mtp.core.decoding import metrics
from mtp.core.decoding.decode import Sequence
from mtp.core.decoding.proposers import MaskProposer
from mtp.core.decoding.proposers.heads import load_heads_proposer, read_heads_config
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.engine import Engine, EngineConfig


def load_prompts(path: str, limit: int) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out.append(rec.get("question") or rec.get("prompt"))
            if len(out) >= limit:
                break
    if not out:
        raise SystemExit(f"no prompts in {path}")
    return out


def adapter_params(path: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(path / "adapter.safetensors")).values())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--heads",
        nargs="+",
        default=[],
        help="MTP heads checkpoint directories; DIR@2,4 runs only those K for that one",
    )
    p.add_argument("--adapter", default="auto", help="mask-token adapter directory ('auto' = shipped, 'none')")
    p.add_argument("--data", required=True, help="JSONL with a 'question' (or 'prompt') field")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", default="2,3,4", help="verify block sizes to run (each capped at depths + 1)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", default="runs/heads-tradeoff")
    return p.parse_args()


def heads_candidates(base: Engine, specs: list[str], ks: list[int]) -> list[dict]:
    """A row per heads checkpoint (`DIR`, or `DIR@2,4` for its own K) and K up to its depths + 1."""
    cands = []
    for spec in specs:
        d, _, own_k = spec.partition("@")
        cfg = read_heads_config(d)
        proposer = load_heads_proposer(base.model, d)
        label = Path(d).name
        for k in sorted(int(x) for x in own_k.split(",")) if own_k else ks:
            if 2 <= k <= cfg["depths"] + 1:
                cands.append(
                    {
                        "name": f"heads {label} verify:{k}",
                        "kind": "heads",
                        "dir": str(d),
                        "k": k,
                        "engine": base,
                        "proposer": proposer,
                        "params": cfg["n_params"],
                        "size": f"L={cfg['blocks']} width={cfg['width']} D={cfg['depths']}",
                    }
                )
    return cands


def mask_candidates(args, ks: list[int]) -> list[dict]:
    """A row per K >= 2 for the mask-token adapter (none with `--adapter none`, or when none is found)."""
    if args.adapter == "none":
        return []
    mask_engine = Engine.load(EngineConfig(model=args.model, adapter=args.adapter, threads=args.threads))
    if mask_engine.adapter_dir is None:
        print("no mask-token adapter found (pass --adapter DIR); skipping that point", file=sys.stderr)
        return []
    n = adapter_params(mask_engine.adapter_dir)
    return [
        {
            "name": f"mask adapter verify:{k}",
            "kind": "mask",
            "k": k,
            "dir": str(mask_engine.adapter_dir),
            "engine": mask_engine,
            "proposer": MaskProposer(),
            "params": n,
            "size": "gated LoRA + mask token",
        }
        for k in ks
        if k >= 2
    ]


def decode(row: dict, ids: list[int], max_new: int, record: bool = True) -> None:
    """`row` decodes prompt `ids`; with `record`, its stats, drafting time and output are kept."""
    eng = row["engine"]
    seq = Sequence(
        ids,
        row["strategy"],
        SamplingParams(max_new_tokens=max_new),
        row["proposer"],
        eos_ids=eng.loaded.eos_ids,
        decode_text=eng.decode_text,
    )
    d0 = getattr(row["proposer"], "draft_s", 0.0)
    for _ in eng.stream(seq):
        pass
    if record:
        row["stats"].append(seq.stats)
        row["draft_s"] += getattr(row["proposer"], "draft_s", 0.0) - d0
        row["outputs"].append(list(seq.output))


def summarise(rows: list[dict]) -> list[dict]:
    """A result per row: acceptance, tokens per pass, drafting and verification ms per pass, tokens/s and
    the speedup over the `ntp` row (the first), and whether its outputs equal ntp's."""
    ntp = rows[0]
    ntp_sum = metrics.merge(ntp["stats"])
    results = []
    for row in rows:
        s = metrics.merge(row["stats"], k_max=row["k"])
        passes = s["forward_passes"]
        draft_ms = 1000 * row["draft_s"] / passes
        results.append(
            {
                "name": row["name"],
                "kind": row["kind"],
                "size": row["size"],
                "params": row["params"],
                "k": row["k"],
                "acceptance_by_position": [round(a, 3) for a in s["acceptance_by_position"]],
                "tokens_per_pass": round(s["tokens_per_forward"], 3),
                "draft_ms_per_pass": round(draft_ms, 2),
                "verify_ms_per_pass": round(1000 * s["wall_s"] / passes - draft_ms, 2),
                "tokens_per_s": round(s["tokens_per_s"], 2),
                "speedup_vs_ntp": round(s["tokens_per_s"] / ntp_sum["tokens_per_s"], 3),
                "lossless": all(o == r for o, r in zip(row["outputs"], ntp["outputs"])),
                "tokens": s["tokens"],
                "forward_passes": passes,
            }
        )
    return results


def table_md(results: list[dict]) -> list[str]:
    table = [
        "| candidate | size | params | acceptance by position | tokens/pass | draft ms/pass | "
        "verify ms/pass | tokens/s | speedup vs ntp | lossless |",
        "|" + " --- |" * 10,
    ]
    for r in results:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        table.append(
            f"| {r['name']} | {r['size']} | {r['params'] / 1e6:.2f} M | {acc} | "
            f"{r['tokens_per_pass']:.2f} | {r['draft_ms_per_pass']:.1f} | {r['verify_ms_per_pass']:.1f} | "
            f"{r['tokens_per_s']:.1f} | "
            f"{r['speedup_vs_ntp']:.2f}x | {'yes' if r['lossless'] else 'NO'} |"
        )
    return table


def main() -> None:
    args = parse_args()
    ks = sorted({int(k) for k in args.k.split(",")})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    base = Engine.load(EngineConfig(model=args.model, adapter="none", threads=args.threads))
    cands = heads_candidates(base, args.heads, ks)  # (name, engine, proposer, strategy, params, kind)
    cands += mask_candidates(args, ks)
    rows = [
        {"name": "ntp", "kind": "ntp", "k": 1, "engine": base, "proposer": MaskProposer(), "params": 0, "size": "-"}
    ] + cands
    for r in rows:
        strategy = Strategy.parse("ntp" if r["k"] == 1 else f"verify:{r['k']}")
        r.update(stats=[], draft_s=0.0, outputs=[], strategy=strategy)

    prompts = load_prompts(args.data, args.limit)
    ids_all = [base.encode(q) for q in prompts]
    for row in rows:  # untimed warm-up
        decode(row, ids_all[0], 8, record=False)
    t0 = time.perf_counter()
    for i, ids in enumerate(ids_all):
        order = rows[i % len(rows) :] + rows[: i % len(rows)]
        for row in order:
            decode(row, ids, args.max_new_tokens)
        print(f"prompt {i + 1}/{len(ids_all)} done ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)

    results = summarise(rows)
    meta = {
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "data": Path(args.data).name,
        "command": " ".join(sys.argv),
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
    table = table_md(results)
    (out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    plot(results, out / "tradeoff.png", meta)


def plot(results: list[dict], path: Path, meta: dict) -> None:
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install matplotlib): no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    markers = {2: "o", 3: "s", 4: "^", 5: "D"}
    for r in results:
        if r["kind"] == "ntp":
            continue
        colour = "tab:red" if r["kind"] == "mask" else "tab:blue"
        ax.scatter(r["params"] / 1e6, r["speedup_vs_ntp"], c=colour, marker=markers.get(r["k"], "x"), s=50)
        label = r["name"].replace("heads ", "").replace(" verify:", " K=")
        ax.annotate(
            label, (r["params"] / 1e6, r["speedup_vs_ntp"]), fontsize=7, xytext=(4, 3), textcoords="offset points"
        )
    ax.axhline(1.0, color="grey", lw=1, ls="--", label="ntp")
    ax.set_xscale("log")
    ax.set_xlabel("module parameters (millions, log scale)")
    ax.set_ylabel("net wall-clock speedup over ntp")
    xs = [r["params"] / 1e6 for r in results if r["kind"] != "ntp"]
    if xs:
        ax.set_xticks([t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if min(xs) / 2 <= t <= max(xs) * 2])
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    who = "MTP heads (blue) vs mask adapter (red)" if any(r["kind"] == "mask" for r in results) else "MTP heads"
    ax.set_title(
        f"{who}, verify:K (marker: o K=2, s K=3, ^ K=4); {meta['prompts']} prompts of "
        f"{meta['data']}, {meta['threads']} threads",
        fontsize=9,
    )
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
