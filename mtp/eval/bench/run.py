"""Running a bench (`run_bench`), the protocol of `mtp.eval.bench` step by step: the prompts encoded and
checked against the context window and every row's strategy tried once, all before any timing; one short
untimed warm-up per row; every row decoding every prompt `repeats` times, rows interleaved prompt by prompt
with their order rotated each time (`decode_one` times one decoding and keeps the engine's statistics);
with `--profile` the t(q) of this machine (and of passes with mask rows when a row feeds them); then the
records (`mtp.eval.bench.records`) and the advice (`mtp.eval.bench.advice`). A row that fails (a peer's
setup, a decoding) keeps its error and stops; the others go on."""

from __future__ import annotations

import time

from mtp.core.decoding.sampling import SamplingParams
from mtp.core.policy.costmodel import measure
from mtp.eval.bench.advice import cost_advice, llamacpp_draft_advice, tree_lines
from mtp.eval.bench.machine import environment
from mtp.eval.bench.pricing import feeds_gated_masks, loop_overhead
from mtp.eval.bench.records import aggregate
from mtp.eval.bench.rows import BenchConfig, BenchResult, Row, Run, decode_timing
from mtp.eval.peers import make_peer

WARMUP_TOKENS = 8


def run_bench(engine, kind: str, items: list[dict], cfg: BenchConfig, on_step=None) -> BenchResult:
    """Run every row on every prompt (interleaved, rotated), then aggregate. `on_step(label)` ticks."""
    tick = on_step or (lambda label: None)
    prompts = _encode(engine, items, cfg)
    rows = _rows(engine, cfg, prompts)
    if cfg.warmup:
        _warm_up(engine, rows, prompts, cfg, tick)
    _interleave(engine, rows, prompts, cfg, tick)
    cost, mask_cost = _profile(engine, rows, cfg, tick) if cfg.profile else (None, None)
    env = environment(engine)
    env.update(repeats=cfg.repeats, max_new_tokens=cfg.max_new_tokens)
    records = aggregate(rows, kind, items, cfg.repeats, cost, mask_cost)
    for rec in records:
        rec["env"] = env
    advice = []
    if cost is not None:
        overhead = loop_overhead(cost, rows[0], cfg.repeats) if rows[0].runs else 0.0
        advice = cost_advice(cost, rows, records, engine.proposer, mask_cost, overhead) + tree_lines(rows, records)
    if cfg.profile:
        advice += llamacpp_draft_advice(rows, tick)
    return BenchResult(kind, items, rows, records, env, cost, advice, mask_cost=mask_cost)


def _encode(engine, items: list[dict], cfg: BenchConfig) -> list[list[int]]:
    """Every prompt's ids; one that leaves no room for `max_new_tokens` in the context window is refused."""
    prompts = [engine.encode(it["prompt"], chat=cfg.chat) for it in items]
    for j, ids in enumerate(prompts):
        if len(ids) + cfg.max_new_tokens > engine.context_window:
            raise ValueError(
                f"prompt {j} ({len(ids)} tokens) + --max-new-tokens {cfg.max_new_tokens} exceeds the "
                f"context window of {engine.context_window}"
            )
    return prompts


def _rows(engine, cfg: BenchConfig, prompts: list[list[int]]) -> list[Row]:
    """The engine rows (each strategy tried on the first prompt: an impossible one, without an adapter or
    confidences, fails before any work), then the peers, set up (a broken one keeps its error in its row)."""
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    for s in cfg.strategies:
        engine.new_sequence(prompts[0], s.strategy, params, s.proposer)
    rows = [Row(str(s), strategy=s.strategy, proposer=s.proposer) for s in cfg.strategies]
    for name in cfg.baselines:
        peer = make_peer(name)
        row = Row(name, peer=peer, skipped=peer.missing())
        if row.active:
            try:
                peer.setup(engine)
            except Exception as e:  # a broken peer is reported in its row; the others go on
                row.error = f"setup failed: {type(e).__name__}: {e}"
        rows.append(row)
    return rows


