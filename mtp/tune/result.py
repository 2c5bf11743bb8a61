"""Section 8 of `mtp tune` (`result`): the deploy file (`mtp.core.policy.deploy`: the tuned arm and its
fallback, their caps, the calibrations of the proposers they use and their hashes, what was measured on
which hardware) and the results every candidate's row holds, as one dict (`mtp.tune.outputs.write`
saves it). A latency target no configuration meets is said in the log."""

from __future__ import annotations

import time

from mtp.core.decoding.strategy import Strategy
from mtp.core.policy import deploy as D
from mtp.eval.bench import environment
from mtp.tune.tuning import Row, Tuning


def result(t: Tuning, chosen: Row, fallback: str, price_pick: Row) -> dict:
    """8: the deploy file (`mtp.core.policy.deploy`: the tuned arm and its fallback, their caps,
    calibrations and hashes, what was measured) and the results every candidate's row holds."""
    cfg = t.cfg
    latency = None if chosen.measured_tps is None else 1e3 / chosen.measured_tps
    deploy = _deploy(t, chosen, fallback, latency)
    out = {
        "chosen": chosen.name,
        "fallback": fallback,
        "measure_all": cfg.measure_all,
        "price_pick": price_pick.name,
        "price_pick_vs_best": price_pick.measured_tps / chosen.measured_tps if chosen.measured_tps else None,
        "metric": t.metric,
        "tolerance": cfg.tolerance,
        "kind": t.kind,
        "prompts": t.n,
        "probe": t.n_probe,
        "measure": t.measured_prompts,
        "rows": [r.__dict__ for r in t.rows.values()],
        "calibration": t.cal_report,
        "predictability": t.predict,
        "unavailable": t.unavailable,
        "seconds": time.perf_counter() - t.t_start,
        "deploy": deploy,
    }
    if cfg.latency_ms is not None and latency is not None and latency > cfg.latency_ms:
        t.log(
            f"tune: no configuration meets {cfg.latency_ms:g} ms per token on this machine; the fastest "
            f"within the tolerance, {chosen.name}, takes {latency:.1f} ms"
        )
    return out


def _deploy(t: Tuning, chosen: Row, fallback: str, latency: float | None) -> D.Deploy:
    """The tuned arm (the chosen row) and its fallback, capped at the tuned strategy's K (and tau), with the
    calibrations of the proposers they use, their assets' hashes and what was measured where."""
    engine, cfg = t.engine, t.cfg
    tuned_arm, fallback_arm = _arm(chosen.name, engine), _arm(fallback, engine)
    used = {a.proposer for a in (tuned_arm, fallback_arm) if not a.strategy.plain}
    caps = {"max_k": tuned_arm.strategy.k}
    if tuned_arm.strategy.thresholded:
        caps["min_tau"] = tuned_arm.strategy.tau
    env = environment(engine)
    return D.Deploy(
        tuned=tuned_arm,
        fallback=fallback_arm,
        tolerance=cfg.tolerance,
        metric=t.metric,
        caps=caps,
        calibration={
            k: v
            for k, v in t.calibrations.items()
            if k.split("/")[0] in used or any(k.split("/")[0] in u.split("+") for u in used)
        },
        hashes=D.engine_hashes(engine, [a.proposer for a in (tuned_arm, fallback_arm) if not a.strategy.plain]),
        extra={
            "measured": {
                "arm": str(tuned_arm),
                "tokens_per_s": chosen.measured_tps,
                "speedup_vs_ntp": chosen.measured_speedup,
                "ms_per_token": latency,
                "loss": chosen.loss,
                "loss_items": chosen.loss_items,
                "tokens_per_forward": chosen.tokens_per_forward,
                "measure_prompts": t.measured_prompts,
                "data": cfg.data,
                "prompts": t.n,
            },
            "latency_target_ms": cfg.latency_ms,
            "latency_target_met": None if cfg.latency_ms is None or latency is None else latency <= cfg.latency_ms,
            "hardware": {**env, "t_q_ms": {str(q): round(1e3 * x, 3) for q, x in t.cost.points.items()}},
        },
    )


def _arm(name: str, engine) -> D.Arm:
    strategy, _, proposer = name.partition("@")
    return D.Arm(Strategy.parse(strategy), proposer or engine.config.proposer)
