"""The configurations `mtp tune` considers: lossless ones (`verify:K`, `tree:N`, always within any
tolerance) and lossy ones (`conf_adapt:TAU:K`, `static:K`), each with the proposer it drafts from.

The default list covers every proposer the engine can load (the shipped heads, mask adapter, EAGLE-3
drafter and suffix datastore for the default model); `--candidates` replaces it with a list in
`mtp bench --strategies` form (`verify:4@heads,conf_adapt:0.95:4@mask`). Lossy candidates come in
families ordered from the least to the most lossy (a higher τ first, a smaller static K first): once
one member exceeds the tolerance, the lossier members are not run.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtp.core.decoding.strategy import Strategy, split_list
from mtp.core.policy.deploy import Arm

LOSSLESS = (
    "verify:3@heads",
    "verify:4@heads",
    "tree:8@heads",
    "tree:16@heads",
    "tree:auto@heads",
    "tree:8@heads+suffix+lookup",
    "tree:16@heads+suffix+lookup",
    "tree:auto@heads+suffix+lookup",
    "tree:8@suffix",
    "verify:3@lookup",
    "verify:4@eagle3",
    "verify:4@mask",
)
LOSSY = (
    "conf_adapt:0.95:4@heads",
    "conf_adapt:0.9:4@heads",
    "conf_adapt:0.8:4@heads",
    "conf_adapt:0.95:4@mask",
    "conf_adapt:0.9:4@mask",
    "conf_adapt:0.8:4@mask",
    "static:2@heads",
    "static:2@mask",
)


@dataclass(frozen=True)
class Candidate:
    arm: Arm

    @property
    def strategy(self) -> Strategy:
        return self.arm.strategy

    @property
    def proposer(self) -> str:
        return self.arm.proposer

    @property
    def lossless(self) -> bool:
        return self.arm.strategy.lossless

    @property
    def family(self) -> tuple:
        """Lossy members of one family differ only in how much they risk (τ, or static's K)."""
        s = self.strategy
        return (s.kind, self.proposer, s.k if s.kind == "conf_adapt" else None)

    @property
    def risk(self) -> float:
        """Order within a family: larger is lossier."""
        s = self.strategy
        return 1 - s.tau if s.kind == "conf_adapt" else float(s.k)

    def __str__(self) -> str:
        return str(self.arm)


def parse(text: str, default_proposer: str = "mask") -> list[Candidate]:
    """`STRATEGY@PROPOSER` items, comma-separated; `ntp` is never a candidate (it is the reference)."""
    out, seen = [], set()
    for piece in split_list(text):
        strategy, _, proposer = piece.partition("@")
        arm = Arm.parse({"strategy": strategy.strip(), "proposer": proposer.strip() or default_proposer}, "candidate")
        if arm.strategy.plain or str(arm) in seen:
            continue
        seen.add(str(arm))
        out.append(Candidate(arm))
    if not out:
        raise ValueError(f"--candidates {text!r} names no candidate besides ntp")
    return out


def defaults() -> list[Candidate]:
    return parse(",".join(LOSSLESS + LOSSY))


def loadable(engine, candidates: list[Candidate]) -> tuple[list[Candidate], dict[str, str]]:
    """The candidates whose proposer this engine can build, and why the others cannot (name -> reason)."""
    ok, why = [], {}
    for c in candidates:
        if c.proposer in why:
            continue
        try:
            if not engine.can_propose(c.proposer):
                raise ValueError("needs an MTP adapter (--adapter)")
            proposer = engine.proposer(c.proposer)
        except (ValueError, FileNotFoundError, OSError) as e:
            why[c.proposer] = str(e).splitlines()[0]
            continue
        if c.strategy.thresholded and not proposer.has_confidence:
            why[str(c)] = f"conf_adapt needs a proposer with confidences, not {c.proposer!r}"
            continue
        ok.append(c)
    return ok, why
