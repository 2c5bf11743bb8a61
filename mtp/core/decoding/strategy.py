"""Decoding strategies, named the way users say them: `ntp`, `static:K`, `conf_adapt:TAU[:KMAX]`,
`verify:K`, and everything that differs between them: parsing (the CLI, the server and the
benchmarks reject bad strings alike), how many guesses a pass emits, whether guesses become drafts,
and how many tokens a pass feeds in steady state (what the cost model and the server price)."""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("ntp", "static", "conf_adapt", "verify", "tree")
USAGE = "expected one of: ntp, static:K, conf_adapt:TAU[:KMAX], verify:K, tree:N, tree:auto"
K_LIMIT = 32  # the largest K any front end accepts (sizes KV-cache slack; checked before a model loads)
SWEEP_LIMIT = 256  # strategies one sweep may expand to
AUTO_TREE_NODES = (
    24  # `tree:auto` drafts at most this many nodes, then keeps the prefix that pays (mtp.core.decoding.tree.prune)
)
TREE_MASK_DEPTH = 3  # `tree:N` from mask guesses: masks per group, the depths its tree spans (heads: their depths)


class StrategyError(ValueError):
    pass


_INT = re.compile(r"-?[0-9]+")
_FLOAT = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


def ascii_int(text: str) -> int:
    """An integer written in ASCII digits (int() alone also takes `４`, `1_0` and spaces)."""
    if not _INT.fullmatch(text):
        raise ValueError(f"not an ASCII integer: {text!r}")
    return int(text)


def ascii_float(text: str) -> float:
    """A decimal number written in ASCII (float() alone also takes `０.９`, `1_0`, `nan`)."""
    if not _FLOAT.fullmatch(text):
        raise ValueError(f"not an ASCII number: {text!r}")
    return float(text)


@dataclass(frozen=True)
class Strategy:
    kind: str = "ntp"
    k: int = 1  # block size: tokens predicted per pass (ntp: 1)
    tau: float = 1.0  # conf_adapt threshold
    auto: bool = False  # tree:auto: the tree's size chosen per pass from t(q) and the nodes' confidences

    @property
    def lossless(self) -> bool:
        return self.kind in ("ntp", "verify", "tree")

    @property
    def is_tree(self) -> bool:
        """Drafts form a token tree of at most k-1 nodes (`tree:N` has k = N + 1; mtp.core.decoding.tree)."""
        return self.kind == "tree"

    @property
    def plain(self) -> bool:
        """Plain next-token decoding (no proposals at all)."""
        return self.kind == "ntp"

    @property
    def verifies(self) -> bool:
        """Guesses become drafts that the next pass checks (instead of being emitted unverified)."""
        return self.kind in ("verify", "tree")

    @property
    def thresholded(self) -> bool:
        """Emission depends on the guesses' confidences (needs a proposer that has them)."""
        return self.kind == "conf_adapt"

    @property
    def metric_label(self) -> str:
        """A bounded name for metrics: kind and K, never a threshold (clients choose those freely)."""
        if self.kind == "conf_adapt":
            return f"conf_adapt:kmax={self.k}"
        return str(self)

    def emit_count(self, confidences: list[float]) -> int:
        """How many of [model token, guess 1, guess 2, ...] (their confidences) a pass emits unverified."""
        if self.kind == "static":
            return len(confidences)
        if self.kind == "conf_adapt":
            n = 0
            while n < len(confidences) and confidences[n] >= self.tau:
                n += 1
            return max(n, 1)
        return 1  # ntp, verify: only the model's own token

    def offered(self, k: int, n_drafts: int) -> int:
        """Positions a pass of block size k can emit at most: the model's own token plus the drafts
        it checks (verify) or plus its k-1 guesses (static, conf_adapt)."""
        if self.verifies:
            return min(n_drafts, k - 1) + 1
        return k if self.kind != "ntp" else 1

    def guess_k(self, k: int) -> int:
        """The block size a pass of block size k sizes appended guesses for (`Proposer.n_appended`): k,
        i.e. groups of k-1 masks, one guess per position; a tree's groups hold at most TREE_MASK_DEPTH
        masks, one distribution per depth, over which its k-1 nodes spread (mtp.core.decoding.proposers.mask)."""
        return min(k, TREE_MASK_DEPTH + 1) if self.is_tree else k

    def steady_block(self, k: int, proposer, pending: float | None = None) -> float:
        """Tokens one pass of block size k feeds in steady state: a verify pass checks k-1 drafts
        behind its one pending token (plus the proposer's appended masks for k-1 drafts); any other
        pass feeds back, as pending, the tokens it emitted last pass (`pending`, default k) plus the
        proposer's masks."""
        if self.verifies:
            return 1 + (k - 1) + proposer.n_appended(self.guess_k(k), k - 1)
        return (k if pending is None else pending) + proposer.n_appended(k, 0)

    def __str__(self) -> str:
        if self.kind == "ntp":
            return "ntp"
        if self.kind == "conf_adapt":
            return f"conf_adapt:{self.tau:g}" + ("" if self.k == 16 else f":{self.k}")
        if self.kind == "tree":
            return "tree:auto" if self.auto else f"tree:{self.k - 1}"
        return f"{self.kind}:{self.k}"

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """One of USAGE's forms, its numbers in ASCII digits and in range (K, KMAX in 1..K_LIMIT, TAU
        in (0, 1]); anything else is a StrategyError saying what is wrong."""
        parts = str(text).strip().split(":")
        kind, args = parts[0], parts[1:]
        try:
            if kind == "ntp" and not args:
                return cls("ntp", 1)
            if kind in ("static", "verify") and len(args) == 1:
                return cls(kind, _k_in_range(ascii_int(args[0]), "K", text))
            if kind == "tree" and args == ["auto"]:
                return cls("tree", AUTO_TREE_NODES + 1, auto=True)
            if kind == "tree" and len(args) == 1:
                n = ascii_int(args[0])
                if not 1 <= n <= K_LIMIT - 1:
                    raise StrategyError(
                        f"N (draft nodes) must be in 1..{K_LIMIT - 1} in {text!r} "
                        f"(a tree pass feeds N + 1 <= {K_LIMIT} tokens)"
                    )
                return cls("tree", n + 1)
            if kind == "conf_adapt" and len(args) in (1, 2):
                tau = ascii_float(args[0])
                if not 0 < tau <= 1:
                    raise StrategyError(f"tau must be in (0, 1] in {text!r}")
                k = _k_in_range(ascii_int(args[1]) if len(args) == 2 else 16, "KMAX", text)
                return cls("conf_adapt", k, tau)
        except StrategyError:
            raise
        except ValueError:
            pass
        raise StrategyError(f"malformed strategy {text!r}; {USAGE}")


