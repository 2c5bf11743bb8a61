"""From a bench's runs to its records (`aggregate`: one results.jsonl record per row). Speed is tokens/s
per repeat (median and spread) and its ratio to the `ntp` row on the same prompts, twice: end to end
(`tokens_per_s`, `speedup_vs_ntp`, and the same values under `tokens_per_s_e2e`, `speedup_vs_ntp_e2e`:
tokens over the wall time of the whole request, prompt included) and decode-only (`tokens_per_s_decode`,
`speedup_vs_ntp_decode`: after the prompt's pass; None for a peer that does not report it); quality compares the
first repeat's texts with `ntp`'s (exact match, ROUGE-L, GSM8K answer agreement and accuracy); engine rows
add their passes (tokens per pass, acceptance by position, per prompt category, who drafted what was
accepted) and, with a cost model, what it predicts for them (`mtp.eval.bench.pricing`)."""

from __future__ import annotations

from mtp.core.decoding import metrics
from mtp.core.decoding.strategy import Strategy
from mtp.core.policy import quality
from mtp.core.policy.costmodel import predict_tokens_per_s
from mtp.eval.bench.pricing import loop_overhead, predict_row_tokens_per_s, row_cost
from mtp.eval.bench.rows import (
    Row,
    decode_tokens_per_s_by_repeat,
    guess_seconds,
    outside_ms_by_phase,
    outside_seconds,
    tokens_per_s_by_repeat,
)

FIGURES = (  # every record's figures, None until measured (results.jsonl keeps this order)
    "tokens_per_forward",
    "acceptance_by_position",
    "tokens_per_s",
    "tokens_per_s_spread",
    "speedup_vs_ntp",
    "speedup_spread",
    "tokens_per_s_e2e",  # = tokens_per_s (end to end, prompt included), named so
    "speedup_vs_ntp_e2e",  # = speedup_vs_ntp
    "tokens_per_s_decode",  # decode-only: the prompt's pass excluded (rows.decode_timing, a peer's own timings)
    "tokens_per_s_decode_spread",
    "speedup_vs_ntp_decode",  # the per-repeat ratio of decode-only tokens/s to ntp's
    "speedup_decode_spread",
    "exact_match",
    "answer_agreement",
    "accuracy",
    "rougeL",
    "oracle_tokens_per_forward",
    "mean_block_tokens",
    "predicted_speedup",
    "accepted_by_proposer",
    "accepted_share",
    "tree_nodes",
    "tree_nodes_per_pass",
    "steady_tokens_per_forward",
    "predicted_tokens_per_forward",
    "predicted_tokens_per_s",
    "outside_ms_per_pass",  # engine rows: ms per pass outside the forward pass (the loop's bookkeeping)
    "outside_ms_by_phase",  # the same by phase (metrics.PHASES: layout, accept, draft, commit)
)


def aggregate(rows: list[Row], kind: str, items: list[dict], repeats: int, cost=None, mask_cost=None) -> list[dict]:
    """One results.jsonl record per row; quality and speedup are against the `ntp` row. With `cost`
    the predictions price each row's passes with `row_cost` (a row feeding gated masks with
    `mask_cost`; none predicted for it without one)."""
    ref = rows[0]
    assert ref.strategy is not None and ref.strategy.plain, "the first row must be ntp"
    overhead = loop_overhead(cost, ref, repeats) if cost is not None and ref.runs else 0.0
    out = []
    for row in rows:
        rec = {"strategy": row.name, "peer": row.is_peer, "n_prompts": len(row.runs)}
        rec.update(dict.fromkeys(FIGURES), tokens=0, error=row.error or row.skipped)
        if row.peer is not None:
            rec["params"] = row.peer.params()
        idx = sorted(row.runs)
        if idx:
            common = [j for j in idx if j in ref.runs]  # the prompts `ntp` decoded too
            _speed(rec, row, ref, idx, common, repeats)
            _quality(rec, row, ref, kind, items, idx, common)
            if row.is_peer:
                rec["tokens_per_forward"] = row.peer.tokens_per_forward
            else:
                _passes(rec, row, ref, items, idx, common)
                _steady(rec, row, cost, mask_cost, overhead)
        out.append(rec)
    return out


