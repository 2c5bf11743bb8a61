"""llama.cpp's own t(q), and the `--spec-draft-n-max` / `--spec-draft-p-min` it favours for a drafter.

`measure(target)` runs `llama-bench` (the `make llamacpp` build) over prompt blocks of q tokens at a
cache depth, one pass each: t(q) in seconds, the cost of a llama.cpp target pass that verifies q-1
drafts. `advise(t, timings)` reads what a `llamacpp-server-eagle3` row measured (llama-server's own
`timings` per request: `predicted_n`, `predicted_ms`, `draft_n`, `draft_n_accepted`) and prices every
draft count n against plain decoding:

    steps   = predicted_n - draft_n_accepted              (target passes)
    drafts  = draft_n / steps                             (drafts per step the row ran with)
    t_draft = (predicted_ms / steps - t(1 + drafts)) / drafts   (the drafter's seconds per draft)
    a       = the per-draft acceptance of a geometric chain with accepted / steps = a + a^2 + ... + a^drafts
    rate(n) = (1 + a + ... + a^n) / (t(n + 1) + n t_draft)     (rate(0) = 1 / t(1): plain decoding)

The n with the highest rate is advised (0: do not speculate on this target). `--spec-draft-p-min`: llama.cpp
stops drafting when a draft's probability falls below it; a further draft right with probability p adds p
tokens for t_draft + t(n + 2) - t(n + 1) more seconds per step, which pays only when p exceeds the best
rate times that cost, so that product is the advised p-min (it assumes the drafter's probabilities are
calibrated, as `mtp tune` measures for our own proposers). llama.cpp drafts a token only when its probability
is at least p-min, so p-min 1 drafts nothing, and one above the drafter's per-draft acceptance a cuts most of
the chains the rate was priced on: the advised p-min is capped at a and at P_MIN_MAX (below 1 once printed
with two decimals). A further draft dearer than it can pay (the product at or above the cap) is `n_max`'s to
exclude, not p-min's; with n_max 0 the advice is plain decoding, at 1.00x.
"""

from __future__ import annotations

import json
import subprocess

from mtp.core.policy.costmodel import CostModel
from mtp.interop import llamacpp_env

QS = (1, 2, 3, 4, 5, 6, 8)  # blocks llama-bench measures (drafts per step up to 7)
P_MIN_MAX = 0.95  # the highest p-min advised: 1 would turn drafting off


def measure(target, qs=QS, depth: int = 128, threads: int = 1, repeats: int = 3) -> dict[int, float]:
    """t(q) in seconds from `llama-bench -p q -n 0 -d depth` on the GGUF `target`."""
    gone = llamacpp_env.missing()
    if gone:
        raise ValueError(gone)
    cmd = [
        str(llamacpp_env.prefix() / "build" / "bin" / "llama-bench"),
        "-m",
        str(target),
        "-p",
        ",".join(map(str, qs)),
        "-n",
        "0",
        "-d",
        str(depth),
        "-t",
        str(threads),
        "-r",
        str(repeats),
        "-o",
        "json",
        *llamacpp_env.run_flags(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {tail}")
    return {int(r["n_prompt"]): r["avg_ns"] / 1e9 for r in json.loads(proc.stdout) if r.get("n_gen") == 0}


def chain_acceptance(accepted_per_step: float, drafts: float) -> float:
    """a in [0, 1] with a + a^2 + ... + a^drafts = accepted_per_step (bisection; drafts may be fractional)."""
    whole = max(1, round(drafts))
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a**d for d in range(1, whole + 1)) < accepted_per_step:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def advise(t: dict[int, float], timings: list[dict], n_max: int = 7) -> dict:
    """The draft count and p-min llama.cpp's t(q) favours for the drafter these timings came from
    (t(q) between and beyond the measured blocks as `CostModel.pass_time` reads it). The p-min advised
    always lets the drafter draft: at most its per-draft acceptance and P_MIN_MAX (see the module)."""
    pass_time = CostModel(t).pass_time
    n = sum(x.get("predicted_n", 0) for x in timings)
    ms = sum(x.get("predicted_ms", 0.0) for x in timings)
    drafted = sum(x.get("draft_n", 0) for x in timings)
    acc = sum(x.get("draft_n_accepted", 0) for x in timings)
    steps = n - acc
    if steps <= 0 or drafted <= 0 or ms <= 0:
        raise ValueError("the timings hold no speculative steps (draft_n is 0)")
    drafts = drafted / steps
    t_draft = max(0.0, (ms / 1e3 / steps - pass_time(1 + drafts)) / drafts)
    a = chain_acceptance(acc / steps, drafts)
    rates = {k: sum(a**d for d in range(k + 1)) / (pass_time(k + 1) + k * t_draft) for k in range(n_max + 1)}
    best = max(rates, key=lambda k: rates[k])
    extra = t_draft + pass_time(best + 2) - pass_time(best + 1)
    return {
        "n_max": best,
        "p_min": min(P_MIN_MAX, a, rates[best] * extra),
        "acceptance": a,
        "draft_s": t_draft,
        "drafts_per_step": drafts,
        "rates": rates,
        "speedup": rates[best] / rates[0],
    }


def advice_line(row: str, adv: dict) -> str:
    if adv["n_max"] == 0:
        return (
            f"{row}: on this target llama.cpp's t(q) favours no drafting (each draft costs "
            f"{1e3 * adv['draft_s']:.1f} ms, acceptance {adv['acceptance']:.2f} per draft): serve it plain"
        )
    return (
        f"{row}: llama.cpp's t(q) favours --spec-draft-n-max {adv['n_max']} --spec-draft-p-min "
        f"{adv['p_min']:.2f} (expected {adv['speedup']:.2f}x plain; {1e3 * adv['draft_s']:.1f} ms per draft, "
        f"acceptance {adv['acceptance']:.2f} per draft)"
    )
