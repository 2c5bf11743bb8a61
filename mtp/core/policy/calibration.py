"""Calibrated confidences: a proposer's confidence of τ made to mean "right with probability τ".

`conf_adapt:TAU` emits a guess unverified when its confidence is at least τ, so τ is a promise only
if confidences are calibrated. A proposer's raw confidence is the top-1 probability of its own
distribution for that depth; heads and mask adapters are over-confident at depth 3 and beyond,
where they guess from a context they only partly see.

Calibration per depth d (1 = the first guess after the model's own token), fitted on held-out
(confidence, right) pairs, where "right" means the guess equals the model's greedy token given that
every earlier guess was right (what a `verify` chain records: a draft is checked only after its
predecessors were accepted, which is exactly when conf_adapt would emit it). The decoder sees only
each guess's top-1 confidence c, so the map is a temperature with a bias on its log-odds (Platt
scaling; the bias-free case is the plain temperature):

    c' = sigmoid(logit(c) / T_d + b_d)

monotone in c, so the ranking of guesses (and a tree's shape) is kept. Depths beyond the fitted
ones use the last fitted depth's map. `expected_calibration_error` is the measure (10 equal-width
bins, weighted by count); `CalibratedProposer` applies a fit to a proposer's guesses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mtp.core.decoding.proposers.base import DraftRequest, Guesses, Proposer, WrappedProposer
from mtp.core.decoding.tree import depths as tree_depths

EPS = 1e-6
BINS = 10


def _logit(c: float) -> float:
    c = min(max(c, EPS), 1 - EPS)
    return math.log(c / (1 - c))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


@dataclass(frozen=True)
class DepthMap:
    temperature: float = 1.0
    bias: float = 0.0

    def __call__(self, c: float) -> float:
        if not math.isfinite(c):
            return c  # a non-finite guess stays one (decode rejects it)
        return _sigmoid(_logit(c) / self.temperature + self.bias)


@dataclass(frozen=True)
class Calibration:
    """Per-depth maps of one proposer's confidences (depth 1 first)."""

    depths: tuple[DepthMap, ...]

    def __post_init__(self):
        if not self.depths:
            raise ValueError("a calibration needs at least one depth")
        for m in self.depths:
            if not (math.isfinite(m.temperature) and m.temperature > 0 and math.isfinite(m.bias)):
                raise ValueError(f"calibration temperatures must be finite and > 0, biases finite: {m}")

    def map(self, depth: int, c: float) -> float:
        """The calibrated confidence of a guess at `depth` (0 = the first guess)."""
        return self.depths[min(depth, len(self.depths) - 1)](c)

    def apply(self, confidences: list[float]) -> list[float]:
        return [self.map(d, c) for d, c in enumerate(confidences)]

    def to_json(self) -> list[dict]:
        return [{"temperature": m.temperature, "bias": m.bias} for m in self.depths]

    @classmethod
    def from_json(cls, data) -> "Calibration":
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise ValueError("a calibration is a list of {'temperature', 'bias'} per depth")
        try:
            return cls(tuple(DepthMap(float(d["temperature"]), float(d.get("bias", 0.0))) for d in data))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad calibration entry: {e}") from None


W_RANGE = (1e-2, 1e2)  # 1 / temperature: a map stays increasing and never jumps like a step function
B_RANGE = (-30.0, 30.0)


def fit_depth(pairs: list[tuple[float, bool]], iterations: int = 50, l2: float = 1e-3) -> DepthMap:
    """The (temperature, bias) minimising the log loss of sigmoid(w * logit(c) + b) on (c, right)
    pairs (damped Newton steps on a two-parameter logistic regression, w = 1 / temperature, kept in
    W_RANGE and B_RANGE, with a weak pull towards the identity). Too few pairs, or pairs that are
    all right or all wrong, leave the identity; one confidence for every pair learns its rate."""
    if len(pairs) < 20 or all(r for _, r in pairs) or not any(r for _, r in pairs):
        return DepthMap()
    xs = [_logit(c) for c, _ in pairs]
    ys = [1.0 if r else 0.0 for _, r in pairs]
    mean_x = sum(xs) / len(xs)
    if max(xs) - min(xs) < 1e-3:  # one confidence for every guess (prompt lookup's 1.0): its rate is all to learn
        return DepthMap(1.0, _logit(sum(ys) / len(ys)) - mean_x)

    w, b = 1.0, 0.0
    current = _log_loss(xs, ys, w, b, l2)
    for _ in range(iterations):
        gw, gb, hww, hwb, hbb = _gradient_hessian(xs, ys, w, b, l2)
        det = hww * hbb - hwb * hwb
        if det <= 0:
            break
        # the joint Newton step, else (a bound on w holds it) a step in the bias alone; backtracked
        directions = (((hbb * gw - hwb * gb) / det, (hww * gb - hwb * gw) / det), (0.0, gb / hbb))
        found = _backtrack(xs, ys, l2, w, b, current, directions)
        if found is None:
            break
        nw, nb, new = found
        moved = abs(nw - w) + abs(nb - b)
        w, b, current = nw, nb, new
        if moved < 1e-7:
            break
    return DepthMap(1 / w, b)


