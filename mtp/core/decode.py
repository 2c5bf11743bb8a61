"""The one decoding loop. Every strategy, `mtp generate`, streaming, the server's continuous batching,
the pipeline and the benchmarks run `decode_step`; nothing else decodes.

A sequence carries three lists of tokens that are not yet in its KV cache:
- pending: decided tokens (the prompt, on the first pass; afterwards the tokens emitted last pass);
- drafts:  proposals to be checked by this pass (`verify` only);
- masks:   `<mtp_mask>` tokens appended to obtain guesses (mask proposer only).
One step, for a batch of sequences (ragged rows, right-padded):
  1. build each row's block: pending + drafts + masks, at positions cache_len, cache_len+1, ...
     (`verify` with mask guesses: one group of masks per possible number of accepted drafts, each
     placed and attending as if it followed that prefix; `tree:N`: the drafts are a token tree and
     the groups follow its root and likeliest nodes; see `_branch_layout`)
  2. one forward pass over the batch; logits at the last pending position and every later one
  3. accept: check the drafts against the model's own predictions (sampling.verify_drafts) ->
     a accepted drafts and the model's own token after them
  4. propose: the proposer's guesses for the tokens after that one (heads, lookup; mask logits: the
     group that followed where acceptance stopped, if one did); every row is accepted first and
     announces its drafting (`Proposer.prepare`), so rows sharing the heads draft in one batched call
  5. emit by strategy: ntp -> the model's token; static -> it + all guesses; conf_adapt -> the
     confident prefix of [it, guesses...]; verify -> accepted drafts + it, guesses become next drafts
  6. commit pending + accepted drafts to the cache (rejected drafts and masks are simply not
     committed: rollback is not advancing the length), stop on EOS / stop string / length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from mtp.core import tree
from mtp.core.cache import KVCache
from mtp.core.metrics import DecodeStats, tree_expected_tokens
from mtp.core.proposers import DraftRequest, Guesses, MaskProposer, PassView, Proposer, max_appended
from mtp.core.sampling import SamplingParams, verify_drafts
from mtp.core.strategy import Strategy


@dataclass
class Sequence:
    """One request being decoded: its strategy, sampling settings and decoding state."""
    prompt_ids: list[int]
    strategy: Strategy
    params: SamplingParams
    proposer: Proposer
    slot: int = 0  # its row in the KV cache
    eos_ids: tuple[int, ...] = ()
    decode_text: Callable[[list[int]], str] | None = None  # needed for stop strings
    output: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(drafts), V]
    draft_confidences: list[float] = field(default_factory=list)  # the drafts' confidences (Guesses.confidences)
    draft_sources: list[tuple[str, ...]] | None = None  # who drafted each draft (Guesses.sources); None = the proposer
    stats: DecodeStats = field(default_factory=DecodeStats)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    text: str | None = None  # set when a stop string cut the output
    gen: torch.Generator | None = None
    k_override: int | None = None  # a scheduler's cap on K for the next pass (mtp.serving.scheduler); None = strategy.k
    proposer_state: dict = field(default_factory=dict)  # the proposer's own per-sequence state (EAGLE-3: its KV)
    tree: list[int] | None = None  # `tree:N`: each draft's parent (-1 = root; mtp.core.tree); None = a chain
    pass_time: Callable[[float], float] | None = None  # `tree:auto`: seconds per pass of q tokens (mtp.core.costmodel)
    missed_groups: int = 0  # passes whose acceptance stopped where no mask group followed (no guesses next pass)

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("empty prompt")
        if not self.pending:
            self.pending = list(self.prompt_ids)
        if self.gen is None and self.params.seed is not None:
            self.gen = torch.Generator().manual_seed(self.params.seed)
        if self.strategy.thresholded and not self.proposer.has_confidence:
            raise ValueError(f"conf_adapt needs a proposer with confidences, not {self.proposer.name!r}")
        if self.strategy.auto and self.pass_time is None:
            raise ValueError("tree:auto needs this machine's pass times (Engine.new_sequence measures them)")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def k(self) -> int:
        """Block size for the next pass: the strategy's K, or less when a scheduler capped it."""
        k = self.strategy.k
        return k if self.k_override is None else max(1, min(k, self.k_override))

    def n_appended(self) -> int:
        """Masks appended to this pass: `groups()` groups of `group_size()`."""
        return self.proposer.n_appended(self.strategy.guess_k(self.k), len(self.drafts))

    def group_size(self) -> int:
        """Masks per group (0: the proposer appends none): k-1, a tree's at most TREE_MASK_DEPTH."""
        return self.proposer.n_appended(self.strategy.guess_k(self.k))

    def groups(self) -> int:
        """Mask groups this pass: 1, or 1 + drafts (nodes) when the proposer branches, at most MAX_MASK_GROUPS."""
        g = self.group_size()
        return self.n_appended() // g if g else 0

    def mask_anchors(self) -> list[int]:
        """The draft after which each of this pass's mask groups sits, in block order (-1: the root,
        i.e. after the pending tokens, nothing accepted). A chain of D drafts: after all D first, then
        after 0, 1, ... accepted drafts; a tree: after the root, then after its nodes by confidence
        (path probability), highest first, ties to the earlier node. E.g. D = 3 and 4 groups: chain
        [2, -1, 0, 1]; a tree with confidences [0.5, 0.2, 0.4]: [-1, 0, 2, 1]."""
        G, D = self.groups(), len(self.drafts)
        if not G:
            return []
        if not self.strategy.is_tree:
            return [D - 1] + list(range(-1, G - 2))
        conf = self.draft_confidences + [0.0] * (D - len(self.draft_confidences))
        return [-1] + sorted(range(D), key=lambda j: (-conf[j], j))[: G - 1]


