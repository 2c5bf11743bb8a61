"""What one forward pass costs on this machine, and what that means for multi-token decoding.

The trade-off: a multi-token pass saves passes but each pass carries more tokens. Let t(q)
be the time of one pass that feeds q tokens (pending + drafts + masks, summed over the batch). A
strategy that emits E[n] tokens per pass with blocks of q tokens runs at E[n] / E[t(q)] tokens/s,
so against plain decoding (one token, one pass of t(1)):

    speedup ≈ E[tokens per pass] · t(1) / E[t(q used)]

On a few CPU cores a 16-token pass costs several times a 1-token pass, so long blocks can lose; on
a GPU at batch 1 t(q) is nearly flat and every accepted token is almost free. `measure` samples t(q)
at a realistic cache length; `CostModel` interpolates it piecewise-linearly (and reports a linear
fit, t(q) ≈ a + b·q); `best_k` picks the block size with the most expected tokens per second.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from bisect import bisect_left
from pathlib import Path
from typing import Callable, Sequence

import torch

from mtp.core.decoding import metrics
from mtp.core.decoding.strategy import Strategy
from mtp.core.runtime.cache import KVCache


class CostModel:
    """Seconds per forward pass as a function of the tokens it feeds (batch × block)."""

    def __init__(self, points: dict[int, float], meta: dict | None = None):
        if not points:
            raise ValueError("a cost model needs at least one measured point")
        if any(int(q) < 1 or float(t) <= 0 for q, t in points.items()):
            raise ValueError("cost model points must be q >= 1 -> seconds > 0")
        self.points = {int(q): float(t) for q, t in sorted(points.items(), key=lambda kv: int(kv[0]))}
        self.meta = dict(meta or {})
        self._qs = list(self.points)
        self._ts = list(self.points.values())

    def pass_time(self, n_tokens: float) -> float:
        """t(n): interpolated between measured points, extrapolated linearly beyond them."""
        qs, ts = self._qs, self._ts
        if len(qs) == 1:
            return ts[0] * max(n_tokens, 1) / qs[0] if n_tokens > qs[0] else ts[0]
        if n_tokens <= qs[0]:
            return ts[0]  # below the smallest measured block a pass cannot get cheaper
        if n_tokens >= qs[-1]:
            # beyond the last point: continue the slope of the linear fit (steadier than the last segment)
            _, slope = self.linear_fit()
            return ts[-1] + max(slope, 0.0) * (n_tokens - qs[-1])
        j = bisect_left(qs, n_tokens)
        if qs[j] == n_tokens:
            return ts[j]
        q0, q1, t0, t1 = qs[j - 1], qs[j], ts[j - 1], ts[j]
        return t0 + (t1 - t0) * (n_tokens - q0) / (q1 - q0)

    def linear_fit(self) -> tuple[float, float]:
        """Least-squares (intercept a, slope b) of t(q) ≈ a + b·q, in seconds."""
        qs, ts = self._qs, self._ts
        n = len(qs)
        if n == 1:
            return ts[0], 0.0
        mq, mt = sum(qs) / n, sum(ts) / n
        var = sum((q - mq) ** 2 for q in qs)
        b = sum((q - mq) * (t - mt) for q, t in zip(qs, ts)) / var
        return mt - b * mq, b

    def relative(self, n_tokens: float) -> float:
        """t(n) / t(1): how many one-token passes one n-token pass costs."""
        return self.pass_time(n_tokens) / self.pass_time(1)

    def to_json(self) -> dict:
        a, b = self.linear_fit()
        return {
            "points": {str(q): t for q, t in self.points.items()},
            "linear_fit": {"intercept_s": a, "slope_s_per_token": b},
            **self.meta,
        }

    @classmethod
    def from_json(cls, data: dict | str) -> "CostModel":
        if isinstance(data, str):
            data = json.loads(data)
        meta = {k: v for k, v in data.items() if k not in ("points", "linear_fit")}
        return cls({int(q): float(t) for q, t in data["points"].items()}, meta)

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path) -> "CostModel":
        with open(path) as f:
            return cls.from_json(json.load(f))


def measure(
    model,
    qs: Sequence[int] = range(1, 33),
    cache_len: int = 300,
    batch: int = 1,
    repeats: int = 5,
    masks: bool = False,
) -> CostModel:
    """Time one forward pass of q new tokens per row over a cache of `cache_len` committed positions.

    Rounds over all q are interleaved (q order rotated each round) so machine drift spreads evenly;
    one untimed round warms up; each point is the median of `repeats` timings. Logits are computed
    at every block position, as a verify or mask pass needs. The cache content is irrelevant to the
    time, so it is left as zeros and only its length is set.

    `masks`: the last max(1, q // 2) tokens of every block are the mask token, as in a pass with mask
    rows (the mask proposer's, static and conf_adapt passes): with gated adapters such a pass runs the
    adapters, op by op, instead of the fused kernels, so it costs more than a plain pass of q tokens.
    Needs `config.mask_token_id` (ValueError otherwise); `meta["masks"]` records it.
    """
    qs = sorted({int(q) for q in qs})
    if not qs or qs[0] < 1:
        raise ValueError("qs must be positive block sizes")
    if batch < 1 or repeats < 1 or cache_len < 0:
        raise ValueError("batch and repeats must be >= 1, cache_len >= 0")
    cfg = model.config
    if cache_len + qs[-1] > cfg.max_seq_len:
        raise ValueError(f"cache_len {cache_len} + q {qs[-1]} exceeds the context window {cfg.max_seq_len}")
    dev = model.device
    cache = KVCache.for_model(model, batch, cache_len + qs[-1])
    gen = torch.Generator().manual_seed(0)
    n_real = min(cfg.vocab_size, cfg.mask_token_id or cfg.vocab_size)
    if masks and cfg.mask_token_id is None:
        raise ValueError("measuring passes with mask rows needs a model with a mask token")
    times: dict[int, list[float]] = {q: [] for q in qs}

    def one_pass(q: int) -> float:
        tokens = torch.randint(0, n_real, (batch, q), generator=gen)  # [B, q]
        if masks:
            tokens[:, q - max(1, q // 2) :] = cfg.mask_token_id
        tokens = tokens.to(dev)
        positions = (cache_len + torch.arange(q)).expand(batch, q).to(dev)  # [B, q]
        cache.lengths = [cache_len] * batch
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(tokens, positions, cache=cache)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.inference_mode():
        for q in qs:  # warm-up round, untimed
            one_pass(q)
        for r in range(repeats):
            shift = r % len(qs)
            for q in qs[shift:] + qs[:shift]:
                times[q].append(one_pass(q))
    points = {q: metrics.median_spread(ts)[0] for q, ts in times.items()}
    meta = {
        "cache_len": cache_len,
        "batch": batch,
        "repeats": repeats,
        "masks": masks,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "spread": {str(q): [min(ts), max(ts)] for q, ts in times.items()},
    }
    return CostModel(points, meta)


def cached(key: dict, make: Callable[[], CostModel], folder: Path | None = None, refresh: bool = False) -> CostModel:
    """A t(q) kept between runs: `folder` (default `<mtp cache>/costmodel`) holds, per `key` (what the
    timing depends on: CPU, threads, weights, model, kernel build, block sizes; JSON values), one file
    with the CostModel `make()` measured and the key itself. Read when present and its key matches;
    else, or with `refresh`, measured and written atomically. A file that does not read (truncated,
    edited, another key) is measured again, with one line saying so; an unwritable cache only means
    the next run measures again."""
    from mtp.core.runtime.artifacts import cache_root, write_text_atomic

    key = json.loads(json.dumps(key, sort_keys=True))  # as it reads back from the file
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(folder or cache_root() / "costmodel") / f"tq-{digest}.json"
    if path.exists() and not refresh:
        try:
            data = json.loads(path.read_text())
            if data.get("key") != key:
                raise ValueError("it holds another machine's or model's measurement")
            return CostModel.from_json(data)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"mtp: the cached t(q) {path} does not read ({why}); measuring it again", file=sys.stderr)
    cost = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({**cost.to_json(), "key": key}, indent=1))
    except OSError:
        pass
    return cost


def predict_speedup(cost: CostModel, tokens_per_forward: float, mean_block_tokens: float | Sequence[int]) -> float:
    """speedup ≈ E[tokens per pass] · t(1) / E[t(q used)].

    `mean_block_tokens` is either the mean block size or the list of every pass's block size; the
    list is better (E[t(q)] over passes, not t(E[q]), since t is not linear)."""
    return predict_tokens_per_s(cost, tokens_per_forward, mean_block_tokens) * cost.pass_time(1)


def predict_tokens_per_s(cost: CostModel, tokens_per_forward: float, mean_block_tokens: float | Sequence[int]) -> float:
    """tokens/s ≈ E[tokens per pass] / E[t(q used)], forward passes only (no proposing, no overhead);
    `mean_block_tokens` as in `predict_speedup`."""
    if isinstance(mean_block_tokens, (int, float)):
        mean_t = cost.pass_time(mean_block_tokens)
    else:
        blocks = list(mean_block_tokens)
        if not blocks:
            raise ValueError("predict_speedup: no passes")
        mean_t = sum(cost.pass_time(q) for q in blocks) / len(blocks)
    return tokens_per_forward / mean_t


def expected_tokens(acceptance_by_position: Sequence[float], k: int) -> float:
    """E[tokens per pass] with blocks capped at k: sum of P(emitted > i) for i < k."""
    return float(sum(acceptance_by_position[:k])) if acceptance_by_position else 1.0


def best_k(
    cost: CostModel,
    acceptance_by_position: Sequence[float],
    k_max: int,
    block_tokens: Callable[[int, float], float] | None = None,
    guess_s: float = 0.0,
    per_pass_s: float = 0.0,
    mask_cost: CostModel | None = None,
) -> tuple[int, float]:
    """The block size K in 1..k_max with the most expected tokens per second, and that rate.

    acceptance_by_position[i] = P(a pass emits more than i tokens), measured with blocks at least
    k_max long (positions beyond the list count as never accepted), so E[n | K] = sum(acc[:K]).
    `block_tokens(K, E[n])` is the q one pass feeds; the default, K, is a `verify:K` pass with a
    proposer that appends nothing (the model's last token + K-1 drafts). Others (see
    `block_tokens_for`): mask proposer + verify feeds 1 + 2(K-1); static / conf_adapt feed the
    E[n] tokens emitted last pass plus the proposer's appended masks. `guess_s`: seconds the
    proposer spends per guess outside the forward pass (an EAGLE-3 drafter runs its decoder layer
    once per guess, K-1 sequential steps), so a pass with cap K costs t(q) + (K-1) * guess_s.
    `per_pass_s`: seconds every pass pays besides (the decoding loop, accepting, committing), so the
    rate compares with measured tokens/s. `mask_cost`: t(q) of passes that feed mask tokens
    (`measure(masks=True)`: the adapter path, dearer than a plain pass), pricing every K >= 2 of a
    proposer that appends masks (it appends none at K = 1, priced by `cost`).
    Returns (K, tokens/s)."""
    if k_max < 1:
        raise ValueError("k_max must be >= 1")
    q_of = block_tokens or (lambda k, n: k)
    best = (1, 0.0)
    for k in range(1, k_max + 1):
        n = expected_tokens(acceptance_by_position, k)
        priced = mask_cost if mask_cost is not None and k > 1 else cost
        rate = n / (priced.pass_time(q_of(k, n)) + (k - 1) * guess_s + per_pass_s)
        if rate > best[1] * (1 + 1e-9):
            best = (k, rate)
    return best


def block_tokens_for(kind: str, proposer) -> Callable[[int, float], float]:
    """q(K, E[n]) for a strategy kind and a proposer: `Strategy.steady_block` with E[n] fed back."""
    strategy = Strategy(kind)
    return lambda k, n: strategy.steady_block(k, proposer, pending=n)


def measured_cost(model, max_batch: int, cache_len: int = 256, repeats: int = 3):
    """A cost model t(q) over total tokens per pass (q = rows x block): batch-1 blocks plus
    full-batch blocks, so both ends of the batch range are measured, not extrapolated.

    On a shared machine other processes inflate some timings, so each point is the fastest of its
    repeats (the pass's own cost), and t is made non-decreasing in q (a bigger block never costs less).
    """
    cache_len = max(0, min(cache_len, model.config.max_seq_len - 64))

    def fastest(cm) -> dict[int, float]:
        spread = cm.meta.get("spread", {})
        return {q: float(spread[str(q)][0]) if str(q) in spread else t for q, t in cm.points.items()}

    points = fastest(measure(model, qs=[1, 4, 16, 64], cache_len=cache_len, batch=1, repeats=repeats))
    if max_batch > 1:
        full = fastest(measure(model, qs=[1, 2, 4], cache_len=cache_len, batch=max_batch, repeats=repeats))
        for q, t in full.items():
            n = q * max_batch
            points[n] = min(points[n], t) if n in points else t
    qs = sorted(points)
    for a, b in zip(qs, qs[1:]):
        points[b] = max(points[b], points[a])
    return CostModel(points, {"cache_len": cache_len, "max_batch": max_batch, "repeats": repeats})
