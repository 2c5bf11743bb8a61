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
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from mtp.core.decoding import metrics
from mtp.core.decoding.proposers import Proposer, check_proposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import SWEEP_LIMIT, Strategy, expand_sweep, split_list
from mtp.core.policy import quality
from mtp.core.policy.costmodel import best_k, block_tokens_for, measure, predict_tokens_per_s
from mtp.core.runtime.artifacts import ASSETS
from mtp.core.runtime.model import Linear
from mtp.eval import gsm8k, report
from mtp.eval.peers import make_peer
from mtp.interop import llamacpp_env

WARMUP_TOKENS = 8


# ---------------------------------------------------------------------------------------------- data


def load_data(spec: str, limit: int | None = None) -> tuple[str, list[dict]]:
    """`gsm8k:PATH` or `prompts:PATH` -> (kind, [{"prompt", "gold"?, "category"?}]) of the first `limit`
    items; a prompts line's optional 'category' is kept (results then break down by it)."""
    kind, sep, path = (spec or "").partition(":")
    if not sep or kind not in ("gsm8k", "prompts") or not path:
        raise ValueError(f"bad --data {spec!r}; expected gsm8k:PATH or prompts:PATH")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"data not found: {path}")
    if kind == "gsm8k":
        items = gsm8k.load(p, limit)
    else:
        items = []
        for n, line in enumerate(gsm8k.read_lines(p), 1):
            row = gsm8k.parse_json_line(line, p, n)
            prompt = row.get("prompt")
            if prompt is None and isinstance(row.get("turns"), list) and row["turns"]:
                first = row["turns"][0]  # MT-Bench / Spec-Bench style: the first turn is the prompt
                prompt = first.get("content") if isinstance(first, dict) else first
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{p}:{n}: needs a non-empty 'prompt' string or a 'turns' list")
            items.append({"prompt": prompt, **({"category": str(row["category"])} if row.get("category") else {})})
            if limit is not None and len(items) >= limit:
                break
    if not items:
        raise ValueError(f"no items in {path}")
    return kind, items


@dataclass(frozen=True)
class Spec:
    """An engine row: a strategy, with its own proposer when written `verify:4@mask-single`."""

    strategy: Strategy
    proposer: str | None = None  # None: the engine's --proposer

    def __str__(self) -> str:
        return str(self.strategy) + (f"@{self.proposer}" if self.proposer else "")


def parse_strategies(text: str) -> list[Spec]:
    """The sweep list with `ntp` first (always run: it is the reference), duplicates dropped."""
    out = [Spec(Strategy.parse("ntp"))]
    seen = set(out)
    pieces = split_list("ntp" if text is None else text)
    if not pieces:
        raise ValueError(f"--strategies {text!r} names no strategy; e.g. verify:4,conf_adapt:0.9")
    for piece in pieces:
        strategy, at, proposer = piece.partition("@")
        proposer = proposer.strip() or None
        if not strategy.strip() or (at and proposer is None):
            raise ValueError(
                f"--strategies: {piece!r} needs a strategy before '@' and a proposer after it, e.g. verify:4@heads"
            )
        if proposer is not None:
            check_proposer(proposer)
        for s in expand_sweep(strategy):
            spec = Spec(s, proposer)
            if spec not in seen:
                seen.add(spec)
                out.append(spec)
        if len(out) > SWEEP_LIMIT:
            raise ValueError(f"--strategies expands to more than {SWEEP_LIMIT} rows")
    return out


# ---------------------------------------------------------------------------------------------- run


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


def environment(engine=None) -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    env = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        env["transformers"] = __import__("transformers").__version__
    except Exception:
        pass
    # the `make llamacpp` build (version or None) and whether AMX is usable here (the kernel's grant, not
    # just the CPU flag), with the flags llama-server runs need because of it (`--no-repack`)
    env["llamacpp"] = llamacpp_env.environment()
    if engine is not None:
        env.update(
            model=engine.loaded.name,
            adapter=_asset_name(engine.adapter_dir),
            heads=_asset_name(engine.asset_dirs.get("heads")),
            proposer=engine.config.proposer,
            weights=getattr(engine, "weights_line", ""),  # what ran the model (mtp.core.runtime.weights.attach)
            device=str(engine.model.device),
            packed=_packed(engine.model),
        )
    return env


