"""Sections 1-3 of `mtp tune` (`reference`): greedy `ntp` answers of every prompt (batched), this machine's
t(q) at Q_POINTS (which `tree:auto` candidates then size their trees by), the model's predictability on its
own answers, and `ntp`'s steady price on the probe prompts, which every candidate's speedup is over."""

from __future__ import annotations

from mtp.core.decoding.strategy import Strategy
from mtp.core.policy.costmodel import measure
from mtp.tune import predictability
from mtp.tune.offline import decode_all
from mtp.tune.tuning import Tuning, steady_price

Q_POINTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 32)  # block sizes t(q) is measured at


def reference(t: Tuning) -> None:
    """1-3: greedy ntp answers of every prompt (batched), this machine's t(q), and the model's
    predictability on its own answers; ntp's steady price on the probe prompts."""
    engine, cfg = t.engine, t.cfg
    t.ref = decode_all(engine, t.prompts, Strategy(), None, cfg.max_new_tokens, cfg.batch).outputs
    t.log(f"tune: reference ntp answers: {sum(len(o.ids) for o in t.ref):,} tokens")
    cache_len = max(0, min(300, engine.context_window - Q_POINTS[-1]))
    t.cost = measure(engine.model, Q_POINTS, cache_len, 1, cfg.profile_repeats)  # interpolated between
    engine.cost_model = t.cost  # what tree:auto candidates size their trees by
    t.log(
        f"tune: t(1) {1e3 * t.cost.pass_time(1):.1f} ms, t(8) {1e3 * t.cost.pass_time(8):.1f} ms, "
        f"t(32) {1e3 * t.cost.pass_time(32):.1f} ms"
    )
    t.predict = predictability.report(engine.model, t.items, t.prompts, [o.ids for o in t.ref], t.hidden)
    t.ntp_tpf, t.ntp_price = steady_price(t.cost, t.ref[: t.n_probe], 0.0)
