"""One figure of both data-scaling curves: held-out tokens per pass (what `verify:4` accepts on the
model's own greedy text) against training answers, for the MTP heads (`heads_scaling.py`: answers
trained on) and the mask adapter (`mask_scaling.py`: answers seen in one pass from scratch; `--mask-more`:
another recipe, e.g. LoRA on the upper layers only), per held-out source, with the shipped proposers as
dashed reference lines. With `--bench`, a second row shows the issue's own measure (`verify:4` tokens/pass
on GSM8K test 0-99 and the 60 held-out diverse prompts, decoded or replayed) against training answers, per
proposer and recipe, with the targets.

    python benchmarks/plot_scaling.py --heads benchmarks/results/scaling/heads.jsonl \\
        --mask benchmarks/results/scaling/mask.jsonl --bench benchmarks/results/scaling/bench_points.jsonl \\
        --out benchmarks/results/scaling/scaling.png

A `--bench` line is {"proposer", "recipe", "answers", "gsm8k100", "diverse60", "source"} (a measured point;
"source" names the results file it comes from) or {"target": proposer, "gsm8k100", "diverse60"} (optional "label": the legend's text).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SOURCES = {"gsm8k": "GSM8K (held-out answers)", "self_written": "self-written requests (held out)"}
BENCH = {"gsm8k100": "GSM8K test 0-99 (verify:4)", "diverse60": "diverse 60 held-out prompts (verify:4)"}
COLORS = {"heads": "tab:blue", "mask": "tab:orange", "eagle3": "tab:green"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", help="heads_scaling.py's results.jsonl")
    ap.add_argument("--mask", help="mask_scaling.py's results.jsonl")
    ap.add_argument("--heads-more", action="append", default=[], metavar="LABEL=PATH",
                    help="another heads_scaling.py results.jsonl drawn as its own series (repeatable)")
    ap.add_argument("--mask-more", action="append", default=[], metavar="LABEL=PATH",
                    help="another mask_scaling.py results.jsonl drawn as its own series (repeatable)")
    ap.add_argument("--bench", help="JSONL of full-protocol points and targets (see above)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not (args.heads or args.mask):
        raise SystemExit("give --heads and/or --mask")

    def read(path):
        return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()] if path else []
    heads, mask, bench = read(args.heads), read(args.mask), read(args.bench)
    curves = {"MTP heads (trained on N)": ([r for r in heads if "answers" in r], "answers", "tab:blue",
                                           next((r for r in heads if "reference" in r), None)),
              "mask adapter (N seen, from scratch)": ([r for r in mask if r.get("point") == "from scratch"],
                                                      "answers_seen", "tab:orange",
                                                      next((r for r in mask if r.get("point") != "from scratch"), None))}
    rows = 2 if bench else 1
    extra = [("--heads-more", spec, "MTP heads", "answers", ["tab:purple", "tab:cyan", "tab:olive"])
             for spec in args.heads_more]
    extra += [("--mask-more", spec, "mask adapter", "answers_seen", ["tab:red", "tab:brown", "tab:pink"])
              for spec in args.mask_more]
    for i, (flag, spec, kind, xkey, colors) in enumerate(extra):
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"{flag} {spec!r}: give LABEL=PATH")
        curves[f"{kind}: {label}"] = ([r for r in read(path) if xkey in r], xkey, colors[i % 3], None)
    legend_h = 1.4 if bench else 0.0  # the bench row's legend sits below the plots, never over the points
    fig, grid = plt.subplots(rows, len(SOURCES), figsize=(10, 3.8 * rows + legend_h), squeeze=False)
    axes = grid[0]
    for ax, (src, title) in zip(axes, SOURCES.items()):
        for label, (pts, xkey, color, ref) in curves.items():
            if not pts:
                continue
            ax.plot([p[xkey] for p in pts], [p[src] for p in pts], "o-", color=color, label=label)
            if ref is not None and src in ref:
                ax.axhline(ref[src], color=color, ls="--", lw=1, label=f"shipped {label.split(' (')[0]}")
        style(ax, title)
    axes[0].set_ylabel("held-out tokens per pass (verify:4)")
    lo, hi = axes[0].get_ylim()
    axes[0].set_ylim(lo - 0.55 * (hi - lo), hi)  # room under the curves, so the legend covers no point
    axes[0].legend(fontsize=7, loc="lower right")
    if bench:
        plot_bench(grid[1], bench)
        handles, labels = grid[1][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, legend_h / (3.8 * rows + legend_h), 1, 1))
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


def style(ax, title: str) -> None:
    ax.set_xscale("log")
    ax.set_title(title)
    ax.set_xlabel("training answers")
    ax.grid(alpha=0.3)


def plot_bench(axes, bench: list[dict]) -> None:
    series: dict[tuple, list] = {}
    for b in bench:
        if "target" not in b:
            series.setdefault((b["proposer"], b["recipe"]), []).append(b)
    for ax, (key, title) in zip(axes, BENCH.items()):
        markers = iter("os^Dv<>px" * 3)
        for (proposer, recipe), pts in series.items():
            pts = sorted(pts, key=lambda b: b["answers"])
            ax.plot([b["answers"] for b in pts], [b[key] for b in pts], next(markers) + "-",
                    color=COLORS.get(proposer, "tab:gray"), label=f"{proposer}: {recipe}")
        for t in (b for b in bench if "target" in b):
            ax.axhline(t[key], color=COLORS.get(t["target"], "tab:gray"), ls=":", lw=1,
                       label=t.get("label", f"target {t['target']}"))
        style(ax, title)
    axes[0].set_ylabel("tokens per pass, identical to ntp")


if __name__ == "__main__":
    raise SystemExit(main())