def block_slack(k: int) -> int:
    """KV-cache slots a row needs beyond its committed tokens for a pass of block size k: up to k
    pending tokens, k-1 drafts and the appended masks."""
    k = max(k, 1)
    return k + (k - 1) + max_appended(k) + 1


def decode_step(model, cache: KVCache, seqs: list[Sequence], mask_id: int | None) -> list[list[int]]:
    """Advance every sequence by one forward pass; return the tokens each one emitted."""
    # 1. blocks: pending + drafts + masks, right-padded to a common length T
    blocks, starts, branched, anchors = [], [], [], []
    for s in seqs:
        if len(s.drafts) > s.k - 1:  # a capped K checks fewer drafts (still lossless; a tree keeps its top)
            s.drafts = s.drafts[: s.k - 1]
            s.draft_probs = None if s.draft_probs is None else s.draft_probs[: s.k - 1]
            s.tree = None if s.tree is None else s.tree[: s.k - 1]
            s.draft_confidences = s.draft_confidences[: s.k - 1]
            s.draft_sources = None if s.draft_sources is None else s.draft_sources[: s.k - 1]
        n_mask = s.n_appended()
        if n_mask and mask_id is None:
            raise ValueError("this strategy needs a model with the <mtp_mask> token (an adapter)")
        blocks.append(s.pending + s.drafts + [mask_id] * n_mask)
        starts.append(cache.lengths[s.slot])
        anchors.append(s.mask_anchors())
        # its own layout unless plainly causal: a tree, or mask groups beyond the one after the last draft
        branched.append((s.tree is not None and bool(s.drafts)) or len(anchors[-1]) > 1)
    B, T = len(seqs), max(len(b) for b in blocks)
    dev = model.device
    tokens = torch.zeros(B, T, dtype=torch.long)
    for i, b in enumerate(blocks):
        tokens[i, : len(b)] = torch.tensor(b)
    slots_pos = torch.tensor(starts).view(B, 1) + torch.arange(T).view(1, T)  # [B, T] cache slots written
    positions, attn_mask = slots_pos, None  # RoPE positions; None = the plain causal rule over slots
    if any(branched):
        positions, attn_mask = _branch_layout(seqs, slots_pos, branched)
    # logits needed from the last pending token on: e.g. pending=[a,b], drafts=[c], masks=[M,M]
    # -> block [a,b,c,M,M], out rows 1..4 (predictions after b, after c, and the two masks)
    first = [len(s.pending) - 1 for s in seqs]
    N = max(len(b) - f for b, f in zip(blocks, first))
    out_index = torch.tensor([[min(f + j, len(b) - 1) for j in range(N)] for b, f in zip(blocks, first)])
    slots = torch.tensor([s.slot for s in seqs])
    if slots.tolist() == list(range(B)):
        slots = None
    need_hidden = any(s.proposer.needs_hidden for s in seqs)
    aux_layers = _aux_layers(seqs)

    # 2. one forward pass (with the residual streams of `aux_layers` at every block position, if asked)
    out = model(tokens.to(dev), positions.to(dev), cache=cache, slots=None if slots is None else slots.to(dev),
                out_index=out_index.to(dev), return_hidden=need_hidden,
                attn_mask=None if attn_mask is None else attn_mask.to(dev),
                cache_positions=None if attn_mask is None else slots_pos.to(dev),
                **({"aux_layers": aux_layers} if aux_layers else {}))
    aux = None
    if aux_layers:
        logits, hidden, aux = out  # aux: [B, T, A*dim]
    else:
        logits, hidden = out if need_hidden else (out, None)
    logits = logits.float().cpu()
    finite = torch.isfinite(logits).all(-1)  # [B, N]; mask rows may be non-finite, ordinary rows never
    if mask_id is not None and mask_id < logits.shape[-1]:
        logits[..., mask_id] = float("-inf")  # the mask token is never a prediction
    if hidden is not None:
        hidden = hidden.cpu()

    rows = []  # per row: what step 3 decided and the view step 4 drafts from
    for i, s in enumerate(seqs):
        D = len(s.drafts)
        lg = logits[i]  # [N, V]: row j predicts the token after block position first+j
        if not bool(finite[i, : D + 1].all()):  # never emit from a broken pass (lossless = identical)
            raise NonFiniteError("the model produced non-finite logits (NaN/inf) at ordinary positions: its "
                                 "weights or adapter are corrupt (try --adapter none)")
        # 3. accept drafts against the model's own predictions (a tree: the path of the model's own tokens)
        if s.strategy.is_tree:
            path, own = tree.accept(lg[: D + 1], s.drafts, s.tree or list(range(-1, D - 1)), s.params, s.gen)
            a, row = len(path), (1 + path[-1] if path else 0)
            accepted = [s.drafts[j] for j in path]
        else:
            a, own = verify_drafts(lg[: D + 1], s.drafts, s.draft_probs, s.params, s.gen)
            row, path, accepted = a, None, s.drafts[:a]
        # who drafted each accepted token (a merge's parts; otherwise the proposer itself), for metrics
        drafted_by = [s.draft_sources[j] if s.draft_sources is not None else (s.proposer.name,)
                      for j in (path if path is not None else range(a))]
        expected = tree_expected_tokens(s.draft_confidences[:D]) if s.strategy.is_tree else None
        own_conf = float(torch.softmax(lg[row], -1).max())
        # 4. guesses for what follows `own`: the mask group that followed the last accepted draft (the
        # root: none accepted), if it had one; e.g. D=3 nodes, g=2, anchors [-1, 0, 2, 1] (mask_anchors):
        # acceptance stopping at node 2 reads lg rows 1+D+2g.. = 8, 9; stopping at a node without a group
        # leaves the next pass without mask guesses
        context = s.prompt_ids + s.output + accepted + [own]
        g = s.group_size()
        stop = path[-1] if path else a - 1  # the last accepted draft; -1 = the root
        has_group = stop in anchors[i]
        first_mask = D + 1 + g * (anchors[i].index(stop) if has_group else 0)
        s.missed_groups += bool(g) and not has_group
        # block positions that become the row's prefix: pending + accepted drafts (a tree: its path's
        # nodes, e.g. P=1, path [1, 4] -> rows 0, 2, 5), in order
        P = len(s.pending)
        committed = list(range(P)) + [P + j for j in path] if path else slice(0, P + a)
        view = PassView(context=context, mask_logits=lg[first_mask: first_mask + g],
                        hidden=hidden[i, row] if hidden is not None else None, masks_valid=has_group,
                        aux=aux[i, committed] if aux is not None and s.proposer.aux_layers else None,
                        start=starts[i], state=s.proposer_state)
        rows.append((a, path, accepted, own, own_conf, drafted_by, expected, view))
    # 4a. every row announces its drafting, then proposers shared by rows draft them all at once (the
    # heads: one call per depth for the batch); the rows' own calls below then return their answers
    drafting = [s.k > 1 or bool(s.proposer.aux_layers) for s in seqs]
    batchers: dict[int, Proposer] = {}
    for s, (*_, view), go in zip(seqs, rows, drafting):
        if go:
            request = DraftRequest(view, s.k - 1, True) if s.strategy.is_tree else \
                DraftRequest(view, s.k, False, s.params, s.gen)
            batchers.update((id(p), p) for p in s.proposer.prepare(request))
    for p in batchers.values():
        p.draft_prepared()

    emitted_all = []
    for i, (s, (a, path, accepted, own, own_conf, drafted_by, expected, view)) in enumerate(zip(seqs, rows)):
        # 4b. this row's guesses (a proposer with its own state, EAGLE-3, sees every pass: it must
        # follow the committed prefix)
        if s.strategy.is_tree:
            guesses = s.proposer.propose_tree(view, s.k - 1) if drafting[i] else Guesses.none()
            if s.strategy.auto and guesses.tokens:  # keep the nodes worth their rows (and their masks) here
                parents = guesses.parents or list(range(-1, len(guesses.tokens) - 1))
                appended = lambda n: s.proposer.n_appended(s.strategy.guess_k(s.k), n)  # noqa: E731
                guesses = replace(guesses, parents=parents).select(tree.keep(parents, guesses.confidences,
                                                                             s.pass_time, appended=appended))
        else:
            guesses = s.proposer.propose(view, s.k, s.params, s.gen) if drafting[i] else Guesses.none()
        guesses = finite_prefix(guesses)
        # 5. emit by strategy
        preds, confs = [own] + guesses.tokens, [own_conf] + guesses.confidences
        n = s.strategy.emit_count(confs)
        new = preds[:n]
        emitted = accepted + new
        confs_emitted = [1.0] * a + confs[:n]
        # 6. commit: pending tokens and accepted drafts now hold valid KV; the rest is dropped
        if path:  # a tree's accepted path moves into contiguous slots first
            cache.compact(s.slot, starts[i] + len(s.pending), path)
        cache.commit(s.slot, len(s.pending) + a)
        s.pending = new
        if s.strategy.verifies:
            s.drafts, s.draft_probs = guesses.tokens, guesses.probs
            s.tree = guesses.parents if s.strategy.is_tree else None
            s.draft_confidences, s.draft_sources = guesses.confidences, guesses.sources
        else:
            s.drafts, s.draft_probs, s.draft_confidences, s.draft_sources = [], None, [], None
        emitted, produced = _append_output(s, emitted)
        s.stats.record_pass(produced, confs_emitted, len(blocks[i]), drafted_by[:produced], expected)
        emitted_all.append(emitted)
    return emitted_all


