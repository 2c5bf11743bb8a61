"""The proposer registry: every source of proposals, by the name users pass to `--proposer`.

Adding a proposer touches one new file (a `Proposer` subclass, `mtp.core.decoding.proposers.base`) and one
line here. A `ProposerSpec` says how to make the proposer for an engine and what it needs:
`asset` names the directory kind it loads (shipped per model under `mtp/assets/<model>/<asset>`,
or given by the user, e.g. `--heads DIR`), `needs_mask_token` that it proposes through the
`<mtp_mask>` token of an MTP adapter.

The default `--proposer` of `mtp generate` / `mtp serve` is `auto` (`resolve_default`): for a model that
ships its drafters (`SHIPPED_DEFAULT`) the merge that measured fastest on its diverse prompts, else `mask`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mtp.core.decoding.proposers.base import MAX_MASK_GROUPS, DraftRequest, Guesses, PassView, Proposer, max_appended
from mtp.core.decoding.proposers.eagle3 import load_eagle3_proposer
from mtp.core.decoding.proposers.heads import load_heads_proposer
from mtp.core.decoding.proposers.lookup import PromptLookupProposer
from mtp.core.decoding.proposers.mask import MaskProposer
from mtp.core.decoding.proposers.merged import MergedProposer
from mtp.core.decoding.proposers.suffix import load_suffix_proposer

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
    "AUTO",
    "SHIPPED_DEFAULT",
    "resolve_default",
]


@dataclass(frozen=True)
class ProposerSpec:
    make: Callable[..., Proposer] | None  # () -> Proposer, or (model, asset_dir) -> Proposer when `asset` is set
    asset: str | None = None  # the directory kind it loads ("heads"): loaded once per engine
    needs_mask_token: bool = False
    parts: tuple[str, ...] = ()  # a merged proposer `a+b+c` (mtp.core.decoding.proposers.merged): its registered parts


REGISTRY: dict[str, ProposerSpec] = {
    "mask": ProposerSpec(MaskProposer, needs_mask_token=True),
    "mask-single": ProposerSpec(lambda: MaskProposer(branch=False), needs_mask_token=True),
    "lookup": ProposerSpec(PromptLookupProposer),
    "heads": ProposerSpec(load_heads_proposer, asset="heads"),
    "eagle3": ProposerSpec(load_eagle3_proposer, asset="eagle3"),
    "suffix": ProposerSpec(load_suffix_proposer, asset="datastore"),
}


AUTO = "auto"  # `--proposer auto`: SHIPPED_DEFAULT's merge for a model that ships its drafters, else FALLBACK
FALLBACK = "mask"
# per shipped model, the merge that measured fastest on the diverse held-out prompts (issue 50; greedy, every
# output identical to ntp; benchmarks/RESULTS.md section 1, 128 tokens, native-int8, 2 threads):
# tree:auto@heads+suffix+lookup 183.8 tokens/s (2.13 tokens/pass), tree:auto@eagle3+suffix+lookup 165.6
# (2.35): EAGLE-3's 10 % more tokens per pass do not pay for its drafting on a 2-core CPU
SHIPPED_DEFAULT = {"smollm2-135m": "heads+suffix+lookup"}


def resolve_default(name: str, model: str, off: tuple[str, ...] = ()) -> str:
    """`name` itself, or for `auto` the model's shipped default merge (SHIPPED_DEFAULT; FALLBACK for any
    other model) less the parts whose asset kind the user turned off (`off`, e.g. ("eagle3",) for
    `--eagle3 none`)."""
    if name != AUTO:
        return name
    merge = SHIPPED_DEFAULT.get(model)
    if merge is None:
        return FALLBACK
    parts = [p for p in merge.split("+") if REGISTRY[p].asset not in off]
    return "+".join(parts) if parts else FALLBACK


def check_proposer(name: str) -> ProposerSpec:
    """The spec of proposer `name` (or of a merge `a+b`), else a ValueError listing the names."""
    if "+" in name:
        parts = tuple(p.strip() for p in name.split("+"))
        if any(not p for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"malformed proposer merge {name!r}; e.g. heads+suffix+lookup (each part once)")
        specs = [check_proposer(p) for p in parts]
        bad = [p for p, s in zip(parts, specs) if s.needs_mask_token]
        if bad:  # mask groups follow one proposer's drafts (mtp.core.decoding.proposers.merged)
            raise ValueError(f"proposer {bad[0]!r} cannot be merged; merge heads, eagle3, suffix and lookup")
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