def _log_loss(xs: list[float], ys: list[float], w: float, b: float, l2: float) -> float:
    """The log loss of sigmoid(w * x + b) on (x, y), with the pull towards the identity (w, b) = (1, 0)."""
    total = 0.0
    for x, y in zip(xs, ys):
        z = w * x + b
        total += (math.log1p(math.exp(-abs(z))) + max(z, 0.0)) - y * z  # log(1 + e^z) - y z, stable
    return total + 0.5 * l2 * ((w - 1) ** 2 + b * b)


def _gradient_hessian(xs: list[float], ys: list[float], w: float, b: float, l2: float) -> tuple[float, ...]:
    """(d/dw, d/db, d2/dw2, d2/dwdb, d2/db2) of `_log_loss` at (w, b)."""
    gw, gb = l2 * (w - 1), l2 * b
    hww = hbb = l2
    hwb = 0.0
    for x, y in zip(xs, ys):
        p = _sigmoid(w * x + b)
        e, v = p - y, p * (1 - p)
        gw += e * x
        gb += e
        hww += v * x * x
        hwb += v * x
        hbb += v
    return gw, gb, hww, hwb, hbb


def _backtrack(xs, ys, l2: float, w: float, b: float, current: float, directions) -> tuple[float, float, float] | None:
    """The first step that lowers the loss below `current`: along each of `directions` (dw, db) in turn,
    the whole step then halved up to 30 times, each clamped to W_RANGE and B_RANGE; (w, b, loss) or None."""
    for dw, db in directions:
        step = 1.0
        for _ in range(30):
            nw = min(max(w - step * dw, W_RANGE[0]), W_RANGE[1])
            nb = min(max(b - step * db, B_RANGE[0]), B_RANGE[1])
            new = _log_loss(xs, ys, nw, nb, l2)
            if new < current - 1e-12:
                return nw, nb, new
            step /= 2
    return None


def fit(pairs_by_depth: list[list[tuple[float, bool]]]) -> Calibration:
    """One map per depth that has pairs (depths are 1, 2, ... in list order)."""
    maps = [fit_depth(p) for p in pairs_by_depth if p]
    return Calibration(tuple(maps) or (DepthMap(),))


def expected_calibration_error(pairs: list[tuple[float, bool]], bins: int = BINS) -> float | None:
    """sum over equal-width confidence bins of (bin share) x |accuracy - mean confidence|; None if empty."""
    if not pairs:
        return None
    total = [0] * bins
    conf = [0.0] * bins
    right = [0] * bins
    for c, r in pairs:
        j = min(int(c * bins), bins - 1)
        total[j] += 1
        conf[j] += c
        right[j] += bool(r)
    n = len(pairs)
    return sum(abs(right[j] / total[j] - conf[j] / total[j]) * total[j] / n for j in range(bins) if total[j])


def ece_floor(confidences: list[float], draws: int = 20, seed: int = 0) -> float | None:
    """The error a perfectly calibrated proposer would still show on this many guesses: the mean
    `expected_calibration_error` of outcomes drawn right with probability equal to each confidence
    (fixed seed). A measured error near it cannot be told from calibrated."""
    if not confidences:
        return None
    import random

    rng = random.Random(seed)
    return sum(expected_calibration_error([(c, rng.random() < c) for c in confidences]) for _ in range(draws)) / draws


def reliability(pairs: list[tuple[float, bool]], bins: int = BINS) -> list[dict]:
    """Per non-empty bin: its range, count, mean confidence and accuracy (the reliability diagram)."""
    out = []
    for j in range(bins):
        lo, hi = j / bins, (j + 1) / bins
        inside = [(c, r) for c, r in pairs if lo <= c < hi or (j == bins - 1 and c == 1.0)]
        if inside:
            out.append(
                {
                    "lo": lo,
                    "hi": hi,
                    "n": len(inside),
                    "confidence": sum(c for c, _ in inside) / len(inside),
                    "accuracy": sum(bool(r) for _, r in inside) / len(inside),
                }
            )
    return out


class CalibratedProposer(WrappedProposer):
    """`inner` with its confidences mapped: a chain's guesses by `chain` (per depth), a tree's nodes
    by `tree` (per node depth; a node's confidence is then the probability that its whole root path
    is the model's continuation, what a merged proposer compares across parts). Tokens and tree
    shapes are unchanged; either map may be None (left as is)."""

    def __init__(self, inner: Proposer, chain: Calibration | None = None, tree: Calibration | None = None):
        super().__init__(inner)
        self.chain, self.tree_calibration = chain, tree

    def propose(self, request: DraftRequest) -> Guesses:
        g = self.inner.propose(request)
        if not request.tree:
            if self.chain is None:
                return g
            return replace(g, confidences=self.chain.apply(g.confidences))  # tokens, tree and sources kept
        if self.tree_calibration is None or not g.tokens:
            return g
        confs = [self.tree_calibration.map(d - 1, c) for d, c in zip(tree_depths(g.parents), g.confidences)]
        return replace(g, confidences=confs)