def _asset_name(path) -> str | None:
    """How results name an adapter or heads directory: `shipped:<model>/<kind>` for the packaged ones,
    else the path as given (results get shared: no machine-specific prefix for shipped assets)."""
    if path is None:
        return None
    try:
        return "shipped:" + Path(path).resolve().relative_to(ASSETS.resolve()).as_posix()
    except ValueError:
        return str(path)


def _packed(model) -> bool:
    return any(isinstance(m, Linear) and m.packed is not None for m in model.modules())


def run_bench(engine, kind: str, items: list[dict], cfg: BenchConfig, on_step=None) -> BenchResult:
    """Run every row on every prompt (interleaved, rotated), then aggregate. `on_step(label)` ticks."""
    tick = on_step or (lambda label: None)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    prompts = [engine.encode(it["prompt"], chat=cfg.chat) for it in items]
    for j, ids in enumerate(prompts):
        if len(ids) + cfg.max_new_tokens > engine.context_window:
            raise ValueError(
                f"prompt {j} ({len(ids)} tokens) + --max-new-tokens {cfg.max_new_tokens} exceeds the "
                f"context window of {engine.context_window}"
            )
    for s in cfg.strategies:  # an impossible strategy (no adapter, no confidences) fails before any work
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

    def decode(row: Row, ids: list[int], max_new: int) -> Run:
        t0 = time.perf_counter()
        if row.is_peer:
            out = row.peer.generate(ids, max_new)
            wall = time.perf_counter() - t0
            return Run(engine.decode_text(out), out, walls=[wall])
        seq = engine.new_sequence(ids, row.strategy, SamplingParams(max_new_tokens=max_new), row.proposer)
        for _ in engine.stream(seq):
            pass
        wall = time.perf_counter() - t0
        row.proposing_s += sum(seq.stats.proposing_s)
        row.guesses += sum(seq.stats.guesses)
        row.outside_s += sum(seq.stats.outside_s)
        row.timed_passes += len(seq.stats.outside_s)
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
        )

    if cfg.warmup:
        for row in rows:
            if row.active:
                tick(f"warm-up {row.name}")
                try:
                    decode(row, prompts[0], min(WARMUP_TOKENS, cfg.max_new_tokens))
                except Exception as e:
                    row.error = f"{type(e).__name__}: {e}"
                row.proposing_s, row.guesses = 0.0, 0  # proposing is timed on measured runs only
                row.outside_s, row.timed_passes = 0.0, 0
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
                    run = decode(row, ids, cfg.max_new_tokens)
                except Exception as e:  # record, stop this row, keep everything measured so far
                    row.error = f"prompt {j}: {type(e).__name__}: {e}"
                    row.runs.pop(j, None)
                    continue
                if r == 0:
                    row.runs[j] = run
                else:
                    row.runs[j].walls.append(run.walls[0])
    cost = mask_cost = None
    if cfg.profile:
        tick("profile t(q)")
        cache_len = min(cfg.profile_cache_len, engine.context_window - max(cfg.profile_qs))
        cost = measure(engine.model, cfg.profile_qs, cache_len, 1, cfg.profile_repeats)
        for row in rows:
            row.masks = row.active and feeds_gated_masks(engine, row)
        if any(row.masks for row in rows):  # passes with mask rows run the adapters: a t(q) of their own
            tick("profile t(q) with mask rows")
            mask_cost = measure(engine.model, cfg.profile_qs, cache_len, 1, cfg.profile_repeats, masks=True)
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


# ---------------------------------------------------------------------------------------------- aggregate


