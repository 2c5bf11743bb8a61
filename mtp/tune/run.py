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

Each section is a module of its own (`reference`, `calibrate`, `probe`, `qualify`, `measure`, `result`),
a function of the run's shared record (`mtp.tune.tuning.Tuning`) that it reads and adds to; `run` calls them
in order. The settings are `mtp.tune.config`, the files `mtp.tune.outputs`; their names are importable here.
"""

from __future__ import annotations

from mtp.tune.calibrate import calibrate, fit_held_out
from mtp.tune.config import TuneConfig, tune_data
from mtp.tune.measure import measure
from mtp.tune.outputs import MARKER, check_out, write
from mtp.tune.probe import probe
from mtp.tune.qualify import qualify
from mtp.tune.reference import reference
from mtp.tune.result import result
from mtp.tune.tuning import Tuning

__all__ = ["MARKER", "TuneConfig", "check_out", "fit_held_out", "run", "tune_data", "write"]  # what callers import


def run(engine, cfg: TuneConfig, log=print) -> dict:
    """The module docstring's checklist, section by section (`Tuning`); the result `write` saves."""
    t = Tuning.start(engine, cfg, log)
    reference(t)  # 1-3
    calibrate(t)  # 4
    probe(t)  # 5
    deferred = qualify(t)  # 6
    chosen, fallback, price_pick = measure(t, deferred)  # 7
    return result(t, chosen, fallback, price_pick)  # 8
