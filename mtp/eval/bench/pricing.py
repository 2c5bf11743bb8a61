"""How `--profile` prices a bench row with the cost model: which t(q) prices its passes (`row_cost`: the
masked one for a row feeding gated masks, `feeds_gated_masks`), the loop's own time per pass calibrated
on `ntp` (`loop_overhead`), and the tokens/s a tree row should measure if its drafts deliver what they
promise (`predict_row_tokens_per_s`)."""

from __future__ import annotations

import torch

from mtp.core.decoding import metrics
from mtp.eval.bench.rows import Row, Run, outside_seconds, tokens_per_s_by_repeat


def feeds_gated_masks(engine, row: Row) -> bool:
    """Whether `row`'s passes feed mask tokens (its proposer appends them) that the model's adapters act on:
    such a pass runs the adapters op by op instead of the fused kernels, so the plain t(q) underprices it."""
    if row.is_peer or row.strategy.plain or engine.model.config.mask_token_id is None:
        return False
    if not engine.proposer(row.proposer).n_appended(max(2, row.strategy.k), 1):
        return False
    mask = torch.tensor([[engine.model.config.mask_token_id]])
    return engine.model.adapter_gate(mask) is not None


def row_cost(row: Row, cost, mask_cost):
    """The t(q) that prices `row`'s passes: `mask_cost` for a row feeding gated masks (None when it was
    not measured: such a row cannot be priced), else `cost`."""
    return mask_cost if row.masks else cost


def loop_overhead(cost, ref: Row, repeats: int) -> float:
    """Seconds per pass the `ntp` row spent beyond the cost model's t(q) of its passes and its decoding steps'
    own time outside them (`Row.outside_s`): the loop around the steps (the caller, Python), per pass. Its
    measured wall time (as its tokens/s counts it) less both, over its passes; 0 when negative."""
    runs = list(ref.runs.values())
    rate = metrics.median_spread(tokens_per_s_by_repeat(runs, repeats))
    passes = sum(len(r.blocks) for r in runs)
    if rate is None or not rate[0] or not passes:
        return 0.0
    wall = sum(len(r.token_ids) for r in runs) / rate[0]
    return max(0.0, (wall - sum(cost.pass_time(q) for r in runs for q in r.blocks)) / passes - outside_seconds(ref))


def predict_row_tokens_per_s(cost, runs: list[Run], tokens_per_forward: float, per_pass_s: float):
    """The tokens/s a tree row should measure if its drafts deliver `tokens_per_forward` (what their confidences
    promise): every prompt's first pass at t(its block); the steady tokens at `tokens_per_forward` per pass, each
    pass at the mean t(q) of the row's steady blocks; every pass also paying `per_pass_s` (the row's measured time
    outside the forward pass, drafting included, and the loop around the steps, `loop_overhead`)."""
    first = sum(cost.pass_time(r.blocks[0]) for r in runs if r.blocks)
    steady_blocks = [q for r in runs for q in r.blocks[1:]]
    steady_tokens = sum(sum(r.chunks[1:]) for r in runs)
    if not steady_blocks or not tokens_per_forward:
        return None
    passes = steady_tokens / tokens_per_forward  # steady passes the promise needs
    mean_t = sum(cost.pass_time(q) for q in steady_blocks) / len(steady_blocks)
    wall = first + passes * mean_t + (len(runs) + passes) * per_pass_s
    tokens = sum(len(r.token_ids) for r in runs)
    return tokens / wall if wall > 0 else None
