"""The proposer registry: every source of proposals, by the name users pass to `--proposer`.

Adding a proposer touches one new file (a `Proposer` subclass, `mtp.core.proposers.base`) and one
line here. A `ProposerSpec` says how to make the proposer for an engine and what it needs:
`asset` names the directory kind it loads (shipped per model under `mtp/assets/<model>/<asset>`,
or given by the user, e.g. `--heads DIR`), `needs_mask_token` that it proposes through the
`<mtp_mask>` token of an MTP adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mtp.core.proposers.base import MAX_MASK_GROUPS, DraftRequest, Guesses, PassView, Proposer, max_appended
from mtp.core.proposers.eagle3 import load_eagle3_proposer
from mtp.core.proposers.heads import load_heads_proposer
from mtp.core.proposers.lookup import PromptLookupProposer
from mtp.core.proposers.mask import MaskProposer
from mtp.core.proposers.merged import MergedProposer
from mtp.core.proposers.suffix import load_suffix_proposer

__all__ = [
    "MAX_MASK_GROUPS",
    "DraftRequest",
    "Guesses",
    "PassView",
    "Proposer",
    "max_appended",
    "MaskProposer",
    "MergedProposer",
    "PromptLookupProposer",
    "ProposerSpec",
    "REGISTRY",
    "check_proposer",
    "make_proposer",
]


@dataclass(frozen=True)
class ProposerSpec:
    make: Callable[..., Proposer] | None  # () -> Proposer, or (model, asset_dir) -> Proposer when `asset` is set
    asset: str | None = None  # the directory kind it loads ("heads"): loaded once per engine
    needs_mask_token: bool = False
    parts: tuple[str, ...] = ()  # a merged proposer `a+b+c` (mtp.core.proposers.merged): its registered parts


REGISTRY: dict[str, ProposerSpec] = {
    "mask": ProposerSpec(MaskProposer, needs_mask_token=True),
    "mask-single": ProposerSpec(lambda: MaskProposer(branch=False), needs_mask_token=True),
    "lookup": ProposerSpec(PromptLookupProposer),
    "heads": ProposerSpec(load_heads_proposer, asset="heads"),
    "eagle3": ProposerSpec(load_eagle3_proposer, asset="eagle3"),
    "suffix": ProposerSpec(load_suffix_proposer, asset="datastore"),
}


def check_proposer(name: str) -> ProposerSpec:
    """The spec of proposer `name` (or of a merge `a+b`), else a ValueError listing the names."""
    if "+" in name:
        parts = tuple(p.strip() for p in name.split("+"))
        if any(not p for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"malformed proposer merge {name!r}; e.g. heads+suffix+lookup (each part once)")
        specs = [check_proposer(p) for p in parts]
        bad = [p for p, s in zip(parts, specs) if s.needs_mask_token or p == "eagle3"]
        if bad:
            raise ValueError(f"proposer {bad[0]!r} cannot be merged; merge heads, suffix and lookup")
        return ProposerSpec(None, parts=parts)
    if name not in REGISTRY:
        raise ValueError(f"unknown proposer {name!r}; choose from {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def make_proposer(name: str, **kwargs) -> Proposer:
    """A proposer that needs no asset (mask, mask-single, lookup)."""
    spec = check_proposer(name)
    if spec.parts:
        return MergedProposer([make_proposer(p) for p in spec.parts])
    if spec.asset is not None:
        raise ValueError(f"proposer {name!r} loads a {spec.asset} directory: use an Engine loaded with it")
    return spec.make(**kwargs)