def aggregate(rows: list[Row], kind: str, items: list[dict], repeats: int, cost=None, mask_cost=None) -> list[dict]:
    """One results.jsonl record per row; quality and speedup are against the `ntp` row. With `cost`
    the predictions price each row's passes with `row_cost` (a row feeding gated masks with
    `mask_cost`; none predicted for it without one)."""
    ref = rows[0]
    assert ref.strategy is not None and ref.strategy.plain, "the first row must be ntp"
    golds = [it.get("gold") for it in items]
    overhead = loop_overhead(cost, ref, repeats) if cost is not None and ref.runs else 0.0
    out = []
    for row in rows:
        rec = {
            "strategy": row.name,
            "peer": row.is_peer,
            "n_prompts": len(row.runs),
            "tokens_per_forward": None,
            "acceptance_by_position": None,
            "tokens_per_s": None,
            "tokens_per_s_spread": None,
            "speedup_vs_ntp": None,
            "speedup_spread": None,
            "exact_match": None,
            "answer_agreement": None,
            "accuracy": None,
            "rougeL": None,
            "oracle_tokens_per_forward": None,
            "mean_block_tokens": None,
            "predicted_speedup": None,
            "accepted_by_proposer": None,
            "accepted_share": None,
            "tree_nodes": None,
            "tree_nodes_per_pass": None,
            "steady_tokens_per_forward": None,
            "predicted_tokens_per_forward": None,
            "predicted_tokens_per_s": None,
            "tokens": 0,
            "error": row.error or row.skipped,
        }
        if row.peer is not None:
            rec["params"] = row.peer.params()
        idx = sorted(row.runs)
        if idx:
            runs = [row.runs[j] for j in idx]
            rec["tokens"] = sum(len(r.token_ids) for r in runs)
            tps = _tokens_per_s_by_repeat(runs, repeats)
            ms = metrics.median_spread(tps)
            rec["tokens_per_s"], rec["tokens_per_s_spread"] = ms[0], [ms[1], ms[2]]
            common = [j for j in idx if j in ref.runs]
            if common:
                ref_tps = _tokens_per_s_by_repeat([ref.runs[j] for j in common], repeats)
                own_tps = _tokens_per_s_by_repeat([row.runs[j] for j in common], repeats)
                ratios = [metrics.speedup(a, b) for a, b in zip(own_tps, ref_tps)]
                sp = metrics.median_spread(ratios)
                if sp is not None:
                    rec["speedup_vs_ntp"], rec["speedup_spread"] = sp[0], [sp[1], sp[2]]
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
                    [quality.extract_answer(r.text) for r in runs], [golds[j] for j in idx]
                )
            if row.is_peer:
                rec["tokens_per_forward"] = row.peer.tokens_per_forward
            else:
                chunks = [c for r in runs for c in r.chunks]
                rec["tokens_per_forward"] = metrics.tokens_per_forward(chunks)
                rec["acceptance_by_position"] = metrics.acceptance_by_position(chunks, row.strategy.k)
                cats = sorted({items[j]["category"] for j in idx if "category" in items[j]})
                if cats:  # prompts files with a 'category' field: the row's numbers per category
                    rec["by_category"] = {c: _category(row, ref, items, idx, common, c) for c in cats}
                rec["proposing_ms_per_guess"] = guess_seconds(row) * 1e3
                steady_blocks = [b for r in runs for b in r.blocks[1:]]  # prompt passes excluded
                steady_chunks = [c for r in runs for c in r.chunks[1:]]
                rec["mean_block_tokens"] = metrics.mean_block_tokens(steady_blocks)
                if row.strategy.thresholded and common:
                    rec["oracle_tokens_per_forward"] = _oracle(ref, common, row.strategy)
                priced = None if cost is None else row_cost(row, cost, mask_cost)
                if priced is not None and steady_blocks:  # tokens/s under its t(q), over plain decoding's t(1)
                    rate = predict_tokens_per_s(priced, metrics.tokens_per_forward(steady_chunks), steady_blocks)
                    rec["predicted_speedup"] = rate * cost.pass_time(1)
                if row.strategy.verifies:  # which proposer (a merge's part) drafted the accepted tokens
                    accepted_from = [p for r in runs for p in r.accepted_from]
                    rec["accepted_by_proposer"] = metrics.accepted_by_proposer(accepted_from)
                    rec["accepted_share"] = metrics.accepted_share(accepted_from)
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
        out.append(rec)
    return out


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


