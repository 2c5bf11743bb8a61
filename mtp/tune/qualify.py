"""Section 6 of `mtp tune` (`qualify`): a lossy candidate that could win (priced at least as fast as the
best lossless one) and whose lossier family members did not already fail decodes every prompt, stopping
as soon as its loss can no longer stay within the tolerance (`check_quality`); lossless candidates always
qualify. With `measure_all` the lossy candidates are returned instead, to be measured first (section 7)."""

from __future__ import annotations

from mtp.core.policy import quality
from mtp.tune import candidates as C
from mtp.tune.offline import decode_all
from mtp.tune.tuning import Row, Tuning


def check_quality(t: Tuning, c: C.Candidate, row: Row) -> None:
    """Decode every prompt with lossy `c`, stopping once its loss can no longer stay within the tolerance."""
    spent = {"loss": 0.0, "items": 0}
    refs = t.refs

    def over(j, out):
        spent["loss"] += quality.item_loss(t.metric, out.ids, out.text, *refs[j])
        spent["items"] += 1
        return spent["loss"] > t.budget

    outs = decode_all(
        t.engine, t.prompts, c.strategy, c.proposer, t.cfg.max_new_tokens, t.cfg.batch, stop_after=over
    ).outputs
    row.loss_items = len(outs)
    row.loss = quality.mean_loss(t.metric, [(o.ids, o.text) for o in outs], refs[: len(outs)])
    row.qualifies = spent["loss"] <= t.budget and len(outs) == t.n
    if not row.qualifies:
        row.note = f"exceeds the tolerance (stopped after {spent['items']} prompts)"
        t.set_aside(c)
    t.log(
        f"tune: quality {c}: loss {row.loss:.3f} over {row.loss_items} prompts -> "
        f"{'within' if row.qualifies else 'outside'} the tolerance"
    )


def qualify(t: Tuning) -> dict[str, C.Candidate]:
    """6: the quality of the lossy candidates that could win (priced at least as fast as the best
    lossless one). Returns, with `measure_all`, those whose speed is measured first instead."""
    best_lossless = max(r.predicted_tps for r in t.rows.values() if r.lossless)
    deferred: dict[str, C.Candidate] = {}
    for c in sorted((c for c in t.cands if not c.lossless), key=lambda c: (c.family, c.risk)):
        row = t.rows[str(c)]
        if row.qualifies is False or row.name in t.unprobed:
            continue  # decided by its probe, or by its optimistic price
        if t.family_failed(c):
            row.qualifies, row.note = False, "a less lossy member of its family already exceeded the tolerance"
            continue
        if t.cfg.measure_all:  # only one measured faster than every lossless candidate needs its quality
            deferred[row.name] = c
            continue
        if row.predicted_tps < best_lossless:
            row.qualifies = None
            row.note = "not run on every prompt: priced slower than the best lossless candidate"
            continue
        check_quality(t, c, row)
    return deferred