def _speed(rec: dict, row: Row, ref: Row, idx: list[int], common: list[int], repeats: int) -> None:
    """Tokens and tokens/s per repeat (median, spread), end to end and decode-only; on the prompts both
    decoded, the per-repeat ratios to `ntp`'s (median, spread), each of the same kind."""
    runs = [row.runs[j] for j in idx]
    rec["tokens"] = sum(len(r.token_ids) for r in runs)
    ms = metrics.median_spread(tokens_per_s_by_repeat(runs, repeats))
    rec["tokens_per_s"], rec["tokens_per_s_spread"] = ms[0], [ms[1], ms[2]]
    dec = metrics.median_spread(decode_tokens_per_s_by_repeat(runs, repeats))
    if dec is not None:
        rec["tokens_per_s_decode"], rec["tokens_per_s_decode_spread"] = dec[0], [dec[1], dec[2]]
    if common:
        for by_repeat, key, spread in (
            (tokens_per_s_by_repeat, "speedup_vs_ntp", "speedup_spread"),
            (decode_tokens_per_s_by_repeat, "speedup_vs_ntp_decode", "speedup_decode_spread"),
        ):
            ref_tps = by_repeat([ref.runs[j] for j in common], repeats)
            own_tps = by_repeat([row.runs[j] for j in common], repeats)
            sp = metrics.median_spread([metrics.speedup(a, b) for a, b in zip(own_tps, ref_tps)])
            if sp is not None:
                rec[key], rec[spread] = sp[0], [sp[1], sp[2]]
    rec["tokens_per_s_e2e"], rec["speedup_vs_ntp_e2e"] = rec["tokens_per_s"], rec["speedup_vs_ntp"]


def _quality(rec: dict, row: Row, ref: Row, kind: str, items: list[dict], idx: list[int], common: list[int]) -> None:
    """The first repeat's texts against `ntp`'s on the prompts both decoded (exact match, ROUGE-L, GSM8K
    answer agreement), and GSM8K accuracy against the gold answers."""
    if common:
        texts = [row.runs[j].text for j in common]
        ref_texts = [ref.runs[j].text for j in common]
        rec["exact_match"] = metrics.match_rate([t.strip() for t in texts], [t.strip() for t in ref_texts])
        rec["rougeL"] = metrics.rouge_l(texts, ref_texts)
        if kind == "gsm8k":
            # two outputs without a readable answer agree with each other
            rec["answer_agreement"] = metrics.match_rate(
                [quality.extract_answer(t) or "" for t in texts],
                [quality.extract_answer(t) or "" for t in ref_texts],
            )
    if kind == "gsm8k":
        rec["accuracy"] = metrics.match_rate(
            [quality.extract_answer(row.runs[j].text) for j in idx], [items[j].get("gold") for j in idx]
        )


def _passes(rec: dict, row: Row, ref: Row, items: list[dict], idx: list[int], common: list[int]) -> None:
    """An engine row's passes: tokens per pass, acceptance by position, per prompt category, its time per
    guess, the oracle ConfAdapt's tokens per pass and who drafted what was accepted."""
    runs = [row.runs[j] for j in idx]
    chunks = [c for r in runs for c in r.chunks]
    rec["tokens_per_forward"] = metrics.tokens_per_forward(chunks)
    rec["acceptance_by_position"] = metrics.acceptance_by_position(chunks, row.strategy.k)
    cats = sorted({items[j]["category"] for j in idx if "category" in items[j]})
    if cats:  # prompts files with a 'category' field: the row's numbers per category
        rec["by_category"] = {c: _category(row, ref, items, idx, common, c) for c in cats}
    rec["proposing_ms_per_guess"] = guess_seconds(row) * 1e3
    rec["outside_ms_per_pass"] = round(outside_seconds(row) * 1e3, 4)  # the loop around the forward pass
    rec["outside_ms_by_phase"] = outside_ms_by_phase(row)
    if row.strategy.thresholded and common:
        rec["oracle_tokens_per_forward"] = _oracle(ref, common, row.strategy)
    if row.strategy.verifies:  # which proposer (a merge's part) drafted the accepted tokens
        accepted_from = [p for r in runs for p in r.accepted_from]
        rec["accepted_by_proposer"] = metrics.accepted_by_proposer(accepted_from)
        rec["accepted_share"] = metrics.accepted_share(accepted_from)


