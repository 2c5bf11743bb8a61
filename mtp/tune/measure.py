"""Section 7 of `mtp tune` (`measure`): the finalists (`finalists`: the best qualifying candidates by price,
`measure_rows` of them, plus mask-token ones within UNCERTAIN_BAND of the top, whose adapter cost t(q)
does not include; with `measure_all` every qualifying and deferred one) decoded one prompt at a time,
interleaved with `ntp`, on the first `measure` prompts (`mtp.eval.bench.run_bench`). The fastest measured
qualifying one is chosen; the fallback is the fastest measured lossless one (`ntp` for a lossless choice)."""

from __future__ import annotations

from mtp.core.decoding.strategy import Strategy
from mtp.eval.bench import BenchConfig, Spec, run_bench
from mtp.eval.report import number
from mtp.tune import candidates as C
from mtp.tune.qualify import check_quality
from mtp.tune.tuning import Row, Tuning

UNCERTAIN_BAND = 0.15  # mask-token candidates priced within this of the best are measured too


def finalists(t: Tuning, deferred: dict[str, C.Candidate]) -> list[Row]:
    """The candidates measured one prompt at a time: the best qualifying ones by price (plus
    mask-token ones near the top), or with `measure_all` every qualifying and deferred one."""
    rows = t.rows
    best_lossless = max(r.predicted_tps for r in rows.values() if r.lossless)
    qualifying = sorted((r for r in rows.values() if r.qualifies and r.name != "ntp"), key=lambda r: -r.predicted_tps)
    could_win = sorted(
        qualifying + [rows[k] for k in deferred if rows[k].predicted_tps >= best_lossless],
        key=lambda r: -r.predicted_tps,
    )  # what a default run would have checked and ranked
    top = could_win[0].predicted_tps if could_win else 0.0
    t.by_price = [
        r
        for i, r in enumerate(could_win)  # the finalists by price (what a default run measures)
        if i < t.cfg.measure_rows or ("@mask" in r.name and r.predicted_tps >= (1 - UNCERTAIN_BAND) * top)
    ]
    return qualifying + [rows[k] for k in deferred] if t.cfg.measure_all else t.by_price


def measure(t: Tuning, deferred: dict[str, C.Candidate]) -> tuple[Row, str, Row]:
    """7: the finalists decoded one prompt at a time, interleaved with ntp (`run_bench`); a deferred
    lossy candidate measured faster than every lossless one then decodes every prompt for its
    quality. Returns (the fastest measured qualifying row, the fallback's name: the fastest measured
    lossless one, ntp for a lossless choice; what the default rule would have picked)."""
    rows, cfg = t.rows, t.cfg
    chosen_from = finalists(t, deferred)
    specs = [Spec(Strategy())] + [Spec(Strategy.parse(r.name.split("@")[0]), r.name.split("@")[1]) for r in chosen_from]
    m = t.measured_prompts = min(cfg.measure, t.n)
    t.log(
        f"tune: measuring ntp and {len(chosen_from)} finalists on {m} prompts, one at a time: "
        + ", ".join(r.name for r in chosen_from)
    )
    bench = run_bench(t.engine, t.kind, t.items[:m], BenchConfig(specs, max_new_tokens=cfg.max_new_tokens))
    for rec in bench.records:
        r = rows.get(rec["strategy"])
        if r is not None:
            r.measured_tps, r.measured_speedup, r.measured_exact = (
                rec["tokens_per_s"],
                rec["speedup_vs_ntp"],
                rec["exact_match"],
            )
    fastest_lossless = max(r.measured_tps for r in rows.values() if r.lossless and r.measured_tps is not None)
    for name, c in deferred.items():
        row = rows[name]
        if row.measured_tps is not None and row.measured_tps > fastest_lossless:
            check_quality(t, c, row)
        else:
            row.note = "measured slower than the fastest lossless candidate: its quality cannot change the choice"
    measured = [r for r in rows.values() if r.measured_tps is not None and r.qualifies]
    chosen = max(measured, key=lambda r: r.measured_tps)
    # with --measure-all: what the default rule would have chosen, from the same interleaved run
    price_pick = max([rows["ntp"]] + [r for r in t.by_price if r.qualifies], key=lambda r: r.measured_tps or 0.0)
    _log_measured(t, measured, chosen, price_pick)
    lossless_measured = [r for r in measured if r.lossless and r is not chosen]
    fallback = "ntp" if chosen.lossless else max(lossless_measured, key=lambda r: r.measured_tps).name
    return chosen, fallback, price_pick


def _log_measured(t: Tuning, measured: list[Row], chosen: Row, price_pick: Row) -> None:
    for r in sorted(measured, key=lambda r: -r.measured_tps):
        t.log(
            f"tune: measured {r.name}: {r.measured_tps:.2f} tokens/s, {number(r.measured_speedup, none='-')}x ntp "
            f"(priced {number(r.predicted_speedup, none='-')}x)"
        )
    for r in sorted(
        (r for r in t.rows.values() if r.measured_tps is not None and not r.qualifies),
        key=lambda r: -r.measured_tps,
    ):
        t.log(
            f"tune: measured {r.name}: {r.measured_tps:.2f} tokens/s, {number(r.measured_speedup, none='-')}x ntp "
            f"(priced {number(r.predicted_speedup, none='-')}x; not qualifying: {r.note})"
        )
    if t.cfg.measure_all:
        t.log(
            f"tune: full sweep's best {chosen.name} {chosen.measured_tps:.2f} tokens/s; the default rule "
            f"(finalists by price) would pick {price_pick.name} {price_pick.measured_tps:.2f} tokens/s "
            f"({price_pick.measured_tps / chosen.measured_tps:.3f} of the best)"
        )
