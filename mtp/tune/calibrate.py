"""Section 4 of `mtp tune` (`calibrate`): for each proposer with confidences a `verify:4` run records
(confidence, right) per depth; for each part of a merged candidate a `tree:16` run records (node
confidence, whether its root path is the model's continuation) per node depth. A map per depth is fitted
on every prompt and its expected calibration error measured by two-fold cross-fitting (`fit_held_out`);
the engine then reads the maps (a map that makes held-out guesses worse is not used). The recorded runs
are kept (`Tuning.probe_runs`): the probe reuses them."""

from __future__ import annotations

from mtp.core.decoding.strategy import Strategy
from mtp.core.engine import TREE_SUFFIX
from mtp.core.policy import calibration as calib
from mtp.core.policy import deploy as D
from mtp.eval.report import number
from mtp.tune.offline import chain_pairs, tree_pairs
from mtp.tune.tuning import Tuning


def calibrate(t: Tuning) -> None:
    """4: chains of each confidence proposer (conf_adapt reads them), trees of each part of a merged
    candidate (the merge then compares calibrated node probabilities); the engine reads the maps."""
    chain_parts = sorted({c.proposer for c in t.cands if c.strategy.thresholded})
    tree_parts = sorted({p for c in t.cands if c.strategy.is_tree and "+" in c.proposer for p in c.proposer.split("+")})
    for key, arm, pairs_of in [(p, D.Arm(Strategy.parse("verify:4"), p), chain_pairs) for p in chain_parts] + [
        (p + TREE_SUFFIX, D.Arm(Strategy.parse("tree:16"), p), tree_pairs) for p in tree_parts
    ]:
        stats = t.lossless(arm.strategy, arm.proposer, record=True)
        t.probe_runs[str(arm)] = stats
        fitted, rep = fit_held_out([pairs_of(o) for o in stats.outputs])
        t.calibrations[key], t.cal_report[key] = fitted, rep
        t.engine.config.calibration[key] = fitted
        t.log(
            f"tune: calibration of {key}: ECE {number(rep['ece_before'], 3, '-')} -> "
            f"{number(rep['ece_after'], 3, '-')} on {rep['test_pairs']} held-out guesses "
            f"(noise floor {number(rep['ece_floor'], 3, '-')})"
            + ("" if rep["used"] else " (worse: not used, raw confidences kept)")
        )


def fit_held_out(per_prompt: list[list[list[tuple[float, bool]]]]) -> tuple[calib.Calibration, dict]:
    """A per-depth calibration fitted on every prompt's pairs, and its expected calibration error
    before and after measured by two-fold cross-fitting over prompts: a map fitted on the
    even-numbered prompts is scored on the odd ones and one fitted on the odd ones on the even ones;
    each error (and the noise floor) is the mean of the two folds' errors. Every prompt is held out
    once, so all of them measure the fit; the folds are scored apart, since pooling them would let
    one fold's over-confidence cancel the other's under-confidence in a shared bin."""
    folds: tuple[list[list], list[list]] = ([], [])
    everything: list[list] = []
    for j, depths in enumerate(per_prompt):
        for target in (folds[j % 2], everything):
            for d, pairs in enumerate(depths):
                while len(target) <= d:
                    target.append([])
                target[d].extend(pairs)
    scores, before_all, after_all = [], [], []
    for fit_on, score_on in ((0, 1), (1, 0)):
        if not any(folds[fit_on]):  # one prompt only: nothing to fit this fold on, so nothing to score
            continue
        fold_map = calib.fit(folds[fit_on])
        before = [p for d in folds[score_on] for p in d]
        after = [(fold_map.map(d, c), r) for d, pairs in enumerate(folds[score_on]) for c, r in pairs]
        if before:
            scores.append(
                (
                    calib.expected_calibration_error(before),
                    calib.expected_calibration_error(after),
                    calib.ece_floor([c for c, _ in after]),
                )
            )  # what sampling noise alone leaves on this many guesses
        before_all += before  # the reliability diagrams show both folds' held-out guesses together
        after_all += after
    mean = (lambda i: sum(s[i] for s in scores) / len(scores)) if scores else (lambda i: None)
    ece_before, ece_after, floor = mean(0), mean(1), mean(2)
    fitted = calib.fit(everything)
    kept = ece_before is None or ece_after is None or ece_after <= ece_before
    report = {
        "fit_pairs": sum(map(len, everything)),
        "test_pairs": len(before_all),
        "folds": len(scores),
        "ece_before": ece_before,
        "ece_after": ece_after,
        "ece_floor": floor,
        "used": kept,
        "reliability_before": calib.reliability(before_all),
        "reliability_after": calib.reliability(after_all),
        "maps": fitted.to_json(),
    }
    if not kept:  # a map that makes the held-out answers worse is not used: the raw confidences stay
        fitted = calib.Calibration((calib.DepthMap(),))
    return fitted, report
