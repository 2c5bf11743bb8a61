"""Section 5 of `mtp tune` (`probe`): every candidate priced in steady state on its probe passes. A
lossless one whose proposer reads only the context and the hidden state is replayed on every reference
answer (`mtp.tune.simulate`), the others decode the first `probe` prompts, batched. A lossy candidate is
first priced optimistically from its proposer's recorded calibration passes (`mtp.tune.bound`) and not
decoded when even that price is below the best lossless one's (unless `measure_all`); one whose probe
alone exceeds the tolerance is set aside, and with it its family's lossier members."""

from __future__ import annotations

from mtp.core.decoding import metrics
from mtp.core.decoding.strategy import Strategy
from mtp.core.policy import deploy as D
from mtp.core.policy import quality
from mtp.tune import candidates as C
from mtp.tune.bound import lossy_bound
from mtp.tune.offline import decode_all
from mtp.tune.simulate import can_replay
from mtp.tune.tuning import Row, Tuning, steady_price

BOUND_MARGIN = 0.05  # a lossy candidate is not decoded when its optimistic price is this far below the best lossless


def probe(t: Tuning) -> None:
    """5: every candidate priced in steady state on its replayed or decoded probe passes; a lossy one
    not decoded when even its optimistic price loses, and set aside when its probe alone exceeds the
    tolerance (and with it its family's lossier members)."""
    t.rows = {"ntp": Row("ntp", True, t.ntp_tpf, t.ntp_price, 1.0, 0.0, 0.0, t.n, True)}
    order = [c for c in t.cands if c.lossless] + sorted(
        (c for c in t.cands if not c.lossless), key=lambda c: (c.family, c.risk)
    )
    for c in order:
        if not c.lossless and t.family_failed(c):
            t.rows[str(c)] = Row(
                str(c),
                False,
                qualifies=False,
                note="not probed: a less lossy member of its family already exceeded the tolerance",
            )
            continue
        bound = None if c.lossless else _bound(t, c)
        if bound is not None and _bound_loses(t, c, bound):
            continue
        t.rows[str(c)] = _probe_row(t, c, bound)


def _bound(t: Tuning, c: C.Candidate):
    """A lossy candidate's optimistic (tokens per pass, price) from its proposer's recorded
    calibration passes (mtp.tune.bound); None without them."""
    records = t.probe_runs.get(str(D.Arm(Strategy.parse("verify:4"), c.proposer)))
    if records is None:
        return None
    return lossy_bound(
        c.strategy,
        t.engine.proposer(c.proposer).n_appended(c.strategy.k, 0),
        t.cost,
        records,
        t.calibrations.get(c.proposer),
    )


def _bound_loses(t: Tuning, c: C.Candidate, bound) -> bool:
    """Whether lossy `c`'s optimistic price is already below the best lossless one's (unless
    `measure_all`): then its row says so and it is never decoded."""
    best = max(r.predicted_tps for r in t.rows.values() if r.lossless)
    if t.cfg.measure_all or bound[1] >= (1 - BOUND_MARGIN) * best:
        return False
    t.rows[str(c)] = Row(
        str(c),
        False,
        bound[0],
        bound[1],
        bound[1] / t.ntp_price,
        bound_speedup=bound[1] / t.ntp_price,
        note="not decoded: even its optimistic price from the recorded passes is below the best lossless candidate's",
    )
    t.unprobed.add(str(c))
    t.log(
        f"tune: skip {c}: at most {bound[0]:.2f} tokens/pass, {bound[1] / t.ntp_price:.2f}x ntp "
        f"(the best lossless: {best / t.ntp_price:.2f}x)"
    )
    return True


def _probe_row(t: Tuning, c: C.Candidate, bound) -> Row:
    """Candidate `c`'s row from its probe passes: price, acceptance (by category too), probe loss."""
    cfg, probe, kind = t.cfg, t.n_probe, t.kind
    stats = t.probe_runs.get(str(c))
    if stats is None:
        stats = (
            t.lossless(c.strategy, c.proposer)
            if c.lossless
            else decode_all(t.engine, t.prompts[:probe], c.strategy, c.proposer, cfg.max_new_tokens, cfg.batch)
        )
    tpf, price = steady_price(t.cost, stats.outputs, stats.proposing_s)
    row = Row(str(c), c.lossless, tpf, price, price / t.ntp_price if t.ntp_price else None)
    chunks = [x for o in stats.outputs for x in o.chunks[1:]]
    k = c.strategy.k
    row.acceptance_by_position = metrics.acceptance_by_position(chunks, k)
    for cat in sorted({it.get("category", kind) for it in t.items[: len(stats.outputs)]}):  # by category
        cc = [x for it, o in zip(t.items, stats.outputs) if it.get("category", kind) == cat for x in o.chunks[1:]]
        row.by_category[cat] = {
            "tokens_per_forward": metrics.tokens_per_forward(cc),
            "acceptance_by_position": metrics.acceptance_by_position(cc, k),
        }
    row.probe_loss = quality.mean_loss(t.metric, [(o.ids, o.text) for o in stats.outputs], t.refs[: len(stats.outputs)])
    row.note = (
        f"replayed on {len(stats.outputs)} answers"
        if c.lossless and can_replay(c.proposer)
        else f"decoded on {len(stats.outputs)} prompts"
    )
    if c.lossless:
        row.loss, row.loss_items, row.qualifies = 0.0, t.n, True
    elif row.probe_loss * probe > t.budget:
        row.qualifies, row.note = False, "exceeds the tolerance on the probe prompts alone"
        row.loss, row.loss_items = row.probe_loss, probe
        t.set_aside(c)
    if not c.lossless and bound is not None:
        row.bound_speedup = bound[1] / t.ntp_price
    t.log(
        f"tune: probe {c}: {tpf:.2f} tokens/pass, priced {row.predicted_speedup:.2f}x ntp"
        + (
            ""
            if c.lossless
            else f", loss {row.probe_loss:.3f} on {probe} prompts"
            + ("" if bound is None else f" (optimistic price {row.bound_speedup:.2f}x)")
        )
    )
    return row