def _k_in_range(k: int, name: str, text: str) -> int:
    """`k` (named `name` in strategy `text`) when in 1..K_LIMIT; else a StrategyError saying which bound."""
    if k < 1:
        raise StrategyError(f"{name} must be >= 1 in {text!r}")
    if k > K_LIMIT:
        raise StrategyError(f"{name} is at most {K_LIMIT} in {text!r}")
    return k


def expand_sweep(text: str) -> list[Strategy]:
    """`conf_adapt:0.99,0.95,0.9` and `static:1..8` -> lists of strategies; a comma list of names too."""
    out: list[Strategy] = []
    for chunk in split_list(text):
        kind, _, rest = chunk.partition(":")
        if ".." in rest and kind in ("static", "verify"):
            lo, hi = rest.split("..", 1)
            try:
                lo, hi = ascii_int(lo), ascii_int(hi)
            except ValueError:
                raise StrategyError(f"malformed range {chunk!r}; expected e.g. {kind}:1..8") from None
            if not 1 <= lo <= hi <= K_LIMIT:
                raise StrategyError(f"range {chunk!r} must lie within 1..{K_LIMIT}")
            out += [Strategy.parse(f"{kind}:{k}") for k in range(lo, hi + 1)]
        else:
            out.append(Strategy.parse(chunk))
        if len(out) > SWEEP_LIMIT:
            raise StrategyError(f"a sweep may hold at most {SWEEP_LIMIT} strategies")
    return out


def split_list(text: str) -> list[str]:
    """Split on commas, letting a bare number continue the previous strategy's kind."""
    items: list[str] = []
    for piece in [p.strip() for p in text.split(",") if p.strip()]:
        if items and piece[0] in "0123456789":
            kind = items[-1].split(":")[0]
            items.append(f"{kind}:{piece}")
        else:
            items.append(piece)
    return items
