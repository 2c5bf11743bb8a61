"""`mtp bench`: speed and quality of decoding strategies side by side, against peers, on one machine.

Protocol (so that the numbers can be trusted):
1. every row (a strategy, or a peer) decodes every prompt; `ntp` always runs and is the reference;
2. rows alternate prompt by prompt, with their order rotated each time, so machine drift (other
   jobs, thermal state) falls on all rows alike; one short untimed warm-up per row comes first;
3. each prompt is decoded `--repeats` times per row; tokens/s is computed per repeat over all
   prompts, reported as median and spread, and `speedup_vs_ntp` is the per-repeat ratio against the
   `ntp` row on the same prompts (its median and spread);
4. quality compares the first repeat's outputs with `ntp`'s (greedy decoding, so repeats agree);
5. with `--profile`, the cost model of mtp.core.policy.costmodel predicts each row's speedup from its block
   sizes and acceptance, printed beside the measured one; for tree rows also the tree chosen (its
   nodes per pass) and its predicted tokens/pass and tokens/s beside the measured ones (`tree_lines`).
Decoding goes through the engine (mtp.core.decoding.decode's loop); every number comes from mtp.core.decoding.metrics.

The modules, by role: `data` (prompts and the sweep list), `rows` (what a run holds), `run` (the protocol
above), `pricing` (the cost model applied to a row), `records` (runs aggregated into records), `advice`
(what `--profile` advises), `machine` (where it ran), `outputs` (the files of --out) and `summary` (the
console). This package's namespace holds their public names, as callers import them.
"""

from mtp.eval.bench.advice import cost_advice, llamacpp_draft_advice, tree_lines
from mtp.eval.bench.data import Spec, load_data, parse_strategies
from mtp.eval.bench.machine import asset_name, environment
from mtp.eval.bench.outputs import MARKER, check_out, write_outputs
from mtp.eval.bench.pricing import feeds_gated_masks, loop_overhead, predict_row_tokens_per_s, row_cost
from mtp.eval.bench.records import aggregate
from mtp.eval.bench.rows import (
    BenchConfig,
    BenchResult,
    Row,
    Run,
    guess_seconds,
    outside_seconds,
    tokens_per_s_by_repeat,
)
from mtp.eval.bench.run import WARMUP_TOKENS, decode_one, run_bench
from mtp.eval.bench.summary import print_summary

_asset_name = asset_name  # its name before the split (tests import it)

__all__ = [
    "MARKER",
    "WARMUP_TOKENS",
    "BenchConfig",
    "BenchResult",
    "Row",
    "Run",
    "Spec",
    "aggregate",
    "asset_name",
    "check_out",
    "cost_advice",
    "decode_one",
    "environment",
    "feeds_gated_masks",
    "guess_seconds",
    "llamacpp_draft_advice",
    "load_data",
    "loop_overhead",
    "outside_seconds",
    "parse_strategies",
    "predict_row_tokens_per_s",
    "print_summary",
    "row_cost",
    "run_bench",
    "tokens_per_s_by_repeat",
    "tree_lines",
    "write_outputs",
]