class NonFiniteError(ValueError):
    """A forward pass whose logits at ordinary (non-mask) positions are NaN or inf."""


def finite_prefix(g: Guesses) -> Guesses:
    """The guesses up to the first one whose confidence or distribution is not finite: a NaN guess
    is a rejected guess (it never becomes a draft, and no block is emitted from it)."""
    n = 0
    while n < len(g.tokens) and math.isfinite(g.confidences[n]) and (
            g.probs is None or bool(torch.isfinite(g.probs[n]).all())):
        n += 1
    if n == len(g.tokens):
        return g
    return g.select(list(range(n)))  # parents precede children: still a tree


def _aux_layers(seqs: list[Sequence]) -> tuple[int, ...]:
    """The trunk layers the batch's proposers read (one set per pass: rows must agree)."""
    wanted = {tuple(s.proposer.aux_layers) for s in seqs if s.proposer.aux_layers}
    if len(wanted) > 1:
        raise ValueError(f"one pass cannot serve proposers reading different trunk layers: {sorted(wanted)}")
    return wanted.pop() if wanted else ()


def _branch_layout(seqs: list[Sequence], slots_pos: torch.Tensor, branched: list[bool]):
    """RoPE positions [B, T] and attention [B, T, S] for the rows flagged in `branched` (a token tree,
    or mask groups that branch); the other rows keep the plain causal rule over their slots.

    A flagged row's block is pending (P) + drafts (D) + one group of g masks after each of its
    `Sequence.mask_anchors()`, laid out by `mtp.core.tree.apply_layout` as one tree: the drafts with
    their parents (a chain: [-1, 0, 1, ...]) and every group as a chain of g more nodes under its
    anchor (`tree.with_groups`). Every row is written to its own cache slot (`slots_pos`), but a node
    takes the RoPE position that follows its parent and sees only the prefix, its ancestors and
    itself. E.g. a chain, P=1, D=2, g=2 at cache length c, anchors [1, -1, 0] (x = pending, d = drafts,
    m = masks):
        block  x   d1  d2  m   m   m   m   m   m
        RoPE   c   c+1 c+2 c+3 c+4 c+1 c+2 c+2 c+3
        group              [ D=2 ] [a=0  ] [a=1  ]     a=1's masks see slots 0..c+1 and their group."""
    B, T = slots_pos.shape
    S = int(slots_pos.max()) + 1
    slot = torch.arange(S)
    positions = slots_pos.clone()
    attn = slot.view(1, 1, S) <= slots_pos.unsqueeze(-1)  # [B, T, S] causal over slots
    for i, s in enumerate(seqs):
        if not branched[i]:
            continue
        D = len(s.drafts)
        parents = s.tree if s.tree is not None else list(range(-1, D - 1))
        nodes = tree.with_groups(parents, s.mask_anchors(), s.group_size())
        tree.apply_layout(positions, attn, i, int(slots_pos[i, 0]), len(s.pending), nodes)
    return positions, attn


