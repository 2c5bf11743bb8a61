"""What one `mtp bench` run holds: its settings (`BenchConfig`), a row per strategy or peer (`Row`), each
row's decoding of each prompt (`Run`), and the result (`BenchResult`); plus the per-row figures several
stages read off the runs (tokens/s per repeat, end to end and decode-only, time outside the forward pass
per pass, time per guess). Plain data: nothing here decodes, prices or prints.

Two speeds, said straight: end to end is a run's tokens over its wall time, prompt included (what a client
waits for); decode-only is the tokens emitted after the prompt's pass over the time after it
(`decode_timing`: from the engine's DecodeStats, whose first pass is the prefill; a llama-server peer's own
`timings`, its `predicted_per_second`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtp.core.decoding import metrics
from mtp.core.decoding.strategy import Strategy
from mtp.eval.bench.data import Spec


@dataclass
class Run:
    """One row's decoding of one prompt: the first repeat's output, every repeat's wall time."""

    text: str
    token_ids: list[int]
    chunks: list[int] = field(default_factory=list)  # tokens emitted per pass (engine rows)
    blocks: list[int] = field(default_factory=list)  # tokens fed per pass (engine rows)
    confidences: list[float] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    result: object = None  # engine.Result, kept for the chunk view
    accepted_from: list = field(default_factory=list)  # per pass: who drafted each accepted token (DecodeStats)
    expected: list[float] = field(default_factory=list)  # tree rows, per pass: tokens its drafts promised
    # per repeat, as walls: (tokens, seconds) after the prompt's pass (`decode_timing`); None = not reported
    decodes: list[tuple[int, float] | None] = field(default_factory=list)


@dataclass
class Row:
    name: str
    strategy: Strategy | None = None  # engine rows
    proposer: str | None = None  # engine rows: their own proposer (None: the engine's)
    peer: object = None  # peers.Peer
    runs: dict[int, Run] = field(default_factory=dict)  # prompt index -> run
    proposing_s: float = 0.0  # seconds its proposer spent drafting in the measured runs (DecodeStats.proposing_s)
    guesses: int = 0  # guesses it made there
    outside_s: float = 0.0  # seconds its decoding steps spent outside the forward pass there (DecodeStats.outside_s)
    timed_passes: int = 0  # the passes those times cover
    phase_s: list[float] = field(default_factory=list)  # outside_s split by metrics.PHASES (DecodeStats.phase_s)
    masks: bool = False  # its passes feed mask tokens the adapters act on (priced by the masked t(q))
    error: str | None = None
    skipped: str | None = None

    @property
    def is_peer(self) -> bool:
        return self.strategy is None

    @property
    def active(self) -> bool:
        return self.error is None and self.skipped is None


@dataclass
class BenchConfig:
    strategies: list[Spec]
    baselines: list[str] = field(default_factory=list)
    repeats: int = 1
    max_new_tokens: int = 256
    warmup: bool = True
    chat: bool = True
    profile: bool = False
    profile_cache_len: int = 300
    profile_repeats: int = 5
    profile_qs: tuple[int, ...] = tuple(range(1, 33))


@dataclass
class BenchResult:
    kind: str
    items: list[dict]
    rows: list[Row]
    records: list[dict]  # one per row, as written to results.jsonl
    env: dict
    cost: object = None  # costmodel.CostModel with --profile
    advice: list[str] = field(default_factory=list)
    mask_cost: object = None  # t(q) of passes with mask rows (CostModel), measured when a row feeds masks


def tokens_per_s_by_repeat(runs: list[Run], repeats: int) -> list[float]:
    """Per repeat r: all prompts' tokens / all prompts' wall time in that repeat."""
    out = []
    for r in range(repeats):
        pairs = [(len(run.token_ids), run.walls[r]) for run in runs if len(run.walls) > r]
        if pairs:
            out.append(metrics.tokens_per_s(sum(p[0] for p in pairs), sum(p[1] for p in pairs)))
    return out


def decode_timing(stats) -> tuple[int, float] | None:
    """(tokens, seconds) of a decoding after its prompt's pass, from its DecodeStats: the first pass is the
    prefill, so the tokens the later passes emitted over the time from the end of the first pass to the end
    of the last; (0, 0.0) when the prefill was the only pass, None when no pass was recorded."""
    if not stats.chunks or stats.t_first is None or stats.t_end is None:
        return None
    return sum(stats.chunks[1:]), max(stats.t_end - stats.t_first, 0.0)


def decode_tokens_per_s_by_repeat(runs: list[Run], repeats: int) -> list[float]:
    """Per repeat r: all prompts' decode-only tokens / their decode-only seconds (`Run.decodes`); empty
    when a run has no decode-only figure for some repeat (a peer that does not report one), so that the
    row never mixes kinds."""
    out = []
    for r in range(repeats):
        pairs = [run.decodes[r] if len(run.decodes) > r else None for run in runs if len(run.walls) > r]
        if not pairs:
            continue
        if any(p is None for p in pairs):
            return []
        out.append(metrics.tokens_per_s(sum(p[0] for p in pairs), sum(p[1] for p in pairs)))
    return out


def outside_seconds(row: Row) -> float:
    """Seconds per pass the row's decoding steps spent outside the forward pass (0 when none was timed)."""
    return row.outside_s / row.timed_passes if row.timed_passes else 0.0


def outside_ms_by_phase(row: Row) -> dict[str, float]:
    """Milliseconds per pass outside the forward pass, by phase (`metrics.PHASES`); {} when none was timed."""
    if not row.timed_passes or not row.phase_s:
        return {}
    return {k: round(1e3 * v / row.timed_passes, 4) for k, v in zip(metrics.PHASES, row.phase_s)}


def guess_seconds(row: Row) -> float:
    """Seconds the row's proposer spent per guess outside the forward pass (0 when it made none)."""
    return row.proposing_s / row.guesses if row.guesses else 0.0
