"""One figure of both data-scaling curves: held-out tokens per pass (what `verify:4` accepts on the
model's own greedy text) against training answers, for the MTP heads (`heads_scaling.py`: answers
trained on) and the mask adapter (`mask_scaling.py`: answers seen in one pass from scratch), per
held-out source, with the shipped proposers as dashed reference lines.

    python benchmarks/plot_scaling.py --heads benchmarks/results/scaling/heads.jsonl \\
        --mask benchmarks/results/scaling/mask.jsonl --out benchmarks/results/scaling/scaling.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SOURCES = {"gsm8k": "GSM8K (held-out answers)", "self_written": "self-written requests (held out)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", help="heads_scaling.py's results.jsonl")
    ap.add_argument("--mask", help="mask_scaling.py's results.jsonl")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not (args.heads or args.mask):
        raise SystemExit("give --heads and/or --mask")

    def read(path):
        return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()] if path else []
    heads, mask = read(args.heads), read(args.mask)
    curves = {"MTP heads (trained on N)": ([r for r in heads if "answers" in r], "answers", "tab:blue",
                                           next((r for r in heads if "reference" in r), None)),
              "mask adapter (N seen, from scratch)": ([r for r in mask if r.get("point") == "from scratch"],
                                                      "answers_seen", "tab:orange",
                                                      next((r for r in mask if r.get("point") != "from scratch"), None))}
    fig, axes = plt.subplots(1, len(SOURCES), figsize=(10, 3.8), sharey=True)
    for ax, (src, title) in zip(axes, SOURCES.items()):
        for label, (pts, xkey, color, ref) in curves.items():
            if not pts:
                continue
            ax.plot([p[xkey] for p in pts], [p[src] for p in pts], "o-", color=color, label=label)
            if ref is not None and src in ref:
                ax.axhline(ref[src], color=color, ls="--", lw=1, label=f"shipped {label.split(' (')[0]}")
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("training answers")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out tokens per pass (verify:4)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
