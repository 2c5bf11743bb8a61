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

import json
import time
from bisect import bisect_left
from typing import Callable, Sequence

import torch

from mtp.core import metrics
from mtp.core.cache import KVCache
from mtp.core.strategy import Strategy


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
        return {"points": {str(q): t for q, t in self.points.items()},
                "linear_fit": {"intercept_s": a, "slope_s_per_token": b}, **self.meta}

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


def measure(model, qs: Sequence[int] = range(1, 33), cache_len: int = 300, batch: int = 1,
            repeats: int = 5) -> CostModel:
    """Time one forward pass of q new tokens per row over a cache of `cache_len` committed positions.

    Rounds over all q are interleaved (q order rotated each round) so machine drift spreads evenly;
    one untimed round warms up; each point is the median of `repeats` timings. Logits are computed
    at every block position, as a verify or mask pass needs. The cache content is irrelevant to the
    time, so it is left as zeros and only its length is set.
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
    times: dict[int, list[float]] = {q: [] for q in qs}

    def one_pass(q: int) -> float:
        tokens = torch.randint(0, n_real, (batch, q), generator=gen).to(dev)  # [B, q]
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
    meta = {"cache_len": cache_len, "batch": batch, "repeats": repeats, "device": str(dev),
            "threads": torch.get_num_threads(),
            "spread": {str(q): [min(ts), max(ts)] for q, ts in times.items()}}
    return CostModel(points, meta)


def predict_speedup(cost: CostModel, tokens_per_forward: float,
                    mean_block_tokens: float | Sequence[int]) -> float:
    """speedup ≈ E[tokens per pass] · t(1) / E[t(q used)].

    `mean_block_tokens` is either the mean block size or the list of every pass's block size; the
    list is better (E[t(q)] over passes, not t(E[q]), since t is not linear)."""
    return predict_tokens_per_s(cost, tokens_per_forward, mean_block_tokens) * cost.pass_time(1)


def predict_tokens_per_s(cost: CostModel, tokens_per_forward: float,
                         mean_block_tokens: float | Sequence[int]) -> float:
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


def best_k(cost: CostModel, acceptance_by_position: Sequence[float], k_max: int,
           block_tokens: Callable[[int, float], float] | None = None,
           guess_s: float = 0.0) -> tuple[int, float]:
    """The block size K in 1..k_max with the most expected tokens per second, and that rate.

    acceptance_by_position[i] = P(a pass emits more than i tokens), measured with blocks at least
    k_max long (positions beyond the list count as never accepted), so E[n | K] = sum(acc[:K]).
    `block_tokens(K, E[n])` is the q one pass feeds; the default, K, is a `verify:K` pass with a
    proposer that appends nothing (the model's last token + K-1 drafts). Others (see
    `block_tokens_for`): mask proposer + verify feeds 1 + 2(K-1); static / conf_adapt feed the
    E[n] tokens emitted last pass plus the proposer's appended masks. `guess_s`: seconds the
    proposer spends per guess outside the forward pass (an EAGLE-3 drafter runs its decoder layer
    once per guess, K-1 sequential steps), so a pass with cap K costs t(q) + (K-1) * guess_s.
    Returns (K, tokens/s)."""
    if k_max < 1:
        raise ValueError("k_max must be >= 1")
    q_of = block_tokens or (lambda k, n: k)
    best = (1, 0.0)
    for k in range(1, k_max + 1):
        n = expected_tokens(acceptance_by_position, k)
        rate = n / (cost.pass_time(q_of(k, n)) + (k - 1) * guess_s)
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


# --- pipeline parallelism: a per-pass communication term (mtp.pipeline.stages, benchmarks/pipeline_latency.py)
#
# A pass through P pipeline stages crosses P links (stage 0 -> 1 -> ... -> P-1, then the logits back
# to stage 0), each costing the link latency plus its message's bytes / bandwidth:
#     pass time = compute t(q) + P · (latency + bytes per link / bandwidth)
# MTP saves whole passes, so it saves the communication term too: with P·latency large against t(q)
# its speedup tends to the tokens per pass.

def pipeline_comm_time(stages: int, latency_s: float, bytes_per_link: float = 0.0,
                       bandwidth_Bps: float = float("inf")) -> float:
    """Seconds one pass spends on the links: stages × (latency + bytes per link / bandwidth)."""
    return stages * (latency_s + (bytes_per_link / bandwidth_Bps if bytes_per_link else 0.0))


def pipeline_link_bytes(stages: int, block_tokens: float, out_rows: float, dim: int, vocab: int,
                        dtype_bytes: int = 2) -> float:
    """Mean bytes per link message of one pass: P-1 hidden-state messages [q, dim] and one logits
    message [rows, vocab] back to stage 0 (headers and positions are negligible)."""
    total = (stages - 1) * block_tokens * dim * dtype_bytes + out_rows * vocab * dtype_bytes
    return total / stages


def pipeline_speedup(pass_s_ntp: float, pass_s_mtp: float, tokens_per_pass: float, stages: int,
                     latency_s: float, bytes_ntp: float = 0.0, bytes_mtp: float = 0.0,
                     bandwidth_Bps: float = float("inf")) -> float:
    """MTP over ntp tokens/s in a pipeline: n · (t(1) + comm(1)) / (t(q) + comm(q))."""
    ntp = pass_s_ntp + pipeline_comm_time(stages, latency_s, bytes_ntp, bandwidth_Bps)
    mtp = pass_s_mtp + pipeline_comm_time(stages, latency_s, bytes_mtp, bandwidth_Bps)
    return tokens_per_pass * ntp / mtp


CLUSTER_KEYS = {"stages": int, "latency_ms": float, "pass_ms": float, "tokens_per_pass": float,
                "block_cost": float, "block_tokens": float, "bandwidth_gbps": float, "dim": int, "vocab": int,
                "dtype_bytes": int}


def parse_cluster(spec: str) -> dict:
    """`stages=8,latency_ms=0.5,pass_ms=40,tokens_per_pass=3` -> keyword arguments of predict_cluster."""
    out = {}
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        key, eq, value = item.partition("=")
        if not eq or key not in CLUSTER_KEYS:
            raise ValueError(f"bad --predict item {item!r}; keys: {', '.join(CLUSTER_KEYS)}")
        try:
            out[key] = CLUSTER_KEYS[key](value)
        except ValueError:
            raise ValueError(f"bad --predict value {item!r}") from None
    missing = [k for k in ("stages", "latency_ms", "pass_ms", "tokens_per_pass") if k not in out]
    if missing:
        raise ValueError(f"--predict needs {', '.join(missing)} (e.g. stages=8,latency_ms=0.5,pass_ms=40,"
                         "tokens_per_pass=3)")
    if out["stages"] < 1 or out["pass_ms"] <= 0 or out["tokens_per_pass"] < 1 or out["latency_ms"] < 0:
        raise ValueError("--predict needs stages >= 1, pass_ms > 0, tokens_per_pass >= 1, latency_ms >= 0")
    return out


def predict_cluster(stages: int, latency_ms: float, pass_ms: float, tokens_per_pass: float,
                    block_cost: float = 1.1, block_tokens: float | None = None, bandwidth_gbps: float = 0.0,
                    dim: int = 0, vocab: int = 0, dtype_bytes: int = 2) -> dict:
    """What MTP buys on a described cluster. pass_ms: compute of a one-token pass summed over the
    stages; block_cost: t(q)/t(1) of the MTP pass (default 1.1: a GPU at batch 1 is nearly flat in
    q; CPUs pay far more, see `measure`); block_tokens: tokens fed per MTP pass (default
    2 × tokens_per_pass: the accepted tokens plus the masks or drafts); bandwidth only counts when
    dim (and vocab) are given."""
    q = block_tokens if block_tokens is not None else 2 * tokens_per_pass
    bw = bandwidth_gbps * 1e9 / 8 if bandwidth_gbps > 0 else float("inf")
    b1 = pipeline_link_bytes(stages, 1, 1, dim, vocab, dtype_bytes) if dim else 0.0
    bq = pipeline_link_bytes(stages, q, q, dim, vocab, dtype_bytes) if dim else 0.0
    t1, tq = pass_ms / 1000, pass_ms * block_cost / 1000

    def point(lat_ms: float) -> dict:
        lat = lat_ms / 1000
        ntp_pass = t1 + pipeline_comm_time(stages, lat, b1, bw)
        mtp_pass = tq + pipeline_comm_time(stages, lat, bq, bw)
        return {"latency_ms": lat_ms, "ntp_tokens_per_s": 1 / ntp_pass,
                "mtp_tokens_per_s": tokens_per_pass / mtp_pass,
                "speedup": pipeline_speedup(t1, tq, tokens_per_pass, stages, lat, b1, bq, bw),
                "comm_share_ntp": 1 - t1 / ntp_pass}

    here = point(latency_ms)
    sweep = [point(x) for x in sorted({0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, latency_ms})]
    lines = [f"cluster: {stages} stages, {latency_ms:g} ms per link, {pass_ms:g} ms compute per pass, "
             f"{tokens_per_pass:g} tokens per MTP pass (block of {q:g} tokens costing {block_cost:g}x a "
             f"one-token pass)" + (f", {bandwidth_gbps:g} Gbit/s" if bw < float("inf") and dim else ""),
             f"predicted: ntp {here['ntp_tokens_per_s']:.1f} tokens/s, MTP {here['mtp_tokens_per_s']:.1f} tokens/s, "
             f"speedup {here['speedup']:.2f}x (links are {100 * here['comm_share_ntp']:.0f}% of an ntp pass)",
             "", "latency_ms  ntp_tok/s  mtp_tok/s  speedup"]
    lines += [f"{p['latency_ms']:>10g}  {p['ntp_tokens_per_s']:>9.1f}  {p['mtp_tokens_per_s']:>9.1f}  "
              f"{p['speedup']:>6.2f}x" for p in sweep]
    return {**here, "sweep": sweep, "text": "\n".join(lines)}
