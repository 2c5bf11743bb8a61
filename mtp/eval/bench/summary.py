"""`mtp bench`'s console summary (`print_summary`): the results table (a line per row; its speeds end to end
and decode-only, each with its ratio to ntp, as its caption says), tokens per pass per
prompt category when the prompts carry one, each long error in full, and with `--profile` the measured
t(q) and the advice lines (`mtp.eval.bench.advice`)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from mtp.eval import report
from mtp.eval.bench.rows import BenchResult
from mtp.eval.report import number

SHORT = 28  # characters of an error the table shows; a longer one is printed in full below it
SPEEDS = (
    "e2e: tokens / wall time of each request, prompt included (what a client waits for); decode: tokens after "
    "the prompt's pass / the time after it (ours from the decoding's passes, llama-server's its own "
    "timings.predicted_per_second; — where a peer reports none); × ntp: the ratio to ntp's of the same kind"
)


def print_summary(res: BenchResult, console=None) -> None:
    console = console or Console()
    console.print(_results_table(res))
    head, lines = report.category_table(res.records)
    if lines:  # tokens per pass per prompt category, and which part drafted the accepted tokens there
        ct = Table(title="tokens/pass per category (accepted drafts by proposer)")
        for c in head:
            ct.add_column(c, overflow="fold")
        for cells in lines:
            ct.add_row(*cells)
        console.print(ct)
    for rec in res.records:
        if rec["error"] and len(rec["error"]) > SHORT:
            console.print(f"{rec['strategy']}: {rec['error']}")
    if res.cost is not None:
        _print_profile(res, console)


def _results_table(res: BenchResult) -> Table:
    t = Table(
        title=f"mtp bench · {res.kind} · {len(res.items)} prompts · {res.env.get('threads')} threads",
        caption=SPEEDS,
    )
    cols = [
        "strategy",
        "n",
        "tok/pass",
        "tok/s e2e",
        "min–max",
        "× ntp (e2e)",
        "tok/s decode",
        "× ntp (decode)",
        "exact",
        "agree",
        "acc",
        "rougeL",
        "oracle",
        "error",
    ]
    if res.cost is not None:
        cols.insert(cols.index("× ntp (decode)") + 1, "predicted")
    if any(rec.get("accepted_share") for rec in res.records):  # rows that verified drafts: who drafted the accepted
        cols.insert(cols.index("error"), "drafted by")
    for c in cols:
        t.add_column(c, no_wrap=c != "error", overflow="fold")
    for rec in res.records:
        cells = {
            "strategy": rec["strategy"] + (" (peer)" if rec["peer"] else ""),
            "n": str(rec["n_prompts"]),
            "tok/pass": number(rec["tokens_per_forward"]),
            "tok/s e2e": number(rec["tokens_per_s"], 1),
            "min–max": f"{rec['tokens_per_s_spread'][0]:.1f}–{rec['tokens_per_s_spread'][1]:.1f}"
            if rec["tokens_per_s_spread"]
            else "",
            "× ntp (e2e)": number(rec["speedup_vs_ntp"]),
            "tok/s decode": number(rec.get("tokens_per_s_decode"), 1),
            "× ntp (decode)": number(rec.get("speedup_vs_ntp_decode")),
            "predicted": number(rec["predicted_speedup"]),
            "exact": number(rec["exact_match"]),
            "agree": number(rec["answer_agreement"]),
            "acc": number(rec["accuracy"]),
            "rougeL": number(rec["rougeL"]),
            "oracle": number(rec["oracle_tokens_per_forward"]),
            "drafted by": report.shares_text(rec.get("accepted_share")),
            "error": _short(rec["error"]),
        }
        t.add_row(*[cells[c] for c in cols])
    return t


def _print_profile(res: BenchResult, console) -> None:
    """The measured t(q) (its ends and linear fit; the masked one's ends when measured), then the advice."""
    a, b = res.cost.linear_fit()
    pts = res.cost.points
    console.print(
        f"t(q) at cache {res.cost.meta.get('cache_len')}: t(1) = {pts[min(pts)] * 1e3:.1f} ms, "
        f"t({max(pts)}) = {pts[max(pts)] * 1e3:.1f} ms; linear fit {a * 1e3:.1f} ms + "
        f"{b * 1e3:.2f} ms/token"
    )
    if res.mask_cost is not None:
        m = res.mask_cost.points
        console.print(
            f"t(q) of passes with mask rows (the adapters' path): t(1) = {m[min(m)] * 1e3:.1f} ms, "
            f"t({max(m)}) = {m[max(m)] * 1e3:.1f} ms"
        )
    for line in res.advice:
        console.print(line)


def _short(text: str | None, n: int = SHORT) -> str:
    return "" if not text else text if len(text) <= n else text[: n - 1] + "…"