def _append_output(s: Sequence, tokens: list[int]) -> tuple[list[int], int]:
    """Add tokens to the output, stopping exactly at EOS, a stop string or max_new_tokens.

    Returns (tokens delivered, tokens the pass produced: the delivered ones plus an EOS it hit)."""
    room = s.params.max_new_tokens - len(s.output)
    tokens = tokens[:room]
    produced = len(tokens)
    for j, t in enumerate(tokens):
        if t in s.eos_ids:
            tokens = tokens[:j]
            produced = j + 1
            s.finish_reason = "stop"
            break
    s.output.extend(tokens)
    if s.params.stop and s.decode_text is not None and tokens:
        text = s.decode_text(s.output)
        hits = [text.find(x) for x in s.params.stop if x and x in text]
        if hits:
            cut = min(hits)
            s.text = text[:cut]
            keep = len(s.output)
            while keep > 0 and len(s.decode_text(s.output[:keep])) > cut:
                keep -= 1
            dropped = len(s.output) - keep
            del s.output[keep:]
            tokens = tokens[: max(0, len(tokens) - dropped)]
            s.finish_reason = "stop"
    if not s.finished and len(s.output) >= s.params.max_new_tokens:
        s.finish_reason = "length"
    return tokens, produced


def stream(model, seq: Sequence, mask_id: int | None, cache: KVCache | None = None) -> Iterator[list[int]]:
    """Decode one sequence to the end, yielding the tokens of each forward pass as they come."""
    if cache is None:
        cache = KVCache.for_model(model, 1, len(seq.prompt_ids) + seq.params.max_new_tokens
                                  + block_slack(seq.strategy.k))
        seq.slot = 0
    cache.reset(seq.slot)
    seq.stats = DecodeStats()
    with torch.inference_mode():
        while not seq.finished:
            yield decode_step(model, cache, [seq], mask_id)[0]


def generate(model, prompt_ids: list[int], strategy: Strategy | str = "ntp", params: SamplingParams | None = None,
             proposer: Proposer | None = None, mask_id: int | None = None, eos_ids=(), decode_text=None) -> Sequence:
    """Decode one prompt to the end and return the finished Sequence (output, stats, finish reason)."""
    strategy = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
    seq = Sequence(list(prompt_ids), strategy, params or SamplingParams(), proposer or MaskProposer(),
                   eos_ids=tuple(eos_ids), decode_text=decode_text)
    for _ in stream(model, seq, mask_id if mask_id is not None else model.config.mask_token_id):
        pass
    return seq