def tree_lines(rows: list[Row], records: list[dict]) -> list[str]:
    """`--profile`: for each tree row, the tree it chose and, over its steady passes (the prompt's
    excluded, as for the predicted speedup), the tokens per pass its nodes' confidences promised and
    the tokens/s that gives (`predict_row_tokens_per_s`: the cost model's t(q), the row's measured time
    outside the forward pass and the loop overhead calibrated on `ntp`), beside the measured tokens per
    pass of the same passes and the row's measured tokens/s."""
    lines = []
    for row, rec in zip(rows, records):
        if row.is_peer or not row.strategy.is_tree or rec["predicted_tokens_per_forward"] is None:
            continue
        size = f"at most {rec['tree_nodes']} nodes drafted" if row.strategy.auto else f"{rec['tree_nodes']} nodes"
        kept = "kept" if row.strategy.auto else "drafted"
        lines.append(
            f"{row.name}: tree of {size}, {rec['tree_nodes_per_pass']:.1f} {kept} per pass on average; "
            f"predicted {rec['predicted_tokens_per_forward']:.2f} tokens/pass, "
            f"{_f(rec['predicted_tokens_per_s'], 1)} tokens/s; measured "
            f"{rec['steady_tokens_per_forward']:.2f} tokens/pass, {_f(rec['tokens_per_s'], 1)} tokens/s"
        )
    return lines


def loop_overhead(cost, ref: Row, repeats: int) -> float:
    """Seconds per pass the `ntp` row spent beyond the cost model's t(q) of its passes and its decoding steps'
    own time outside them (`Row.outside_s`): the loop around the steps (the caller, Python), per pass. Its
    measured wall time (as its tokens/s counts it) less both, over its passes; 0 when negative."""
    runs = list(ref.runs.values())
    rate = metrics.median_spread(_tokens_per_s_by_repeat(runs, repeats))
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


def outside_seconds(row: Row) -> float:
    """Seconds per pass the row's decoding steps spent outside the forward pass (0 when none was timed)."""
    return row.outside_s / row.timed_passes if row.timed_passes else 0.0


def guess_seconds(row: Row) -> float:
    """Seconds the row's proposer spent per guess outside the forward pass (0 when it made none)."""
    return row.proposing_s / row.guesses if row.guesses else 0.0


def _tokens_per_s_by_repeat(runs: list[Run], repeats: int) -> list[float]:
    """Per repeat r: all prompts' tokens / all prompts' wall time in that repeat."""
    out = []
    for r in range(repeats):
        pairs = [(len(run.token_ids), run.walls[r]) for run in runs if len(run.walls) > r]
        if pairs:
            out.append(metrics.tokens_per_s(sum(p[0] for p in pairs), sum(p[1] for p in pairs)))
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


# ---------------------------------------------------------------------------------------------- outputs

MARKER = "mtp-bench.json"  # written into every output folder: what a later run may replace


