"""What MTP buys in a pipeline-parallel cluster, priced: each pass crosses P links (stage 0 -> 1 -> ...
-> P-1, then the logits back to stage 0), each costing the link latency plus its message's bytes /
bandwidth:
    pass time = compute t(q) + P · (latency + bytes per link / bandwidth)
MTP saves whole passes, so it saves the communication term too: with P·latency large against t(q)
its speedup tends to the tokens per pass. `mtp pipeline --predict` prints `predict_cluster`;
benchmarks/pipeline_latency.py checks it against measured runs."""

from __future__ import annotations


def pipeline_comm_time(
    stages: int, latency_s: float, bytes_per_link: float = 0.0, bandwidth_Bps: float = float("inf")
) -> float:
    """Seconds one pass spends on the links: stages × (latency + bytes per link / bandwidth)."""
    return stages * (latency_s + (bytes_per_link / bandwidth_Bps if bytes_per_link else 0.0))


def pipeline_link_bytes(
    stages: int, block_tokens: float, out_rows: float, dim: int, vocab: int, dtype_bytes: int = 2
) -> float:
    """Mean bytes per link message of one pass: P-1 hidden-state messages [q, dim] and one logits
    message [rows, vocab] back to stage 0 (headers and positions are negligible)."""
    total = (stages - 1) * block_tokens * dim * dtype_bytes + out_rows * vocab * dtype_bytes
    return total / stages


def pipeline_speedup(
    pass_s_ntp: float,
    pass_s_mtp: float,
    tokens_per_pass: float,
    stages: int,
    latency_s: float,
    bytes_ntp: float = 0.0,
    bytes_mtp: float = 0.0,
    bandwidth_Bps: float = float("inf"),
) -> float:
    """MTP over ntp tokens/s in a pipeline: n · (t(1) + comm(1)) / (t(q) + comm(q))."""
    ntp = pass_s_ntp + pipeline_comm_time(stages, latency_s, bytes_ntp, bandwidth_Bps)
    mtp = pass_s_mtp + pipeline_comm_time(stages, latency_s, bytes_mtp, bandwidth_Bps)
    return tokens_per_pass * ntp / mtp


CLUSTER_KEYS = {
    "stages": int,
    "latency_ms": float,
    "pass_ms": float,
    "tokens_per_pass": float,
    "block_cost": float,
    "block_tokens": float,
    "bandwidth_gbps": float,
    "dim": int,
    "vocab": int,
    "dtype_bytes": int,
}


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
        raise ValueError(
            f"--predict needs {', '.join(missing)} (e.g. stages=8,latency_ms=0.5,pass_ms=40,tokens_per_pass=3)"
        )
    if out["stages"] < 1 or out["pass_ms"] <= 0 or out["tokens_per_pass"] < 1 or out["latency_ms"] < 0:
        raise ValueError("--predict needs stages >= 1, pass_ms > 0, tokens_per_pass >= 1, latency_ms >= 0")
    return out


def predict_cluster(
    stages: int,
    latency_ms: float,
    pass_ms: float,
    tokens_per_pass: float,
    block_cost: float = 1.1,
    block_tokens: float | None = None,
    bandwidth_gbps: float = 0.0,
    dim: int = 0,
    vocab: int = 0,
    dtype_bytes: int = 2,
) -> dict:
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
        return {
            "latency_ms": lat_ms,
            "ntp_tokens_per_s": 1 / ntp_pass,
            "mtp_tokens_per_s": tokens_per_pass / mtp_pass,
            "speedup": pipeline_speedup(t1, tq, tokens_per_pass, stages, lat, b1, bq, bw),
            "comm_share_ntp": 1 - t1 / ntp_pass,
        }

    here = point(latency_ms)
    sweep = [point(x) for x in sorted({0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, latency_ms})]
    lines = [
        f"cluster: {stages} stages, {latency_ms:g} ms per link, {pass_ms:g} ms compute per pass, "
        f"{tokens_per_pass:g} tokens per MTP pass (block of {q:g} tokens costing {block_cost:g}x a "
        f"one-token pass)" + (f", {bandwidth_gbps:g} Gbit/s" if bw < float("inf") and dim else ""),
        f"predicted: ntp {here['ntp_tokens_per_s']:.1f} tokens/s, MTP {here['mtp_tokens_per_s']:.1f} tokens/s, "
        f"speedup {here['speedup']:.2f}x (links are {100 * here['comm_share_ntp']:.0f}% of an ntp pass)",
        "",
        "latency_ms  ntp_tok/s  mtp_tok/s  speedup",
    ]
    lines += [
        f"{p['latency_ms']:>10g}  {p['ntp_tokens_per_s']:>9.1f}  {p['mtp_tokens_per_s']:>9.1f}  {p['speedup']:>6.2f}x"
        for p in sweep
    ]
    return {**here, "sweep": sweep, "text": "\n".join(lines)}
