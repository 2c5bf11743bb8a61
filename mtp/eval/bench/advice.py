"""What `--profile` advises from a bench run: the best K for verify and the cap on conf_adapt's K on this
machine (`cost_advice`, withheld where the run contradicts it), each tree row's promised against
measured figures (`tree_lines`), and llama.cpp's draft settings for its EAGLE-3 rows
(`llamacpp_draft_advice`). Each returns lines of text, printed and written into the report."""

from __future__ import annotations

import dataclasses
import os

from mtp.core.decoding.proposers import Proposer
from mtp.core.policy.costmodel import best_k, block_tokens_for
from mtp.eval.bench.data import Spec
from mtp.eval.bench.rows import Row, guess_seconds, outside_seconds
from mtp.eval.report import number


def cost_advice(
    cost, rows: list[Row], records: list[dict], proposer_of=None, mask_cost=None, overhead=0.0
) -> list[str]:
    """Best K for verify and the K cap for conf_adapt on this machine, from measured acceptance, each K
    priced as the row runs (`best_k`): t(q) of its passes (`mask_cost` for a row feeding gated masks,
    `Row.masks`), its proposer's time per guess, its own time outside the forward pass and the loop's
    `overhead` per pass (`loop_overhead`), so the expected tokens/s compare with measured ones.
    Advice this run contradicts is withheld, with a line saying why: a mask row without `mask_cost`
    cannot be priced, and a strategy this run measured slower than `ntp` is never advised.
    proposer_of(name or None) -> the row's Proposer (default: one that appends nothing)."""
    measured = {(r.strategy, r.proposer): rec for r, rec in zip(rows, records) if not r.is_peer}
    lines = []
    for row, rec in zip(rows, records):
        if row.is_peer or not rec["acceptance_by_position"] or row.strategy.kind not in ("verify", "conf_adapt"):
            continue
        acc, k, kind = rec["acceptance_by_position"], row.strategy.k, row.strategy.kind
        what = "best K for verify" if kind == "verify" else "cap on conf_adapt's K"
        if row.masks and mask_cost is None:
            lines.append(f"{row.name}: no {what} advised: cannot price its mask rows (no t(q) of passes with masks)")
            continue
        proposer = proposer_of(row.proposer) if proposer_of is not None else Proposer()
        kb, rate = best_k(
            cost,
            acc,
            k,
            block_tokens_for(kind, proposer),
            guess_s=guess_seconds(row),
            per_pass_s=overhead + outside_seconds(row),
            mask_cost=mask_cost if row.masks else None,
        )
        advised = dataclasses.replace(row.strategy, k=kb)
        seen = measured.get((advised, row.proposer))
        if kb > 1 and seen is not None and seen["speedup_vs_ntp"] is not None and seen["speedup_vs_ntp"] < 1:
            name = str(Spec(advised, row.proposer))
            lines.append(
                f"{row.name}: no {what} advised: the cost model expects {rate:.1f} tokens/s at K = {kb}, "
                f"but {name} measured {seen['speedup_vs_ntp']:.2f}x ntp in this run"
            )
        elif kind == "verify":
            use = "drafting does not pay here; use ntp" if kb == 1 else f"use verify:{kb}"
            lines.append(
                f"{row.name}: best K for verify on this machine = {kb} (of 1..{k} measured; "
                f"{rate:.1f} expected tokens/s); {use}"
            )
        else:
            use = "guessing does not pay here; use ntp" if kb == 1 else f"use conf_adapt:{row.strategy.tau:g}:{kb}"
            lines.append(
                f"{row.name}: cap conf_adapt's K at {kb} on this machine ({rate:.1f} expected tokens/s); {use}"
            )
    if not lines:
        lines.append("run a verify:K or conf_adapt strategy to get the best K for this machine")
    return lines


def tree_lines(rows: list[Row], records: list[dict]) -> list[str]:
    """`--profile`: for each tree row, the tree it chose and, over its steady passes (the prompt's
    excluded, as for the predicted speedup), the tokens per pass its nodes' confidences promised and
    the tokens/s that gives (`predict_row_tokens_per_s`: the cost model's t(q), the row's measured time
    outside the forward pass and the loop overhead calibrated on `ntp`), beside the measured tokens per
    pass of the same passes and the row's measured tokens/s (both end to end: the prompt's pass included)."""
    lines = []
    for row, rec in zip(rows, records):
        if row.is_peer or not row.strategy.is_tree or rec["predicted_tokens_per_forward"] is None:
            continue
        size = f"at most {rec['tree_nodes']} nodes drafted" if row.strategy.auto else f"{rec['tree_nodes']} nodes"
        kept = "kept" if row.strategy.auto else "drafted"
        lines.append(
            f"{row.name}: tree of {size}, {rec['tree_nodes_per_pass']:.1f} {kept} per pass on average; "
            f"predicted {rec['predicted_tokens_per_forward']:.2f} tokens/pass, "
            f"{number(rec['predicted_tokens_per_s'], 1)} tokens/s e2e; measured "
            f"{rec['steady_tokens_per_forward']:.2f} tokens/pass, {number(rec['tokens_per_s'], 1)} tokens/s e2e"
        )
    return lines


def llamacpp_draft_advice(rows: list[Row], tick=lambda _: None) -> list[str]:
    """For each llama-server row with an EAGLE-3 drafter that ran: llama.cpp's t(q) on its target
    (`llama-bench`) and the draft count / p-min it favours (mtp.interop.llamacpp_profile)."""
    from mtp.interop import llamacpp_profile

    lines, measured = [], {}
    for row in rows:
        peer = row.peer
        if peer is None or getattr(peer, "spec", None) != "eagle3" or not getattr(peer, "timings", None):
            continue
        try:
            if peer.target not in measured:
                tick(f"llama-bench t(q) · {os.path.basename(peer.target)}")
                measured[peer.target] = llamacpp_profile.measure(peer.target, threads=peer.threads)
            adv = llamacpp_profile.advise(measured[peer.target], peer.timings)
        except (ValueError, RuntimeError, OSError) as e:
            lines.append(f"{row.name}: no llama.cpp draft advice ({str(e).splitlines()[0]})")
            continue
        lines.append(llamacpp_profile.advice_line(row.name, adv))
    return lines
