"""The bench's pictures and its one-page report (self-contained HTML: plots inlined as base64).

- pareto.png: speed against quality, one point per row, peers drawn as squares. Left: tokens/s;
  right: tokens per forward pass. Quality = final-answer agreement with `ntp` (gsm8k) or ROUGE-L
  against `ntp` (prompts), the loss a user pays for the speed.
- acceptance.png: per-position acceptance (fraction of passes emitting more than i tokens).
- report.html: the table, tokens/pass per prompt category (with the accepted drafts' proposers) when
  the prompts carry one, both plots, the t(q) profile when measured, and the chunk view (each
  forward pass's tokens on one background colour; a pass that accepted drafts underlined in the
  colour of the proposer that drafted its accepted branch) for the first prompts.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

COLUMNS = [
    ("strategy", "strategy"),
    ("n_prompts", "n"),
    ("tokens_per_forward", "tokens/pass"),
    ("tokens_per_s", "tokens/s e2e"),
    ("speedup_vs_ntp", "× ntp (e2e)"),
    ("tokens_per_s_decode", "tokens/s decode"),
    ("speedup_vs_ntp_decode", "× ntp (decode)"),
    ("predicted_speedup", "predicted"),
    ("exact_match", "exact match"),
    ("answer_agreement", "answer agreement"),
    ("accuracy", "accuracy"),
    ("rougeL", "ROUGE-L"),
    ("oracle_tokens_per_forward", "oracle tokens/pass"),
    ("mean_block_tokens", "block tokens"),
    ("accepted_share", "accepted drafts by proposer"),
    ("error", "error"),
]
PAGE_CSS = (
    "body{font-family:sans-serif;max-width:1200px;margin:auto;padding:1em}table{border-collapse:collapse;"
    "font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}td:first-child{text-align:left}"
    "img{max-width:100%}"
)  # the pages of mtp bench and mtp tune
CHUNK_CSS = "".join(
    f".c{i}{{background:{c}}}" for i, c in enumerate(["#cfe2ff", "#d1e7dd", "#f8d7da", "#fff3cd", "#e2d9f3", "#d2f4ea"])
)
# the accepted branch's proposer (Engine.render_chunks' `from-NAME` classes): an underline per source
SOURCE_COLOURS = {
    "heads": "#0d6efd",
    "suffix": "#d63384",
    "lookup": "#198754",
    "eagle3": "#fd7e14",
    "mask": "#6f42c1",
    "mask-single": "#6f42c1",
}
SOURCE_CSS = "".join(f".from-{name}{{border-bottom:3px solid {c}}}" for name, c in SOURCE_COLOURS.items())


def number(x, digits: int = 2, none: str = "—") -> str:
    """A figure as console and log lines print it: `digits` decimals, `none` for None."""
    return none if x is None else f"{x:.{digits}f}"


def shares_text(share: dict | None) -> str:
    """`heads 62% lookup 41%`: accepted_share, largest first (a token several parts drafted counts for
    each, so a merge's shares may sum to more than 100%)."""
    return " ".join(f"{name} {100 * v:.0f}%" for name, v in sorted((share or {}).items(), key=lambda kv: -kv[1]))


def category_table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Per prompt category (prompts files with a 'category' field): a header and one line per row
    that has categories, each cell `tokens/pass (drafted by ...)`; ([], []) when none has."""
    cats = sorted({c for rec in records for c in rec.get("by_category") or {}})
    if not cats:
        return [], []
    lines = []
    for rec in records:
        per = rec.get("by_category") or {}
        if not per:
            continue
        cells = [rec["strategy"]]
        for c in cats:
            v = per.get(c)
            if v is None:
                cells.append("—")
                continue
            share = shares_text(v.get("accepted_share"))
            cells.append(f"{v['tokens_per_forward']:.2f}" + (f" ({share})" if share else ""))
        lines.append(cells)
    return ["strategy"] + [f"{c} (n={_cat_n(records, c)})" for c in cats], lines


def _cat_n(records: list[dict], c: str) -> int:
    return max((rec.get("by_category") or {}).get(c, {}).get("n", 0) for rec in records)


def _quality(rec: dict, kind: str) -> tuple[float | None, str]:
    if kind == "gsm8k":
        return rec.get("answer_agreement"), "answer agreement with ntp"
    return rec.get("rougeL"), "ROUGE-L vs ntp"


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (`mtp bench` and `mtp tune` plots)."""
    import matplotlib  # optional [bench] dependency: only the report's plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_png(res, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in (
        (axes[0], "tokens_per_s", "tokens / s (median)"),
        (axes[1], "tokens_per_forward", "tokens per forward pass"),
    ):
        for i, rec in enumerate(res.records):
            q, qlabel = _quality(rec, res.kind)
            x = rec.get(key)
            if x is None or q is None:
                continue
            ax.scatter(
                [x], [q], marker="s" if rec["peer"] else "o", s=50, color="tab:gray" if rec["peer"] else "tab:blue"
            )
            # staggered labels: rows of equal quality (lossless ones at 1.0) would print over each other
            ax.annotate(rec["strategy"], (x, q), textcoords="offset points", xytext=(4, 4 - 10 * (i % 3)), fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel(_quality({}, res.kind)[1])
        ax.set_ylim(-0.03, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_title("speed vs quality (squares: peers)")
    axes[1].set_title("tokens per pass vs quality")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance_png(res, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    drawn = 0
    for rec in res.records:
        acc = rec.get("acceptance_by_position")
        if not acc or len(acc) < 2:
            continue
        ax.plot(range(len(acc)), acc, marker="o", ms=3, label=rec["strategy"])
        drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no multi-token strategy in this run", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=8)
    ax.set_xlabel("position i in the pass's emitted block")
    ax.set_ylabel("fraction of passes emitting > i tokens")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile_png(cost, path: Path) -> None:
    plt = pyplot()
    qs = list(cost.points)
    ts = [cost.points[q] * 1e3 for q in qs]
    a, b = cost.linear_fit()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(qs, ts, "o-", ms=3, label="measured (median)")
    ax.plot(qs, [(a + b * q) * 1e3 for q in qs], "--", label=f"linear fit {a * 1e3:.1f} + {b * 1e3:.2f}·q ms")
    ax.set_xlabel("tokens fed in one pass (q)")
    ax.set_ylabel("ms per forward pass")
    ax.set_title(f"t(q) at cache length {cost.meta.get('cache_len')}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def img_tag(path: Path) -> str:
    """An <img> holding the PNG at `path` inline (a report is one self-contained HTML file)."""
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img alt="{html.escape(Path(path).stem)}" src="data:image/png;base64,{data}">'


def _cell(key: str, v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.1f}" if key in ("tokens_per_s", "tokens_per_s_decode") else f"{v:.3f}"
    if key == "accepted_share":
        return html.escape(shares_text(v)) or "—"
    return html.escape(str(v))


def table_html(records: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in COLUMNS)
    body = []
    for rec in records:
        cells = []
        for key, _ in COLUMNS:
            text = _cell(key, rec.get(key))
            if key == "strategy" and rec.get("peer"):
                text += " <small>(peer)</small>"
            if key == "tokens_per_s" and rec.get("tokens_per_s_spread"):
                lo, hi = rec["tokens_per_s_spread"]
                text += f" <small>({lo:.1f}–{hi:.1f})</small>"
            cells.append(f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table id="results"><tr>{head}</tr>{"".join(body)}</table>'


def chunk_view_html(res, engine, n_examples: int) -> str:
    if engine is None or n_examples <= 0:
        return "<p>(no chunk view)</p>"
    parts = []
    for j in range(min(n_examples, len(res.items))):
        parts.append(f"<h3>prompt {j}</h3><pre class=prompt>{html.escape(res.items[j]['prompt'])}</pre>")
        for row in res.rows:
            run = row.runs.get(j)
            if row.is_peer or run is None or run.result is None:
                continue
            r = run.result
            tpf = r.summary.get("tokens_per_forward", 0.0)
            parts.append(
                f"<h4>{html.escape(row.name)} · {len(r.token_ids)} tokens in {len(r.chunks)} passes "
                f"({tpf:.2f} tokens/pass)</h4><div class=chunks>{engine.render_chunks(r, as_html=True)}</div>"
            )
    return "".join(parts)


def write_html(res, path: Path, engine=None, command: str = "", chunk_examples: int = 2) -> None:
    out = Path(path).parent
    pieces = [
        f"<h1>mtp bench</h1><p><code>{html.escape(command)}</code></p>",
        f"<p>{html.escape(res.kind)} · {len(res.items)} prompts · greedy · environment: "
        + ", ".join(f"{html.escape(str(k))} <b>{html.escape(str(v))}</b>" for k, v in res.env.items())
        + "</p>",
        "<h2>Results</h2>",
        table_html(res.records),
        "<p>speedup = tokens/s over ntp's in the same run (rows interleaved prompt by prompt), median of "
        "repeats; quality against the ntp output; oracle = tokens/pass an ideal ConfAdapt would reach "
        "from ntp's own confidences.</p>",
    ]
    head, lines = category_table(res.records)
    if lines:
        pieces += [
            "<h2 id=categories>Per prompt category</h2><p>tokens/pass (accepted drafts by proposer) per "
            "category of the prompts file</p>",
            '<table id="by-category"><tr>'
            + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>" for cells in lines)
            + "</table>",
        ]
    pieces += [
        "<h2 id=pareto>Speed vs quality</h2>",
        img_tag(out / "pareto.png"),
        "<h2 id=acceptance>Per-position acceptance</h2>",
        img_tag(out / "acceptance.png"),
    ]
    if res.cost is not None:
        profile_png(res.cost, out / "profile.png")
        pieces += [
            "<h2 id=profile>Cost model t(q)</h2>",
            img_tag(out / "profile.png"),
            "<ul>" + "".join(f"<li>{html.escape(a)}</li>" for a in res.advice) + "</ul>",
        ]
    legend = " ".join(f'<span class="from-{n}">{n}</span>' for n in SOURCE_COLOURS if n != "mask-single")
    pieces += [
        "<h2 id=chunks>Chunk view</h2><p>Tokens emitted by one forward pass share a background colour; "
        f"a pass that accepted drafts is underlined in the colour of the proposer that drafted the accepted "
        f"branch ({legend}; hover a pass for its accepted drafts per proposer).</p>",
        chunk_view_html(res, engine, chunk_examples),
    ]
    style = PAGE_CSS + (
        ".chunks{white-space:pre-wrap;font-family:monospace;line-height:1.6}"
        "pre.prompt{white-space:pre-wrap;background:#f6f6f6;padding:6px}" + CHUNK_CSS + SOURCE_CSS
    )
    Path(path).write_text(
        f"<!doctype html><html><head><meta charset=utf-8><title>mtp bench</title>"
        f"<style>{style}</style></head><body>{''.join(pieces)}</body></html>",
        encoding="utf-8",
    )
