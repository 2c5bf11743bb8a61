"""The mask proposer: the self-distilled model's own guesses from appended `<mtp_mask>` tokens."""
from __future__ import annotations

import torch

from mtp.core.proposers.base import MAX_MASK_GROUPS, Guesses, PassView, Proposer
from mtp.core.sampling import pick


class MaskProposer(Proposer):
    """The self-distilled model's own guesses: k-1 `<mtp_mask>` tokens appended to each pass.

    Under `verify` the masks must follow the prefix that survives verification, unknown before the
    pass. With `branch` (the default) the pass carries one group of k-1 masks after each possible
    accepted prefix (after the pending token, after draft 1, ..., after the last draft), each group
    attending only to its prefix (mtp.core.decode builds the layout), so the next pass always has drafts.
    Without it (`mask-single`), masks follow the last draft only and every rejection leaves the
    next pass without drafts. The price is (k-1)·D more rows a pass, cheap where a pass is
    latency-bound (pipelines, GPUs).
    At most MAX_MASK_GROUPS groups: the extra ones go after 0, 1, ... accepted drafts, the likeliest."""
    name = "mask"

    def __init__(self, branch: bool = True):
        self.branch = branch
        self.name = "mask" if branch else "mask-single"  # `--proposer mask-single`: no branching

    def n_appended(self, k: int, drafts: int = 0) -> int:
        if k <= 1:
            return 0
        return (k - 1) * (1 + (min(drafts, MAX_MASK_GROUPS - 1) if self.branch else 0))

    def propose(self, view: PassView, k: int, params, gen) -> Guesses:
        if k <= 1 or not view.masks_valid or view.mask_logits.shape[0] == 0:
            return Guesses.none()
        logits = view.mask_logits[: k - 1]  # [k-1, V]
        # a NaN mask row is no guess (nor any after it); -inf is fine (the mask token's own column)
        bad = (torch.isnan(logits) | torch.isposinf(logits)).any(-1).nonzero()
        if len(bad):
            logits = logits[: int(bad[0])]
            if logits.shape[0] == 0:
                return Guesses.none()
        tokens, probs = pick(logits, params, gen)
        conf = torch.softmax(logits.float(), -1).amax(-1)
        return Guesses(tokens.tolist(), conf.tolist(), probs)