def decode_one(engine, row: Row, ids: list[int], max_new: int) -> Run:
    """`row` decoding prompt `ids` once, timed end to end (the wall of the whole call, prompt included) and
    decode-only (`decode_timing`: the engine's DecodeStats after the prefill pass, a peer's own report); an
    engine row also adds the decoding's proposing time, guesses, time outside the forward pass and passes to
    the row's totals."""
    t0 = time.perf_counter()
    if row.is_peer:
        out = row.peer.generate(ids, max_new)
        wall = time.perf_counter() - t0
        return Run(engine.decode_text(out), out, walls=[wall], decodes=[row.peer.decode_timing()])
    seq = engine.new_sequence(ids, row.strategy, SamplingParams(max_new_tokens=max_new), row.proposer)
    for _ in engine.stream(seq):
        pass
    wall = time.perf_counter() - t0
    row.proposing_s += sum(seq.stats.proposing_s)
    row.guesses += sum(seq.stats.guesses)
    row.outside_s += sum(seq.stats.outside_s)
    row.timed_passes += len(seq.stats.phase_s)
    if seq.stats.phase_s:  # each phase's seconds over this decoding's passes, added to the row's
        totals = [sum(col) for col in zip(*seq.stats.phase_s)]
        row.phase_s = [a + b for a, b in zip(row.phase_s or [0.0] * len(totals), totals)]
    res = engine.result(seq)
    return Run(
        res.text,
        res.token_ids,
        list(seq.stats.chunks),
        list(seq.stats.blocks),
        list(seq.stats.confidences),
        [wall],
        res,
        list(seq.stats.accepted_from),
        list(seq.stats.expected),
        decodes=[decode_timing(seq.stats)],
    )


def _warm_up(engine, rows: list[Row], prompts: list[list[int]], cfg: BenchConfig, tick) -> None:
    """One short untimed decoding of the first prompt per active row; its times are not kept."""
    for row in rows:
        if row.active:
            tick(f"warm-up {row.name}")
            try:
                decode_one(engine, row, prompts[0], min(WARMUP_TOKENS, cfg.max_new_tokens))
            except Exception as e:
                row.error = f"{type(e).__name__}: {e}"
            row.proposing_s, row.guesses = 0.0, 0  # proposing is timed on measured runs only
            row.outside_s, row.timed_passes, row.phase_s = 0.0, 0, []


def _interleave(engine, rows: list[Row], prompts: list[list[int]], cfg: BenchConfig, tick) -> None:
    """Every active row decodes every prompt `repeats` times, the rows' order rotated at each (prompt,
    repeat); the first repeat's run is kept, later ones add their wall time to it. A row whose decoding
    fails keeps the error, loses that prompt's run and stops."""
    step = 0
    for j, ids in enumerate(prompts):
        for r in range(cfg.repeats):
            order = rows[step % len(rows) :] + rows[: step % len(rows)]
            step += 1
            for row in order:
                if not row.active:
                    continue
                tick(f"prompt {j + 1}/{len(prompts)} · {row.name}")
                try:
                    run = decode_one(engine, row, ids, cfg.max_new_tokens)
                except Exception as e:  # record, stop this row, keep everything measured so far
                    row.error = f"prompt {j}: {type(e).__name__}: {e}"
                    row.runs.pop(j, None)
                    continue
                if r == 0:
                    row.runs[j] = run
                else:
                    row.runs[j].walls.append(run.walls[0])
                    row.runs[j].decodes.append(run.decodes[0] if run.decodes else None)


def _profile(engine, rows: list[Row], cfg: BenchConfig, tick) -> tuple:
    """`--profile`: (this machine's t(q), that of passes with mask rows or None); marks the rows whose passes
    feed gated masks (`Row.masks`), which the second prices."""
    tick("profile t(q)")
    cache_len = min(cfg.profile_cache_len, engine.context_window - max(cfg.profile_qs))
    cost = measure(engine.model, cfg.profile_qs, cache_len, 1, cfg.profile_repeats)
    mask_cost = None
    for row in rows:
        row.masks = row.active and feeds_gated_masks(engine, row)
    if any(row.masks for row in rows):  # passes with mask rows run the adapters: a t(q) of their own
        tick("profile t(q) with mask rows")
        mask_cost = measure(engine.model, cfg.profile_qs, cache_len, 1, cfg.profile_repeats, masks=True)
    return cost, mask_cost
