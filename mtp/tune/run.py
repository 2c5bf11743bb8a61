"""`mtp tune`: from a tolerance to a configuration, on this machine, in one command.

The adoption checklist, in order:
1. reference: greedy `ntp` answers of every prompt (batched, `mtp.tune.offline`);
2. hardware: this machine's t(q) (`mtp.core.policy.costmodel.measure`);
3. predictability: entropy and top-1 probability of the model on its own answers, per category
   (`mtp.tune.predictability`);
4. calibration: for each proposer with confidences, a `verify:4` run records (confidence, right) per
   depth; for each part of a merged candidate, a `tree:16` run records (node confidence, whether its
   root path is the model's continuation) per node depth; a map per depth is fitted on every prompt
   and its expected calibration error measured by two-fold cross-fitting (even-numbered prompts fit,
   odd ones scored, and the reverse; `fit_held_out`, `mtp.core.policy.calibration`); conf_adapt then reads
   calibrated confidences, and a merge compares its parts' calibrated node probabilities instead of
   fixed priors;
5. probe: a lossless candidate whose proposer reads only the context and the hidden state (heads,
   lookup, suffix, merges) is replayed on every reference answer (`mtp.tune.simulate`: the passes a
   decode would make, without decoding); the others (mask, EAGLE-3, every lossy one) decode the first
   `probe` prompts, batched; each is priced in steady state as tokens / (sum of t(block) over its
   passes + its proposer's time), the same for `ntp`. A lossy candidate is first priced optimistically
   from its proposer's recorded calibration passes (`mtp.tune.bound`) and not decoded at all when even
   that price is below the best lossless candidate's (unless `measure_all`);
6. quality: a lossy candidate that could win (priced at least as fast as the best lossless one) and
   whose lossier family members did not already fail decodes every prompt, stopping as soon as its
   loss can no longer stay within the tolerance; lossless candidates always qualify. With
   `measure_all` (a full sweep) every lossy candidate that passed its probe is measured first, and
   only one measured faster than every lossless candidate decodes every prompt for its quality (the
   others cannot be the best point that meets the tolerance, whatever their quality);
7. measurement: the best qualifying candidates by price (`measure_rows`, plus mask-token ones near
   the top, whose adapter cost t(q) does not include) are decoded one prompt at a time,
   interleaved with `ntp`, on the first `measure` prompts (`mtp.eval.bench.run_bench`); the fastest
   measured one is chosen; the fallback is the fastest measured lossless one (`ntp` when the choice
   is lossless itself);
8. `deploy.json` (`mtp.core.policy.deploy`), `results.json` (every candidate) and `report.html`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mtp.core.decoding import metrics
from mtp.core.decoding.strategy import Strategy
from mtp.core.engine import TREE_SUFFIX
from mtp.core.policy import calibration as calib
from mtp.core.policy import deploy as D
from mtp.core.policy import quality
from mtp.core.policy.costmodel import measure
from mtp.eval.bench import BenchConfig, Spec, environment, load_data, run_bench
from mtp.tune import candidates as C
from mtp.tune import predictability
from mtp.tune.bound import lossy_bound
from mtp.tune.offline import chain_pairs, decode_all, tree_pairs
from mtp.tune.simulate import can_replay, replay

MARKER = "mtp-tune.json"
UNCERTAIN_BAND = 0.15  # mask-token candidates priced within this of the best are measured too
Q_POINTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 32)  # block sizes t(q) is measured at
BOUND_MARGIN = 0.05  # a lossy candidate is not decoded when its optimistic price is this far below the best lossless


@dataclass
class TuneConfig:
    data: str
    tolerance: float
    metric: str | None = None  # default: answer for gsm8k, rougeL for prompts
    latency_ms: float | None = None  # a target ms per token, reported against
    limit: int | None = 100
    max_new_tokens: int = 256
    probe: int = 8  # prompts a decoded candidate decodes (batched)
    calibrate: int = 48  # prompts a decoded calibration run decodes (each held out once, two folds)
    measure: int = 8  # prompts the finalists decode one at a time
    measure_rows: int = 3  # finalists besides ntp
    measure_all: bool = False  # measure every qualifying candidate (a full sweep, for checking the choice)
    batch: int = 32
    candidates: str | None = None
    profile_repeats: int = 3

    def __post_init__(self):
        D.check_tolerance(self.tolerance)
        if self.metric is not None:
            D.check_metric(self.metric)
        for name in (
            "limit",
            "max_new_tokens",
            "probe",
            "calibrate",
            "measure",
            "measure_rows",
            "batch",
            "profile_repeats",
        ):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.latency_ms is not None and not self.latency_ms > 0:
            raise ValueError(f"--latency-ms must be > 0, got {self.latency_ms}")
        self.data = tune_data(self.data, self.limit)


GSM8K_TEST = "GSM8K test"  # the evaluation guard's name of the GSM8K test questions (`eval_guard`)


def tune_data(spec, limit: int | None) -> str:
    """--data as tune reads it, checked before the model loads. `gsm8k:DIR` becomes `gsm8k:DIR/test.jsonl`
    (the evaluation split, never train.jsonl; a folder without it is one line: `gsm8k.resolve`), so the
    log, results and deploy.json name the file read. A GSM8K training split is refused: a file named
    train* none of whose (first `limit`) questions is a GSM8K test question (the evaluation guard's hashes).
    mtp's proposers (mask adapter, heads, EAGLE-3 drafter, suffix datastore) learn from GSM8K train,
    so their acceptance there, hence the speed tune measures and the configuration it picks, would be
    that of prompts they were trained on, not of the traffic the deploy file serves. Other specs are
    returned as given (`load_data` checks them)."""
    kind, sep, path = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind != "gsm8k" or not sep or not path or not Path(path).expanduser().exists():
        return spec
    from mtp.eval import gsm8k
    from mtp.training.eval_guard import evaluation_set

    file = gsm8k.resolve(Path(path).expanduser())
    name, target = file.name, file.resolve().name  # a link's own name and its target's
    if file.is_file() and any(n.lower().startswith("train") for n in (name, target)):
        items = gsm8k.load(file, limit)
        if items and not any(evaluation_set(it["question"]) == GSM8K_TEST for it in items):
            shown = name if name == target else f"{name} -> {target}"
            raise ValueError(
                f"--data gsm8k:{file} is a training split (named {shown}, no GSM8K test question in "
                "it): mtp's proposers learn from GSM8K train, so tuning on it overstates their "
                f"acceptance and speed; tune on the evaluation split (gsm8k:DIR/{gsm8k.EVAL_SPLIT}) "
                "or held-out prompts:FILE of your own"
            )
    return f"gsm8k:{file}" if file != Path(path) else spec


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


def run(engine, cfg: TuneConfig, log=print) -> dict:
    """The module docstring's checklist, section by section (`Tuning`); the result `write` saves."""
    t = Tuning.start(engine, cfg, log)
    t.reference()  # 1-3
    t.calibrate()  # 4
    t.probe()  # 5
    deferred = t.qualify()  # 6
    chosen, fallback, price_pick = t.measure(deferred)  # 7
    return t.result(chosen, fallback, price_pick)  # 8


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

    def reference(self) -> None:
        """1-3: greedy ntp answers of every prompt (batched), this machine's t(q), and the model's
        predictability on its own answers; ntp's steady price on the probe prompts."""
        engine, cfg = self.engine, self.cfg
        self.ref = decode_all(engine, self.prompts, Strategy(), None, cfg.max_new_tokens, cfg.batch).outputs
        self.log(f"tune: reference ntp answers: {sum(len(o.ids) for o in self.ref):,} tokens")
        cache_len = max(0, min(300, engine.context_window - Q_POINTS[-1]))
        self.cost = measure(engine.model, Q_POINTS, cache_len, 1, cfg.profile_repeats)  # interpolated between
        engine.cost_model = self.cost  # what tree:auto candidates size their trees by
        self.log(
            f"tune: t(1) {1e3 * self.cost.pass_time(1):.1f} ms, t(8) {1e3 * self.cost.pass_time(8):.1f} ms, "
            f"t(32) {1e3 * self.cost.pass_time(32):.1f} ms"
        )
        self.predict = predictability.report(
            engine.model, self.items, self.prompts, [o.ids for o in self.ref], self.hidden
        )
        self.ntp_tpf, self.ntp_price = steady_price(self.cost, self.ref[: self.n_probe], 0.0)

    def lossless(self, strategy: Strategy, proposer: str, record: bool = False):
        """A lossless candidate's passes: replayed on every reference answer where its proposer allows
        (mtp.tune.simulate), else decoded on the probe prompts."""
        if can_replay(proposer):
            return replay(self.engine, self.prompts, self.ref, strategy, proposer, record, self.hidden, self.kept)
        m = max(self.n_probe, min(self.cfg.calibrate, self.n)) if record else self.n_probe
        return decode_all(
            self.engine, self.prompts[:m], strategy, proposer, self.cfg.max_new_tokens, self.cfg.batch, record=record
        )

    def calibrate(self) -> None:
        """4: chains of each confidence proposer (conf_adapt reads them), trees of each part of a merged
        candidate (the merge then compares calibrated node probabilities); the engine reads the maps."""
        chain_parts = sorted({c.proposer for c in self.cands if c.strategy.thresholded})
        tree_parts = sorted(
            {p for c in self.cands if c.strategy.is_tree and "+" in c.proposer for p in c.proposer.split("+")}
        )
        for key, arm, pairs_of in [(p, D.Arm(Strategy.parse("verify:4"), p), chain_pairs) for p in chain_parts] + [
            (p + TREE_SUFFIX, D.Arm(Strategy.parse("tree:16"), p), tree_pairs) for p in tree_parts
        ]:
            stats = self.lossless(arm.strategy, arm.proposer, record=True)
            self.probe_runs[str(arm)] = stats
            fitted, rep = fit_held_out([pairs_of(o) for o in stats.outputs])
            self.calibrations[key], self.cal_report[key] = fitted, rep
            self.engine.config.calibration[key] = fitted
            self.log(
                f"tune: calibration of {key}: ECE {_f(rep['ece_before'], 3)} -> {_f(rep['ece_after'], 3)} on "
                f"{rep['test_pairs']} held-out guesses (noise floor {_f(rep['ece_floor'], 3)})"
                + ("" if rep["used"] else " (worse: not used, raw confidences kept)")
            )

    def bound(self, c: C.Candidate):
        """A lossy candidate's optimistic (tokens per pass, price) from its proposer's recorded
        calibration passes (mtp.tune.bound); None without them."""
        records = self.probe_runs.get(str(D.Arm(Strategy.parse("verify:4"), c.proposer)))
        if records is None:
            return None
        return lossy_bound(
            c.strategy,
            self.engine.proposer(c.proposer).n_appended(c.strategy.k, 0),
            self.cost,
            records,
            self.calibrations.get(c.proposer),
        )

    def probe(self) -> None:
        """5: every candidate priced in steady state on its replayed or decoded probe passes; a lossy one
        not decoded when even its optimistic price loses, and set aside when its probe alone exceeds the
        tolerance (and with it its family's lossier members)."""
        self.rows = {"ntp": Row("ntp", True, self.ntp_tpf, self.ntp_price, 1.0, 0.0, 0.0, self.n, True)}
        order = [c for c in self.cands if c.lossless] + sorted(
            (c for c in self.cands if not c.lossless), key=lambda c: (c.family, c.risk)
        )
        for c in order:
            if not c.lossless and c.family in self.failed_families and c.risk > self.failed_families[c.family]:
                self.rows[str(c)] = Row(
                    str(c),
                    False,
                    qualifies=False,
                    note="not probed: a less lossy member of its family already exceeded the tolerance",
                )
                continue
            bound = None if c.lossless else self.bound(c)
            if bound is not None and self._bound_loses(c, bound):
                continue
            self.rows[str(c)] = self._probe_row(c, bound)

    def _bound_loses(self, c: C.Candidate, bound) -> bool:
        """Whether lossy `c`'s optimistic price is already below the best lossless one's (unless
        `measure_all`): then its row says so and it is never decoded."""
        best = max(r.predicted_tps for r in self.rows.values() if r.lossless)
        if self.cfg.measure_all or bound[1] >= (1 - BOUND_MARGIN) * best:
            return False
        self.rows[str(c)] = Row(
            str(c),
            False,
            bound[0],
            bound[1],
            bound[1] / self.ntp_price,
            bound_speedup=bound[1] / self.ntp_price,
            note="not decoded: even its optimistic price from the recorded passes is below "
            "the best lossless candidate's",
        )
        self.unprobed.add(str(c))
        self.log(
            f"tune: skip {c}: at most {bound[0]:.2f} tokens/pass, {bound[1] / self.ntp_price:.2f}x ntp "
            f"(the best lossless: {best / self.ntp_price:.2f}x)"
        )
        return True

    def _probe_row(self, c: C.Candidate, bound) -> Row:
        """Candidate `c`'s row from its probe passes: price, acceptance (by category too), probe loss."""
        cfg, probe, kind = self.cfg, self.n_probe, self.kind
        stats = self.probe_runs.get(str(c))
        if stats is None:
            stats = (
                self.lossless(c.strategy, c.proposer)
                if c.lossless
                else decode_all(
                    self.engine, self.prompts[:probe], c.strategy, c.proposer, cfg.max_new_tokens, cfg.batch
                )
            )
        tpf, price = steady_price(self.cost, stats.outputs, stats.proposing_s)
        row = Row(str(c), c.lossless, tpf, price, price / self.ntp_price if self.ntp_price else None)
        chunks = [x for o in stats.outputs for x in o.chunks[1:]]
        k = c.strategy.k
        row.acceptance_by_position = metrics.acceptance_by_position(chunks, k)
        for cat in sorted({it.get("category", kind) for it in self.items[: len(stats.outputs)]}):  # by category
            cc = [
                x for it, o in zip(self.items, stats.outputs) if it.get("category", kind) == cat for x in o.chunks[1:]
            ]
            row.by_category[cat] = {
                "tokens_per_forward": metrics.tokens_per_forward(cc),
                "acceptance_by_position": metrics.acceptance_by_position(cc, k),
            }
        row.probe_loss = quality.mean_loss(
            self.metric, [(o.ids, o.text) for o in stats.outputs], self.refs[: len(stats.outputs)]
        )
        row.note = (
            f"replayed on {len(stats.outputs)} answers"
            if c.lossless and can_replay(c.proposer)
            else f"decoded on {len(stats.outputs)} prompts"
        )
        if c.lossless:
            row.loss, row.loss_items, row.qualifies = 0.0, self.n, True
        elif row.probe_loss * probe > self.budget:
            row.qualifies, row.note = False, "exceeds the tolerance on the probe prompts alone"
            row.loss, row.loss_items = row.probe_loss, probe
            self.failed_families[c.family] = min(self.failed_families.get(c.family, 9.0), c.risk)
        if not c.lossless and bound is not None:
            row.bound_speedup = bound[1] / self.ntp_price
        self.log(
            f"tune: probe {c}: {tpf:.2f} tokens/pass, priced {row.predicted_speedup:.2f}x ntp"
            + (
                ""
                if c.lossless
                else f", loss {row.probe_loss:.3f} on {probe} prompts"
                + ("" if bound is None else f" (optimistic price {row.bound_speedup:.2f}x)")
            )
        )
        return row

    def check_quality(self, c: C.Candidate, row: Row) -> None:
        """Decode every prompt with lossy `c`, stopping once its loss can no longer stay within the tolerance."""
        spent = {"loss": 0.0, "items": 0}
        refs = self.refs

        def over(j, out):
            spent["loss"] += quality.item_loss(self.metric, out.ids, out.text, *refs[j])
            spent["items"] += 1
            return spent["loss"] > self.budget

        outs = decode_all(
            self.engine, self.prompts, c.strategy, c.proposer, self.cfg.max_new_tokens, self.cfg.batch, stop_after=over
        ).outputs
        row.loss_items = len(outs)
        row.loss = quality.mean_loss(self.metric, [(o.ids, o.text) for o in outs], refs[: len(outs)])
        row.qualifies = spent["loss"] <= self.budget and len(outs) == self.n
        if not row.qualifies:
            row.note = f"exceeds the tolerance (stopped after {spent['items']} prompts)"
            self.failed_families[c.family] = min(self.failed_families.get(c.family, 9.0), c.risk)
        self.log(
            f"tune: quality {c}: loss {row.loss:.3f} over {row.loss_items} prompts -> "
            f"{'within' if row.qualifies else 'outside'} the tolerance"
        )

    def qualify(self) -> dict[str, C.Candidate]:
        """6: the quality of the lossy candidates that could win (priced at least as fast as the best
        lossless one). Returns, with `measure_all`, those whose speed is measured first instead."""
        best_lossless = max(r.predicted_tps for r in self.rows.values() if r.lossless)
        deferred: dict[str, C.Candidate] = {}
        for c in sorted((c for c in self.cands if not c.lossless), key=lambda c: (c.family, c.risk)):
            row = self.rows[str(c)]
            if row.qualifies is False or row.name in self.unprobed:
                continue  # decided by its probe, or by its optimistic price
            if c.family in self.failed_families and c.risk > self.failed_families[c.family]:
                row.qualifies, row.note = False, "a less lossy member of its family already exceeded the tolerance"
                continue
            if self.cfg.measure_all:  # only one measured faster than every lossless candidate needs its quality
                deferred[row.name] = c
                continue
            if row.predicted_tps < best_lossless:
                row.qualifies = None
                row.note = "not run on every prompt: priced slower than the best lossless candidate"
                continue
            self.check_quality(c, row)
        return deferred

    def finalists(self, deferred: dict[str, C.Candidate]) -> list[Row]:
        """The candidates measured one prompt at a time: the best qualifying ones by price (plus
        mask-token ones near the top), or with `measure_all` every qualifying and deferred one."""
        rows = self.rows
        best_lossless = max(r.predicted_tps for r in rows.values() if r.lossless)
        qualifying = sorted(
            (r for r in rows.values() if r.qualifies and r.name != "ntp"), key=lambda r: -r.predicted_tps
        )
        could_win = sorted(
            qualifying + [rows[k] for k in deferred if rows[k].predicted_tps >= best_lossless],
            key=lambda r: -r.predicted_tps,
        )  # what a default run would have checked and ranked
        top = could_win[0].predicted_tps if could_win else 0.0
        self.by_price = [
            r
            for i, r in enumerate(could_win)  # the finalists by price (what a default run measures)
            if i < self.cfg.measure_rows or ("@mask" in r.name and r.predicted_tps >= (1 - UNCERTAIN_BAND) * top)
        ]
        return qualifying + [rows[k] for k in deferred] if self.cfg.measure_all else self.by_price

    def measure(self, deferred: dict[str, C.Candidate]) -> tuple[Row, str, Row]:
        """7: the finalists decoded one prompt at a time, interleaved with ntp (`run_bench`); a deferred
        lossy candidate measured faster than every lossless one then decodes every prompt for its
        quality. Returns (the fastest measured qualifying row, the fallback's name: the fastest measured
        lossless one, ntp for a lossless choice; what the default rule would have picked)."""
        rows, cfg = self.rows, self.cfg
        finalists = self.finalists(deferred)
        specs = [Spec(Strategy())] + [
            Spec(Strategy.parse(r.name.split("@")[0]), r.name.split("@")[1]) for r in finalists
        ]
        m = self.measured_prompts = min(cfg.measure, self.n)
        self.log(
            f"tune: measuring ntp and {len(finalists)} finalists on {m} prompts, one at a time: "
            + ", ".join(r.name for r in finalists)
        )
        bench = run_bench(self.engine, self.kind, self.items[:m], BenchConfig(specs, max_new_tokens=cfg.max_new_tokens))
        for rec in bench.records:
            r = rows.get(rec["strategy"])
            if r is not None:
                r.measured_tps, r.measured_speedup, r.measured_exact = (
                    rec["tokens_per_s"],
                    rec["speedup_vs_ntp"],
                    rec["exact_match"],
                )
        fastest_lossless = max(r.measured_tps for r in rows.values() if r.lossless and r.measured_tps is not None)
        for name, c in deferred.items():
            row = rows[name]
            if row.measured_tps is not None and row.measured_tps > fastest_lossless:
                self.check_quality(c, row)
            else:
                row.note = "measured slower than the fastest lossless candidate: its quality cannot change the choice"
        measured = [r for r in rows.values() if r.measured_tps is not None and r.qualifies]
        chosen = max(measured, key=lambda r: r.measured_tps)
        # with --measure-all: what the default rule would have chosen, from the same interleaved run
        price_pick = max([rows["ntp"]] + [r for r in self.by_price if r.qualifies], key=lambda r: r.measured_tps or 0.0)
        self._log_measured(measured, chosen, price_pick)
        lossless_measured = [r for r in measured if r.lossless and r is not chosen]
        fallback = "ntp" if chosen.lossless else max(lossless_measured, key=lambda r: r.measured_tps).name
        return chosen, fallback, price_pick

    def _log_measured(self, measured: list[Row], chosen: Row, price_pick: Row) -> None:
        for r in sorted(measured, key=lambda r: -r.measured_tps):
            self.log(
                f"tune: measured {r.name}: {r.measured_tps:.2f} tokens/s, {_f(r.measured_speedup)}x ntp "
                f"(priced {_f(r.predicted_speedup)}x)"
            )
        for r in sorted(
            (r for r in self.rows.values() if r.measured_tps is not None and not r.qualifies),
            key=lambda r: -r.measured_tps,
        ):
            self.log(
                f"tune: measured {r.name}: {r.measured_tps:.2f} tokens/s, {_f(r.measured_speedup)}x ntp "
                f"(priced {_f(r.predicted_speedup)}x; not qualifying: {r.note})"
            )
        if self.cfg.measure_all:
            self.log(
                f"tune: full sweep's best {chosen.name} {chosen.measured_tps:.2f} tokens/s; the default rule "
                f"(finalists by price) would pick {price_pick.name} {price_pick.measured_tps:.2f} tokens/s "
                f"({price_pick.measured_tps / chosen.measured_tps:.3f} of the best)"
            )

    def result(self, chosen: Row, fallback: str, price_pick: Row) -> dict:
        """8: the deploy file (`mtp.core.policy.deploy`: the tuned arm and its fallback, their caps,
        calibrations and hashes, what was measured) and the results every candidate's row holds."""
        engine, cfg, m = self.engine, self.cfg, self.measured_prompts
        tuned_arm, fallback_arm = _arm(chosen.name, engine), _arm(fallback, engine)
        used = {a.proposer for a in (tuned_arm, fallback_arm) if not a.strategy.plain}
        caps = {"max_k": tuned_arm.strategy.k}
        if tuned_arm.strategy.thresholded:
            caps["min_tau"] = tuned_arm.strategy.tau
        env = environment(engine)
        latency = None if chosen.measured_tps is None else 1e3 / chosen.measured_tps
        deploy = D.Deploy(
            tuned=tuned_arm,
            fallback=fallback_arm,
            tolerance=cfg.tolerance,
            metric=self.metric,
            caps=caps,
            calibration={
                k: v
                for k, v in self.calibrations.items()
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
                    "measure_prompts": m,
                    "data": cfg.data,
                    "prompts": self.n,
                },
                "latency_target_ms": cfg.latency_ms,
                "latency_target_met": None if cfg.latency_ms is None or latency is None else latency <= cfg.latency_ms,
                "hardware": {**env, "t_q_ms": {str(q): round(1e3 * t, 3) for q, t in self.cost.points.items()}},
            },
        )
        result = {
            "chosen": chosen.name,
            "fallback": fallback,
            "measure_all": cfg.measure_all,
            "price_pick": price_pick.name,
            "price_pick_vs_best": price_pick.measured_tps / chosen.measured_tps if chosen.measured_tps else None,
            "metric": self.metric,
            "tolerance": cfg.tolerance,
            "kind": self.kind,
            "prompts": self.n,
            "probe": self.n_probe,
            "measure": m,
            "rows": [r.__dict__ for r in self.rows.values()],
            "calibration": self.cal_report,
            "predictability": self.predict,
            "unavailable": self.unavailable,
            "seconds": time.perf_counter() - self.t_start,
            "deploy": deploy,
        }
        if cfg.latency_ms is not None and latency is not None and latency > cfg.latency_ms:
            self.log(
                f"tune: no configuration meets {cfg.latency_ms:g} ms per token on this machine; the fastest "
                f"within the tolerance, {chosen.name}, takes {latency:.1f} ms"
            )
        return result


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


def _arm(name: str, engine) -> D.Arm:
    strategy, _, proposer = name.partition("@")
    return D.Arm(Strategy.parse(strategy), proposer or engine.config.proposer)


def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def check_out(out: Path) -> None:
    """`--out` must be new, empty, or a folder an earlier `mtp tune` wrote (it holds MARKER)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ValueError(f"--out {out} holds files mtp tune did not write; choose a new or empty folder")


def write(result: dict, out: Path, command: str) -> None:
    from mtp.tune import report  # matplotlib only when writing

    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(json.dumps({"format": "mtp-tune", "command": command}) + "\n")
    deploy = result["deploy"]
    deploy.extra["command"] = command
    D.write(deploy, out / "deploy.json")
    plain = {k: v for k, v in result.items() if k != "deploy"}
    (out / "results.json").write_text(json.dumps(plain, indent=1) + "\n")
    report.write(result, out)