def _steady(rec: dict, row: Row, cost, mask_cost, overhead: float) -> None:
    """An engine row's steady passes (the prompt passes excluded): their mean block, the speedup the cost
    model predicts from their blocks and tokens per pass and, for a tree row, the tree chosen and what its
    nodes promised (`predict_row_tokens_per_s`)."""
    runs = [row.runs[j] for j in sorted(row.runs)]
    steady_blocks = [b for r in runs for b in r.blocks[1:]]  # prompt passes excluded
    steady_chunks = [c for r in runs for c in r.chunks[1:]]
    rec["mean_block_tokens"] = metrics.mean_block_tokens(steady_blocks)
    priced = None if cost is None else row_cost(row, cost, mask_cost)
    if priced is not None and steady_blocks:  # tokens/s under its t(q), over plain decoding's t(1)
        rate = predict_tokens_per_s(priced, metrics.tokens_per_forward(steady_chunks), steady_blocks)
        rec["predicted_speedup"] = rate * cost.pass_time(1)
    if row.strategy.is_tree and steady_blocks:  # the tree chosen, and what its nodes promised
        expected = [e for r in runs for e in r.expected[1:]]  # steady passes, as steady_blocks
        rec["tree_nodes"] = row.strategy.k - 1
        rec["tree_nodes_per_pass"] = metrics.tree_nodes_per_pass(steady_blocks)
        rec["steady_tokens_per_forward"] = metrics.tokens_per_forward(steady_chunks)
        rec["predicted_tokens_per_forward"] = metrics.tokens_per_forward(expected)
        if priced is not None:
            rec["predicted_tokens_per_s"] = predict_row_tokens_per_s(
                priced, runs, rec["predicted_tokens_per_forward"], overhead + outside_seconds(row)
            )


def _category(row: Row, ref: Row, items: list[dict], idx: list[int], common: list[int], c: str) -> dict:
    """Row `row` on the prompts of category c: their count, tokens per pass, exactness against `ntp`
    and, for a row that verifies drafts, which proposer (a merge's part) drafted the accepted tokens
    (`metrics.accepted_by_proposer` / `accepted_share` over the category's passes)."""
    mine = [j for j in idx if items[j].get("category") == c]
    out = {
        "n": len(mine),
        "tokens_per_forward": metrics.tokens_per_forward([x for j in mine for x in row.runs[j].chunks]),
        "exact_match": metrics.match_rate(
            [row.runs[j].text.strip() for j in common if items[j].get("category") == c],
            [ref.runs[j].text.strip() for j in common if items[j].get("category") == c],
        ),
    }
    if row.strategy.verifies:
        accepted_from = [p for j in mine for p in row.runs[j].accepted_from]
        out["accepted_by_proposer"] = metrics.accepted_by_proposer(accepted_from)
        out["accepted_share"] = metrics.accepted_share(accepted_from)
    return out


def _oracle(ref: Row, idx: list[int], strategy: Strategy) -> float | None:
    """Oracle ConfAdapt tokens/pass on the ntp outputs, pooled over prompts (tokens / passes)."""
    tokens, passes = 0, 0.0
    for j in idx:
        conf = ref.runs[j].confidences
        if conf:
            tokens += len(conf)
            passes += len(conf) / metrics.oracle_tokens_per_forward(conf, strategy.tau, strategy.k)
    return tokens / passes if passes else None