def check_out(out: Path) -> None:
    """Before any work: `--out` must be a new or empty folder, or one an earlier `mtp bench` wrote
    (it holds MARKER); anything else is refused, so no user file is overwritten."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ValueError(f"--out {out} holds files mtp bench did not write; choose a new or empty folder")


def write_outputs(res: BenchResult, out: Path, engine=None, command: str = "", chunk_examples: int = 2) -> None:
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(json.dumps({"format": "mtp-bench", "command": command}) + "\n")
    with open(out / "results.jsonl", "w") as f:
        for rec in res.records:
            f.write(json.dumps(rec) + "\n")
    with open(out / "outputs.jsonl", "w") as f:
        for row in res.rows:
            for j, run in sorted(row.runs.items()):
                f.write(
                    json.dumps(
                        {
                            "strategy": row.name,
                            "prompt_index": j,
                            "text": run.text,
                            "chunks": run.chunks,
                            "walls": run.walls,
                        }
                    )
                    + "\n"
                )
    if res.cost is not None:
        res.cost.save(out / "profile.json")
    if res.mask_cost is not None:  # t(q) of passes with mask rows (the adapter path)
        res.mask_cost.save(out / "profile-masks.json")
    report.pareto_png(res, out / "pareto.png")
    report.acceptance_png(res, out / "acceptance.png")
    report.write_html(res, out / "report.html", engine, command, chunk_examples)


def print_summary(res: BenchResult, console=None) -> None:
    console = console or Console()
    t = Table(title=f"mtp bench · {res.kind} · {len(res.items)} prompts · {res.env.get('threads')} threads")
    cols = [
        "strategy",
        "n",
        "tok/pass",
        "tok/s",
        "min–max",
        "speedup",
        "exact",
        "agree",
        "acc",
        "rougeL",
        "oracle",
        "error",
    ]
    if res.cost is not None:
        cols.insert(6, "predicted")
    if any(rec.get("accepted_share") for rec in res.records):  # rows that verified drafts: who drafted the accepted
        cols.insert(cols.index("error"), "drafted by")
    for c in cols:
        t.add_column(c, no_wrap=c != "error", overflow="fold")
    for rec in res.records:
        cells = {
            "strategy": rec["strategy"] + (" (peer)" if rec["peer"] else ""),
            "n": str(rec["n_prompts"]),
            "tok/pass": _f(rec["tokens_per_forward"]),
            "tok/s": _f(rec["tokens_per_s"], 1),
            "min–max": f"{rec['tokens_per_s_spread'][0]:.1f}–{rec['tokens_per_s_spread'][1]:.1f}"
            if rec["tokens_per_s_spread"]
            else "",
            "speedup": _f(rec["speedup_vs_ntp"]),
            "predicted": _f(rec["predicted_speedup"]),
            "exact": _f(rec["exact_match"]),
            "agree": _f(rec["answer_agreement"]),
            "acc": _f(rec["accuracy"]),
            "rougeL": _f(rec["rougeL"]),
            "oracle": _f(rec["oracle_tokens_per_forward"]),
            "drafted by": report.shares_text(rec.get("accepted_share")),
            "error": _short(rec["error"]),
        }
        t.add_row(*[cells[c] for c in cols])
    console.print(t)
    head, lines = report.category_table(res.records)
    if lines:  # tokens per pass per prompt category, and which part drafted the accepted tokens there
        ct = Table(title="tokens/pass per category (accepted drafts by proposer)")
        for c in head:
            ct.add_column(c, overflow="fold")
        for cells in lines:
            ct.add_row(*cells)
        console.print(ct)
    for rec in res.records:
        if rec["error"] and len(rec["error"]) > 28:
            console.print(f"{rec['strategy']}: {rec['error']}")
    if res.cost is not None:
        a, b = res.cost.linear_fit()
        pts = res.cost.points
        console.print(
            f"t(q) at cache {res.cost.meta.get('cache_len')}: t(1) = {pts[min(pts)] * 1e3:.1f} ms, "
            f"t({max(pts)}) = {pts[max(pts)] * 1e3:.1f} ms; linear fit {a * 1e3:.1f} ms + "
            f"{b * 1e3:.2f} ms/token"
        )
        if res.mask_cost is not None:
            m = res.mask_cost.points
            console.print(
                f"t(q) of passes with mask rows (the adapters' path): t(1) = {m[min(m)] * 1e3:.1f} ms, "
                f"t({max(m)}) = {m[max(m)] * 1e3:.1f} ms"
            )
        for line in res.advice:
            console.print(line)


def _short(text: str | None, n: int = 28) -> str:
    return "" if not text else text if len(text) <= n else text[: n - 1] + "…"


def _f(x, digits=2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"
