"""Decoding strategies, named the way users say them: `ntp`, `static:K`, `conf_adapt:TAU[:KMAX]`,
`verify:K`. Parsing lives here so the CLI, the server and the benchmarks reject bad strings alike."""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("ntp", "static", "conf_adapt", "verify")
USAGE = "expected one of: ntp, static:K, conf_adapt:TAU[:KMAX], verify:K"


class StrategyError(ValueError):
    pass


@dataclass(frozen=True)
class Strategy:
    kind: str = "ntp"
    k: int = 1  # block size: tokens predicted per pass (ntp: 1)
    tau: float = 1.0  # conf_adapt threshold

    @property
    def lossless(self) -> bool:
        return self.kind in ("ntp", "verify")

    def __str__(self) -> str:
        if self.kind == "ntp":
            return "ntp"
        if self.kind == "conf_adapt":
            return f"conf_adapt:{self.tau:g}" + ("" if self.k == 16 else f":{self.k}")
        return f"{self.kind}:{self.k}"

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        parts = str(text).strip().split(":")
        kind, args = parts[0], parts[1:]
        try:
            if kind == "ntp" and not args:
                return cls("ntp", 1)
            if kind in ("static", "verify") and len(args) == 1:
                k = int(args[0])
                if k < 1:
                    raise StrategyError(f"K must be >= 1 in {text!r}")
                return cls(kind, k)
            if kind == "conf_adapt" and len(args) in (1, 2):
                tau = float(args[0])
                if not 0 < tau <= 1:
                    raise StrategyError(f"tau must be in (0, 1] in {text!r}")
                k = int(args[1]) if len(args) == 2 else 16
                if k < 1:
                    raise StrategyError(f"KMAX must be >= 1 in {text!r}")
                return cls("conf_adapt", k, tau)
        except StrategyError:
            raise
        except ValueError:
            pass
        raise StrategyError(f"malformed strategy {text!r}; {USAGE}")


def expand_sweep(text: str) -> list[Strategy]:
    """`conf_adapt:0.99,0.95,0.9` and `static:1..8` -> lists of strategies; a comma list of names too."""
    out: list[Strategy] = []
    for chunk in split_list(text):
        kind, _, rest = chunk.partition(":")
        if ".." in rest and kind in ("static", "verify"):
            lo, hi = rest.split("..", 1)
            out += [Strategy.parse(f"{kind}:{k}") for k in range(int(lo), int(hi) + 1)]
        else:
            out.append(Strategy.parse(chunk))
    return out


def split_list(text: str) -> list[str]:
    """Split on commas, letting a bare number continue the previous strategy's kind."""
    items: list[str] = []
    for piece in [p.strip() for p in text.split(",") if p.strip()]:
        if items and piece[0].isdigit():
            kind = items[-1].split(":")[0]
            items.append(f"{kind}:{piece}")
        else:
            items.append(piece)
    return items
