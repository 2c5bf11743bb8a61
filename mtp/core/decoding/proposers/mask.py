"""The mask proposer: the self-distilled model's own guesses from appended `<mtp_mask>` tokens."""

from __future__ import annotations

import torch

from mtp.core.decoding import tree
from mtp.core.decoding.proposers.base import MAX_MASK_GROUPS, DraftRequest, Guesses, PassView, Proposer
from mtp.core.decoding.sampling import pick


class MaskProposer(Proposer):
    """The self-distilled model's own guesses: k-1 `<mtp_mask>` tokens appended to each pass.

    Under `verify` the masks must follow the prefix that survives verification, unknown before the
    pass. With `branch` (the default) the pass carries one group of k-1 masks after each possible
    accepted prefix (after the pending token, after draft 1, ..., after the last draft), each group
    attending only to its prefix (mtp.core.decoding.decode builds the layout), so the next pass always has drafts.
    Without it (`mask-single`), masks follow the last draft only and every rejection leaves the
    next pass without drafts. The price is (k-1)·D more rows a pass, cheap where a pass is
    latency-bound (pipelines, GPUs).
    At most MAX_MASK_GROUPS groups: the extra ones go after 0, 1, ... accepted drafts, the likeliest.

    Under `tree:N` (a tree request) a group holds g = min(N, TREE_MASK_DEPTH) masks (the decoding loop
    asks `n_appended` with `Strategy.guess_k`), one distribution per depth, and the groups follow the
    root and the likeliest nodes (mtp.core.decoding.decode: Sequence.mask_anchors); `mask-single` keeps the
    root's group only."""

    name = "mask"

    def __init__(self, branch: bool = True):
        self.branch = branch
        self.name = "mask" if branch else "mask-single"  # `--proposer mask-single`: no branching

    def n_appended(self, k: int, drafts: int = 0) -> int:
        """Groups of k-1 masks: one, or with `branch` one more per draft (a tree: per node) up to
        MAX_MASK_GROUPS."""
        if k <= 1:
            return 0
        return (k - 1) * (1 + (min(drafts, MAX_MASK_GROUPS - 1) if self.branch else 0))

    def propose(self, request: DraftRequest) -> Guesses:
        """A chain: one guess per mask row, picked under the request's sampling; or a tree (`_tree`)."""
        if request.tree:
            return self._tree(request.view, request.n)
        logits = _guess_rows(request.view, request.n)  # [<= n, V]
        if logits is None:
            return Guesses.none()
        tokens, probs = pick(logits, request.params, request.gen)
        conf = torch.softmax(logits.float(), -1).amax(-1)
        return Guesses(tokens.tolist(), conf.tolist(), probs)

    def _tree(self, view: PassView, n: int) -> Guesses:
        """At most n nodes over the depths the group's masks guess (row d-1: the token d places after
        the model's own), grown by the heads' builder (mtp.core.decoding.tree.grow): under every frontier node
        the top tokens of the next depth's distribution, kept by path probability (the product of the
        depths' probabilities of the path's tokens: the masks see the prefix only, not the path).
        Confidences are those path probabilities (what `tree:auto` and `mtp tune` read). Deterministic."""
        logits = _guess_rows(view, view.mask_logits.shape[0])  # [g, V]
        if n <= 0 or logits is None:
            return Guesses.none()
        per_depth = iter(torch.log_softmax(logits.float(), -1))  # g rows of [V]

        def expand(rows: list[int], tokens: list[int]) -> torch.Tensor:
            return next(per_depth).expand(len(rows), -1)  # [F, V]: the same distribution under every node

        tokens, parents, confs = tree.grow(n, logits.shape[0], expand, view.context[-1])
        return Guesses(tokens, confs, None, parents)


def _guess_rows(view: PassView, m: int) -> torch.Tensor | None:
    """The first m mask rows of logits [<= m, V] up to the first broken one, or None when there are none
    (no masks, or masks that followed a rejected draft or a node without a group)."""
    if m <= 0 or not view.masks_valid or view.mask_logits.shape[0] == 0:
        return None
    logits = view.mask_logits[:m]  # [m, V]
    # a NaN mask row is no guess (nor any after it); -inf is fine (the mask token's own column)
    bad = (torch.isnan(logits) | torch.isposinf(logits)).any(-1).nonzero()
    if len(bad):
        logits = logits[: int(bad[0])]
    return logits if logits.shape[0] else None
