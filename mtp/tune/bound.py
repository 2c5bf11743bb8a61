"""An optimistic price for a lossy candidate, from passes already recorded: whether it is worth decoding.

`mtp tune` records a `verify:4` run of every proposer with confidences for calibration (the guesses'
raw confidences, pass by pass, on the model's own greedy trajectory). A `conf_adapt:TAU:K` pass over
the same states would emit the model's own token plus the leading guesses whose calibrated
confidence is at least TAU (at most K-1), and feed them back through the next pass with the
proposer's masks; a `static:K` pass emits K tokens and feeds K back. Pricing those passes with the
cost model gives what the lossy candidate could reach — an upper bound as far as the confidence of
the model's own token goes (taken as 1 here: a real pass whose own token is below TAU emits one
token), while a real decode leaves the reference trajectory after its first wrong guess. So a lossy
candidate whose bound is clearly below the best lossless candidate's price cannot win and is not
decoded (`--measure-all` decodes it anyway).
"""

from __future__ import annotations

from mtp.core.decoding.strategy import Strategy

RECORDED_GUESSES = 3  # verify:4 records three guesses per pass


def lossy_bound(strategy: Strategy, appended: int, cost, records, calibration=None) -> tuple[float, float] | None:
    """(tokens per pass, tokens/s) a lossy strategy could reach over `records` (a `RunStats` of a
    recorded `verify:4` run of its proposer), its proposer appending `appended` masks to each pass;
    None where the records cannot tell (conf_adapt with more guesses than recorded)."""
    if strategy.kind == "conf_adapt" and strategy.k - 1 > RECORDED_GUESSES:
        return None
    passes = [confs for out in records.outputs for confs in out.proposals[1:]]  # the prompt's pass left out
    if not passes:
        return None
    per_call = records.guess_s * (strategy.k - 1)  # the proposer is asked for K-1 guesses every pass
    tokens, seconds, fed = 0, 0.0, 1
    for confs in passes:
        if strategy.kind == "static":
            n = strategy.k
        else:
            mapped = [
                calibration.map(d, c) if calibration is not None else c for d, c in enumerate(confs[: strategy.k - 1])
            ]
            n = strategy.emit_count([1.0] + mapped)
        seconds += cost.pass_time(fed + appended) + per_call
        tokens += n
        fed = n
    return tokens / len(passes), tokens / seconds
