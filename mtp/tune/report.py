"""`mtp tune`'s pictures and page (self-contained HTML, plots inlined):

- pareto.png: every candidate's speed (measured tokens/s where measured, else its price from the
  cost model, hollow) against its quality loss, the tolerance drawn as a line, the choice circled;
- reliability.png: per proposer with confidences, accuracy against confidence on held-out guesses
  before and after calibration (the diagonal is perfect calibration);
- report.html: the choice and its fallback, the candidates table, the predictability table, the
  calibration errors and both plots.
"""

from __future__ import annotations

import html
from pathlib import Path

from mtp.eval.report import PAGE_CSS, img_tag, pyplot

COLUMNS = [
    ("name", "candidate"),
    ("tokens_per_forward", "tokens/pass"),
    ("predicted_speedup", "priced speedup"),
    ("measured_tps", "measured tok/s"),
    ("measured_speedup", "measured speedup"),
    ("probe_loss", "probe loss"),
    ("loss", "loss"),
    ("loss_items", "loss over"),
    ("qualifies", "within tolerance"),
    ("note", "note"),
]


def pareto_png(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ntp = next(r for r in result["rows"] if r["name"] == "ntp")
    for i, r in enumerate(result["rows"]):
        loss = r["loss"] if r["loss"] is not None else r["probe_loss"]
        if loss is None:
            continue
        measured = r["measured_speedup"] is not None
        x = r["measured_speedup"] if measured else r["predicted_speedup"]
        if x is None:
            continue
        colour = "tab:green" if r["lossless"] else "tab:orange"
        ax.scatter([x], [loss], s=45, color=colour if measured else "none", edgecolors=colour)
        if measured or loss > 0:  # priced lossless points crowd the zero line: the table names them
            ax.annotate(r["name"], (x, loss), textcoords="offset points", xytext=(4, 3 - 9 * (i % 3)), fontsize=7)
        if r["name"] == result["chosen"]:
            ax.scatter([x], [loss], s=220, facecolors="none", edgecolors="black", linewidths=1.5)
    ax.axhline(result["tolerance"], color="tab:red", ls="--", lw=1, label=f"tolerance {result['tolerance']:g}")
    ax.axvline(1.0, color="gray", lw=0.6)
    ax.set_xlabel("speedup vs ntp (filled: measured one prompt at a time; hollow: priced by t(q))")
    ax.set_ylabel(f"quality loss ({result['metric']})")
    ax.set_title(f"candidates · chosen {result['chosen']} (circled) · ntp {ntp['measured_tps'] or 0:.1f} tok/s")
    ax.set_ylim(bottom=-0.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reliability_png(result: dict, path: Path) -> None:
    plt = pyplot()
    cal = result["calibration"]
    cols = min(3, max(1, len(cal)))
    nrows = max(1, -(-len(cal) // cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 4.0 * nrows), squeeze=False)
    for ax in axes.flat[len(cal) :]:
        ax.axis("off")
    for ax, (name, rep) in zip(axes.flat, cal.items()):
        for key, label, style in (("reliability_before", "raw", "o--"), ("reliability_after", "calibrated", "s-")):
            bins = rep[key]
            ece = rep["ece_before" if key.endswith("before") else "ece_after"]
            ax.plot(
                [b["confidence"] for b in bins],
                [b["accuracy"] for b in bins],
                style,
                ms=4,
                label=f"{label} (ECE {ece:.3f})" if ece is not None else label,
            )
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8)
        ax.set_title(f"{name}: {rep['test_pairs']} held-out guesses")
        ax.set_xlabel("confidence")
        ax.set_ylabel("right (equals the greedy token)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if not cal:
        axes[0][0].axis("on")
        axes[0][0].text(0.5, 0.5, "no candidate with confidences", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}"
    return html.escape(str(v))


def write(result: dict, out: Path) -> None:
    pareto_png(result, out / "pareto.png")
    reliability_png(result, out / "reliability.png")
    d = result["deploy"]
    rows = "".join(
        "<tr>" + "".join(f"<td>{_cell(r.get(k))}</td>" for k, _ in COLUMNS) + "</tr>" for r in result["rows"]
    )
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in COLUMNS)
    taus = sorted({t for p in result["predictability"].values() for t in p["share_at_least"]}, key=float)
    pred_head = (
        "<tr><th>category</th><th>items</th><th>tokens</th><th>entropy (nats)</th><th>top-1 prob</th>"
        + "".join(f"<th>share ≥ {t}</th>" for t in taus)
        + "</tr>"
    )
    pred_rows = "".join(
        f"<tr><td>{html.escape(cat)}</td><td>{p['items']}</td><td>{p['tokens']}</td><td>{_cell(p['entropy_mean'])}</td>"
        f"<td>{_cell(p['top1_mean'])}</td>"
        + "".join(f"<td>{_cell(p['share_at_least'][t])}</td>" for t in taus)
        + "</tr>"
        for cat, p in result["predictability"].items()
    )
    cal_rows = "".join(
        f"<li>{html.escape(n)}: ECE {_cell(c['ece_before'])} → {_cell(c['ece_after'])} on "
        f"{c['test_pairs']} held-out guesses (fitted on {c['fit_pairs']})</li>"
        for n, c in result["calibration"].items()
    )
    cats = sorted({c for r in result["rows"] for c in r.get("by_category", {})})
    acc_head = "<tr><th>candidate</th>" + "".join(f"<th>{html.escape(c)}</th>" for c in cats) + "</tr>"
    acc_rows = "".join(
        f"<tr><td>{html.escape(r['name'])}</td>"
        + "".join(
            "<td>"
            + (
                " / ".join(f"{a:.2f}" for a in r["by_category"][c]["acceptance_by_position"][1:6])
                if c in r.get("by_category", {})
                else "—"
            )
            + "</td>"
            for c in cats
        )
        + "</tr>"
        for r in result["rows"]
        if r.get("by_category")
    )
    measured = d.extra.get("measured", {})
    pieces = [
        "<h1>mtp tune</h1>",
        f"<p><code>{html.escape(d.extra.get('command', ''))}</code></p>",
        f"<h2>Choice</h2><p>tuned: <b>{html.escape(str(d.tuned))}</b> · fallback (lossless): "
        f"<b>{html.escape(str(d.fallback))}</b> · tolerance {d.tolerance:g} on {html.escape(d.metric)} · "
        f"measured {_cell(measured.get('tokens_per_s'))} tokens/s, {_cell(measured.get('speedup_vs_ntp'))}× ntp, "
        f"loss {_cell(measured.get('loss'))} over {measured.get('loss_items')} prompts · "
        f"{result['prompts']} prompts, probe {result['probe']}, measured on {result['measure']} · "
        f"{result['seconds']:.0f} s</p>",
        "<h2>Candidates</h2>",
        f"<table><tr>{head}</tr>{rows}</table>",
        "<p>priced speedup: steady-state tokens / (Σ t(block) + proposing time) on the probe prompts, "
        "against ntp's; loss: mean per-prompt loss against the ntp answer; lossless candidates are exact by "
        "construction.</p>",
        "<h2>Speed vs quality</h2>",
        img_tag(out / "pareto.png"),
        "<h2>Predictability</h2>",
        f"<table>{pred_head}{pred_rows}</table>",
        "<h3>What each candidate accepts, by depth and category (probe prompts)</h3>",
        "<p>fraction of passes emitting more than 1, 2, 3, ... tokens</p>",
        f"<table>{acc_head}{acc_rows}</table>",
        "<h2>Calibration</h2>",
        f"<ul>{cal_rows or '<li>no candidate with confidences</li>'}</ul>",
        img_tag(out / "reliability.png"),
    ]
    (out / "report.html").write_text(
        f"<!doctype html><html><head><meta charset=utf-8><title>mtp tune</title>"
        f"<style>{PAGE_CSS}</style></head><body>{''.join(pieces)}</body></html>",
        encoding="utf-8",
    )
