"""One `mtp tune` run's shared record (`Tuning`): its inputs, checked before any work (`Tuning.start`), and
what each section of the checklist (`mtp.tune.run`) found for the next; every candidate's figures (`Row`,
what results.json lists); and the steady-state price every section compares by (`steady_price`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from mtp.core.decoding.strategy import Strategy
from mtp.eval.bench import load_data
from mtp.tune import candidates as C
from mtp.tune.config import TuneConfig
from mtp.tune.offline import decode_all
from mtp.tune.simulate import can_replay, replay


@dataclass
class Row:
    """One candidate's figures (what results.json lists)."""

    name: str
    lossless: bool
    tokens_per_forward: float | None = None
    predicted_tps: float | None = None
    predicted_speedup: float | None = None
    probe_loss: float | None = None
    loss: float | None = None  # over every prompt (lossy, when run); 0 for lossless
    loss_items: int = 0
    qualifies: bool | None = None
    measured_tps: float | None = None
    measured_speedup: float | None = None
    measured_exact: float | None = None
    bound_speedup: float | None = None  # lossy: the optimistic price from the recorded passes (mtp.tune.bound)
    note: str = ""
    acceptance_by_position: list = field(default_factory=list)
    by_category: dict = field(default_factory=dict)


def steady_price(cost, outs, proposing_s: float) -> tuple[float, float]:
    """(tokens per pass, tokens/s) in steady state: prompt passes left out, every other pass priced
    at t(its block) plus the proposer's time."""
    tokens = sum(c for o in outs for c in o.chunks[1:])
    passes = sum(len(o.chunks) - 1 for o in outs)
    seconds = sum(cost.pass_time(q) for o in outs for q in o.blocks[1:]) + proposing_s
    return (tokens / passes if passes else 0.0), (tokens / seconds if seconds > 0 else 0.0)


@dataclass
class Tuning:
    """One `mtp tune` run: its inputs, and what each section of the checklist found for the next."""

    engine: object
    cfg: TuneConfig
    log: Callable[[str], None]  # every line says how long the run has taken so far
    t_start: float
    kind: str
    items: list[dict]
    metric: str
    cands: list[C.Candidate]
    unavailable: dict[str, str]  # proposer -> why it cannot run on this engine
    prompts: list[list[int]]
    # 1-3: reference, hardware, predictability
    ref: list = field(default_factory=list)  # offline.Output of every prompt under ntp
    cost: object = None  # costmodel.CostModel of this machine
    hidden: dict = field(default_factory=dict)  # teacher-forced hidden states per prompt (every replay reads it)
    kept: dict = field(default_factory=dict)  # the heads' answers per prompt and position (simulate.MemoProposer)
    predict: dict = field(default_factory=dict)
    ntp_tpf: float = 0.0
    ntp_price: float = 0.0
    # 4: calibration
    calibrations: dict = field(default_factory=dict)  # proposer (a merge part: + TREE_SUFFIX) -> its map
    cal_report: dict = field(default_factory=dict)
    probe_runs: dict = field(default_factory=dict)  # str(arm) -> the offline.RunStats of its calibration run
    # 5-7: every candidate's row, what sets a lossy candidate aside
    rows: dict[str, Row] = field(default_factory=dict)
    unprobed: set[str] = field(default_factory=set)  # lossy candidates not decoded: their optimistic price loses
    failed_families: dict[tuple, float] = field(default_factory=dict)  # family -> least risky member over tolerance
    by_price: list[Row] = field(default_factory=list)  # the finalists a default run measures
    measured_prompts: int = 0

    @classmethod
    def start(cls, engine, cfg: TuneConfig, log) -> "Tuning":
        """The data, the candidates this engine can run and the prompts, checked before any work."""
        t_start = time.perf_counter()

        def timed_log(line: str) -> None:
            log(f"{line} [{time.perf_counter() - t_start:.0f}s]")

        kind, items = load_data(cfg.data, cfg.limit)
        metric = cfg.metric or ("answer" if kind == "gsm8k" else "rougeL")
        cands, unavailable = C.loadable(engine, C.parse(cfg.candidates) if cfg.candidates else C.defaults())
        for name, why in unavailable.items():
            timed_log(f"tune: proposer {name} left out: {why}")
        if not cands:
            raise ValueError("no candidate can run on this engine (see the lines above)")
        prompts = [engine.encode(it["prompt"], chat=True) for it in items]
        for j, ids in enumerate(prompts):
            if len(ids) + cfg.max_new_tokens > engine.context_window:
                raise ValueError(
                    f"prompt {j} ({len(ids)} tokens) + --max-new-tokens {cfg.max_new_tokens} exceeds the "
                    f"context window of {engine.context_window}"
                )
        timed_log(
            f"tune: {len(items)} prompts ({cfg.data}), tolerance {cfg.tolerance:g} on {metric}, {len(cands)} candidates"
        )
        return cls(engine, cfg, timed_log, t_start, kind, items, metric, cands, unavailable, prompts)

    @property
    def n(self) -> int:
        return len(self.items)

    @property
    def n_probe(self) -> int:
        return min(self.cfg.probe, self.n)

    @property
    def refs(self) -> list[tuple[list[int], str]]:
        return [(o.ids, o.text) for o in self.ref]

    @property
    def budget(self) -> float:
        return self.cfg.tolerance * self.n  # the most item losses a qualifying candidate may have

    def lossless(self, strategy: Strategy, proposer: str, record: bool = False):
        """A lossless candidate's passes: replayed on every reference answer where its proposer allows
        (mtp.tune.simulate), else decoded on the probe prompts."""
        if can_replay(proposer):
            return replay(self.engine, self.prompts, self.ref, strategy, proposer, record, self.hidden, self.kept)
        m = max(self.n_probe, min(self.cfg.calibrate, self.n)) if record else self.n_probe
        return decode_all(
            self.engine, self.prompts[:m], strategy, proposer, self.cfg.max_new_tokens, self.cfg.batch, record=record
        )

    def set_aside(self, c: C.Candidate) -> None:
        """Lossy `c` exceeded the tolerance: its family's lossier members need not run."""
        self.failed_families[c.family] = min(self.failed_families.get(c.family, 9.0), c.risk)

    def family_failed(self, c: C.Candidate) -> bool:
        """Whether a less lossy member of `c`'s family already exceeded the tolerance."""
        return c.family in self.failed_families and c.risk > self.failed_families[c.family]
