"""The one decoding loop. Every strategy, `mtp generate`, streaming, the server's continuous batching,
the pipeline and the benchmarks run `decode_step`; nothing else decodes.

A sequence carries three lists of tokens that are not yet in its KV cache:
- pending: decided tokens (the prompt, on the first pass; afterwards the tokens emitted last pass);
- drafts:  proposals to be checked by this pass (`verify` only): a `Guesses`, tokens with their tree
           (a chain being the tree `tree.chain(n)`), confidences, distributions and who drafted each;
- masks:   `<mtp_mask>` tokens appended to obtain guesses (mask proposer only).
One step, for a batch of sequences (ragged rows, right-padded):
  1. build each row's block: pending + drafts + masks, at positions cache_len, cache_len+1, ...
     (`verify` with mask guesses: one group of masks per possible number of accepted drafts, each
     placed and attending as if it followed that prefix; `tree:N`: the drafts are a token tree and
     the groups follow its root and likeliest nodes; see `_branch_layout`)
  2. one forward pass over the batch; logits at the last pending position and every later one
  3. accept: check the drafts against the model's own predictions (sampling.verify_drafts) ->
     a accepted drafts and the model's own token after them (a draft is accepted iff it equals the
     model's own token there, sampled as plain decoding samples it: lossless strategies emit ntp's
     tokens, draw for draw under a seed)
  4. propose: the proposer's guesses for the tokens after that one (heads, lookup; mask logits: the
     group that followed where acceptance stopped, if one did), one `DraftRequest` per row (K - 1
     guesses, a tree or a chain); every row is accepted first and announces its request
     (`Proposer.prepare`), so rows sharing the heads draft in one batched call; the loop times the
     proposing into the row's stats (`DecodeStats.proposing_s`, `guesses`)
  5. emit by strategy: ntp -> the model's token; static -> it + all guesses; conf_adapt -> the
     confident prefix of [it, guesses...]; verify -> accepted drafts + it, guesses become next drafts
  6. commit pending + accepted drafts to the cache (rejected drafts and masks are simply not
     committed: rollback is not advancing the length), stop on EOS / stop string / length.

Log-probabilities, opt-in per sequence (`Sequence.logprobs`: None records nothing and changes nothing):
every emitted token's log-probability and its top N under the model's raw logits (log-softmax at
temperature 1, before top-k/top-p: vLLM's "raw logprobs"), read from the pass that verified it (an
accepted draft: the row that predicted it; the model's own token: the row after the accepted ones),
kept in step with the output in `Sequence.token_logprobs`. Lossless strategies only: a lossy one emits
guesses no pass verified. `Sequence.prompt_logprobs` also reads every prompt position of the prefill
pass (`Sequence.prompt_token_logprobs`: the prompt's tokens from the second on).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import torch

from mtp.core.decoding import tree
from mtp.core.decoding.metrics import DecodeStats, tree_expected_tokens
from mtp.core.decoding.proposers import DraftRequest, Guesses, MaskProposer, PassView, Proposer, max_appended
from mtp.core.decoding.sampling import SamplingParams, verify_drafts
from mtp.core.decoding.strategy import Strategy
from mtp.core.runtime.cache import KVCache


class TokenLogprob(NamedTuple):
    """One token's log-probability under the model, with the top N of the same distribution."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, log-probability), likeliest first


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """[R, V] logits and the R tokens read at them -> each token's log-softmax value and the top `top`."""
    lp = torch.log_softmax(logits.float(), -1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long).view(-1, 1)).squeeze(1).tolist()
    if top > 0:
        values, ids = lp.topk(min(top, lp.shape[-1]), -1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, c, k) for t, c, k in zip(tokens, chosen, tops)]


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
    drafts: Guesses = field(default_factory=Guesses.none)  # what the next pass checks (see the module docstring)
    stats: DecodeStats = field(default_factory=DecodeStats)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    text: str | None = None  # set when a stop string cut the output
    gen: torch.Generator | None = None
    k_override: int | None = None  # a scheduler's cap on K for the next pass (mtp.serving.scheduler); None = strategy.k
    proposer_state: dict = field(default_factory=dict)  # the proposer's own per-sequence state (EAGLE-3: its KV)
    pass_time: Callable[[float], float] | None = None  # `tree:auto`: seconds per pass of q tokens (costmodel)
    missed_groups: int = 0  # passes whose acceptance stopped where no mask group followed (no guesses next pass)
    tree_trust: list = field(default_factory=list)  # a tree row's [promised, accepted] per depth (tree.trusted)
    logprobs: int | None = None  # record each output token's log-probability and top N (None: nothing recorded)
    prompt_logprobs: bool = False  # with `logprobs`: the prompt tokens' too, from the prefill pass
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, in step with it
    prompt_token_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 2.. (set by prefill)

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("empty prompt")
        if self.logprobs is not None and (self.logprobs < 0 or not self.strategy.lossless):
            raise ValueError(
                f"log-probabilities need a lossless strategy (ntp, verify, tree) and N >= 0, not {self.strategy} "
                f"with N = {self.logprobs}: a lossy strategy emits guesses no pass verified"
            )
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

    def bookkeeping_s(self, recent: int = 8) -> float:
        """Seconds a pass of this row spends outside its forward pass (`DecodeStats.phase_s`, summed), the
        mean of its last `recent` passes (0 before its first): what `tree:auto` adds to t(q) when it prices
        a tree, since every pass pays it whatever the tree's size."""
        last = self.stats.phase_s[-recent:]
        return sum(map(sum, last)) / len(last) if last else 0.0

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
            return [D - 1] + tree.chain(G - 1)
        conf = self.drafts.confidences + [0.0] * (D - len(self.drafts.confidences))
        return [-1] + sorted(range(D), key=lambda j: (-conf[j], j))[: G - 1]


def block_slack(k: int) -> int:
    """KV-cache slots a row needs beyond its committed tokens for a pass of block size k: up to k
    pending tokens, k-1 drafts and the appended masks."""
    k = max(k, 1)
    return k + (k - 1) + max_appended(k) + 1


def decode_step(model, cache: KVCache, seqs: list[Sequence], mask_id: int | None) -> list[list[int]]:
    """Advance every sequence by one forward pass; return the tokens each one emitted. The module
    docstring's steps, phase by phase:
      1. `_blocks`: every row's block (pending + drafts + masks) and the batch's layout;
      2. `_forward`: one forward pass over the batch;
      3. `_accept`: every row's drafts checked against the model's own predictions;
      4. `_draft`: every row's guesses for what follows, timed (rows sharing a proposer draft together);
      5-6. `_commit`: per row, emit by strategy, commit to the cache, record the pass."""
    t0 = time.perf_counter()
    batch = _blocks(seqs, cache, mask_id)
    t1 = time.perf_counter()
    out = _forward(model, cache, seqs, batch, mask_id)
    t2 = time.perf_counter()
    for s, scored in zip(seqs, out.prompt or ()):
        if scored is not None:
            s.prompt_token_logprobs = scored
    accepted = [_accept(s, i, batch, out) for i, s in enumerate(seqs)]
    t3 = time.perf_counter()
    drafted = _draft(seqs, [a.view for a in accepted])
    t4 = time.perf_counter()
    emitted = [
        _commit(s, cache, batch.starts[i], len(batch.blocks[i]), a, d)
        for i, (s, a, d) in enumerate(zip(seqs, accepted, drafted))
    ]
    t5 = time.perf_counter()
    phases = (t1 - t0, t3 - t2, t4 - t3, t5 - t4)  # layout, accept, draft, commit (metrics.PHASES)
    for s in seqs:
        s.stats.phase_s.append(phases)
    return emitted


@dataclass
class _Batch:
    """A pass as `_blocks` lays it out: B rows, blocks right-padded to T tokens, logits read at N
    positions per row."""

    blocks: list[list[int]]  # per row: pending + drafts + masks
    starts: list[int]  # per row: its cache length before the pass
    anchors: list[list[int]]  # per row: Sequence.mask_anchors()
    tokens: torch.Tensor  # [B, T] the blocks
    slots_pos: torch.Tensor  # [B, T] cache slots written
    positions: torch.Tensor  # [B, T] RoPE positions
    attn_mask: torch.Tensor | None  # [B, T, S] who sees what; None = the plain causal rule over slots
    out_index: torch.Tensor  # [B, N] block positions whose logits are read: the last pending one on
    slots: torch.Tensor | None  # [B] the rows' cache rows; None = rows 0..B-1
    lead: list[int] | None = None  # per row, prompt positions scored before those (`prompt_logprobs`); None = none


def _blocks(seqs: list[Sequence], cache: KVCache, mask_id: int | None) -> _Batch:
    """Phase 1: every row's block, pending + drafts + masks at positions cache_len, cache_len+1, ...
    (drafts beyond a capped K dropped first: still lossless, a tree keeps its top), and the layout of
    the rows that are not plainly causal (a tree, or mask groups beyond the one after the last draft:
    `_branch_layout`). Raises ValueError when a row appends masks and the model has no mask token."""
    blocks, starts, branched, anchors = [], [], [], []
    for s in seqs:
        if len(s.drafts) > s.k - 1:
            s.drafts = s.drafts.prefix(s.k - 1)
        n_mask = s.n_appended()
        if n_mask and mask_id is None:
            raise ValueError("this strategy needs a model with the <mtp_mask> token (an adapter)")
        blocks.append(s.pending + s.drafts.tokens + [mask_id] * n_mask)
        starts.append(cache.lengths[s.slot])
        anchors.append(s.mask_anchors())
        branched.append((s.strategy.is_tree and bool(s.drafts)) or len(anchors[-1]) > 1)
    B, T = len(seqs), max(len(b) for b in blocks)
    tokens = torch.tensor([b + [0] * (T - len(b)) for b in blocks])  # [B, T] right-padded
    slots_pos = torch.tensor([list(range(c, c + T)) for c in starts])  # [B, T]
    positions, attn_mask = slots_pos, None
    if any(branched):
        positions, attn_mask = _branch_layout(seqs, slots_pos, branched)
    # logits needed from the last pending token on: e.g. pending=[a,b], drafts=[c], masks=[M,M]
    # -> block [a,b,c,M,M], out rows 1..4 (predictions after b, after c, and the two masks)
    first = [len(s.pending) - 1 for s in seqs]
    N = max(len(b) - f for b, f in zip(blocks, first))
    out_index = torch.tensor([[min(f + j, len(b) - 1) for j in range(N)] for b, f in zip(blocks, first)])
    # a row scoring its prompt (prefill, `prompt_logprobs`) also reads positions 0..P-2 first: max(lead)
    # columns in front (shorter rows repeat a position), which `_forward` splits off
    lead = [len(s.pending) - 1 if s.prompt_logprobs and s.stats.forward_passes == 0 else 0 for s in seqs]
    if any(lead):
        front = torch.tensor([[min(j, max(n - 1, 0)) for j in range(max(lead))] for n in lead])
        out_index = torch.cat([front, out_index], 1)
    slots = [s.slot for s in seqs]
    return _Batch(
        blocks,
        starts,
        anchors,
        tokens,
        slots_pos,
        positions,
        attn_mask,
        out_index,
        None if slots == list(range(B)) else torch.tensor(slots),
        lead if any(lead) else None,
    )


@dataclass
class _Output:
    """What `_forward` read from the pass."""

    logits: torch.Tensor  # [B, N, V] float32 on the CPU; row j predicts the token after block position first+j
    hidden: torch.Tensor | None  # [B, N, dim] on the CPU, the last layer's states at the same positions
    aux: torch.Tensor | None  # [B, T, A*dim] residual streams of the trunk layers the proposers read
    prompt: list[list[TokenLogprob] | None] | None = None  # per row scoring its prompt: tokens 2.. (else None)


def _forward(model, cache: KVCache, seqs: list[Sequence], batch: _Batch, mask_id: int | None) -> _Output:
    """Phase 2: one forward pass over the batch, writing its keys and values to the cache (with the
    hidden states if a proposer needs them, and the residual streams of the layers they read). The
    mask token's logit is -inf (it is never a prediction). Raises NonFiniteError when the logits of a
    row's ordinary positions (pending and drafts; mask rows may be non-finite) are NaN or inf: a
    broken pass never emits (lossless = identical)."""
    dev = model.device
    need_hidden = any(s.proposer.needs_hidden for s in seqs)
    aux_layers = _aux_layers(seqs)
    to_dev = lambda t: None if t is None else t.to(dev)  # noqa: E731
    out = model(
        to_dev(batch.tokens),
        to_dev(batch.positions),
        cache=cache,
        slots=to_dev(batch.slots),
        out_index=to_dev(batch.out_index),
        return_hidden=need_hidden,
        attn_mask=to_dev(batch.attn_mask),
        cache_positions=None if batch.attn_mask is None else to_dev(batch.slots_pos),
        **({"aux_layers": aux_layers} if aux_layers else {}),
    )
    aux = None
    if aux_layers:
        logits, hidden, aux = out
    else:
        logits, hidden = out if need_hidden else (out, None)
    logits = logits.float().cpu()
    prompt = None
    if batch.lead is not None:  # the prompt positions read in front: scored here, split off
        L = max(batch.lead)
        head, logits = logits[:, :L], logits[:, L:]
        hidden = None if hidden is None else hidden[:, L:]
        prompt = [
            _score_prompt(s, head[i, :n], mask_id) if n else None for i, (s, n) in enumerate(zip(seqs, batch.lead))
        ]
    finite = torch.isfinite(logits.sum(-1))  # [B, N]: a NaN or an inf anywhere in a row's logits makes its sum one
    if any(not bool(finite[i, : len(s.drafts) + 1].all()) for i, s in enumerate(seqs)):
        raise NonFiniteError(
            "the model produced non-finite logits (NaN/inf) at ordinary positions: its "
            "weights or adapter are corrupt (try --adapter none)"
        )
    if mask_id is not None and mask_id < logits.shape[-1]:
        logits[..., mask_id] = float("-inf")
    return _Output(logits, None if hidden is None else hidden.cpu(), aux, prompt)


def _score_prompt(s: Sequence, logits: torch.Tensor, mask_id: int | None) -> list[TokenLogprob]:
    """The prompt's tokens 2..P under the prefill's logits at positions 0..P-2 (the mask token, never
    a prediction, at -inf). Raises NonFiniteError on NaN / inf: a broken pass never scores."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteError("the model produced non-finite logits (NaN/inf) on the prompt: its weights are corrupt")
    if mask_id is not None and mask_id < logits.shape[-1]:
        logits = logits.clone()
        logits[..., mask_id] = float("-inf")
    return token_logprobs(logits, s.pending[1 : 1 + logits.shape[0]], s.logprobs or 0)


@dataclass
class _Accepted:
    """What `_accept` decided for one row, and the view its proposer drafts from."""

    n: int  # drafts accepted
    path: list[int] | None  # a tree's accepted nodes, root first (None: a chain, its first n drafts)
    tokens: list[int]  # the accepted drafts
    own: int  # the model's own token after them
    own_conf: float  # its top-1 probability
    drafted_by: list[tuple[str, ...]]  # who drafted each accepted draft (a merge's parts, else the proposer)
    expected: float | None  # a tree row: the tokens its drafts promised (tree_expected_tokens)
    view: PassView
    logprobs: list[TokenLogprob] | None = None  # `Sequence.logprobs`: the accepted drafts' and the own token's


def _accept(s: Sequence, i: int, batch: _Batch, out: _Output) -> _Accepted:
    """Phase 3, row i: its drafts checked against the model's own predictions (`verify_drafts`, a
    chain; a tree: `tree.accept`, the path of the model's own tokens; both accept a draft iff it equals
    the model's own token at its position, drawn from the row's generator as plain decoding draws it:
    one draw per emitted token, in order, so a seeded row's output is ntp's whatever its K, cap or
    batch), and the view of the pass its proposer drafts from: the context with the
    model's own token, the hidden state at the last accepted position, the trunk streams of the
    positions that become the prefix, and the mask group that followed the last accepted draft (the
    root: none accepted), if it had one. E.g. D=3 nodes, g=2, anchors [-1, 0, 2, 1] (mask_anchors):
    acceptance stopping at node 2 reads rows 1+D+2g.. = 8, 9; stopping at a node without a group
    leaves the next pass without mask guesses (counted in `missed_groups`)."""
    drafts, D = s.drafts, len(s.drafts)
    lg = out.logits[i]  # [N, V]
    if s.strategy.is_tree:
        path, own = tree.accept(lg[: D + 1], drafts.tokens, drafts.parents, s.params, s.gen)
        a, row = len(path), (1 + path[-1] if path else 0)
        accepted = [drafts.tokens[j] for j in path]
    else:
        # matched, not rejection-sampled (draft distributions ignored): the model's own samples, drawn as ntp draws them
        a, own = verify_drafts(lg[: D + 1], drafts.tokens, None, s.params, s.gen)
        row, path, accepted = a, None, drafts.tokens[:a]
    drafted_by = [
        drafts.sources[j] if drafts.sources is not None else (s.proposer.name,)
        for j in (path if path is not None else range(a))
    ]
    g, anchors = s.group_size(), batch.anchors[i]
    stop = path[-1] if path else a - 1  # the last accepted draft; -1 = the root
    has_group = stop in anchors
    first_mask = D + 1 + g * (anchors.index(stop) if has_group else 0)
    s.missed_groups += bool(g) and not has_group
    # block positions that become the row's prefix: pending + accepted drafts (a tree: its path's
    # nodes, e.g. P=1, path [1, 4] -> rows 0, 2, 5), in order
    P = len(s.pending)
    committed = list(range(P)) + [P + j for j in path] if path else slice(0, P + a)
    view = PassView(
        context=s.prompt_ids + s.output + accepted + [own],
        mask_logits=lg[first_mask : first_mask + g],
        hidden=out.hidden[i, row] if out.hidden is not None else None,
        masks_valid=has_group,
        aux=out.aux[i, committed] if out.aux is not None and s.proposer.aux_layers else None,
        start=batch.starts[i],
        state=s.proposer_state,
    )
    expected = None
    if s.strategy.is_tree:  # what the drafts promised (as believed before this pass), then the record grows
        expected = tree_expected_tokens(tree.trusted(drafts.parents, drafts.confidences[:D], s.tree_trust))
        tree.record_trust(s.tree_trust, drafts.parents, drafts.confidences[:D], a)
    logprobs = None
    if s.logprobs is not None:  # each emitted token at the row that predicted it: a tree node's after its parent
        rows = [0] + [1 + j for j in (path if path is not None else range(a))]
        logprobs = token_logprobs(lg[rows], accepted + [own], s.logprobs)
    return _Accepted(
        a, path, accepted, own, float(torch.softmax(lg[row], -1).max()), drafted_by, expected, view, logprobs
    )


@dataclass
class _Drafted:
    """What `_draft` got for one row."""

    guesses: Guesses  # the guesses kept (`tree:auto`: the nodes worth their rows; up to a non-finite one)
    seconds: float  # its proposer's time: its own `propose` call and its share of batched drafts
    count: int  # guesses the proposer returned


def _draft(seqs: list[Sequence], views: list[PassView]) -> list[_Drafted]:
    """Phase 4: every row's guesses for the tokens after its own (`_request`; a row with K = 1 asks
    nothing, unless its proposer keeps state that must follow every pass: EAGLE-3), timed. Every row
    announces its request first and proposers shared by rows draft them all at once (`_draft_together`:
    the heads, one call per depth for the batch); each row's `propose` then hands out its answer."""
    requests = [_request(s, v) if s.k > 1 or _keeps_state(s) else None for s, v in zip(seqs, views)]
    shares = _draft_together(seqs, requests)
    out = []
    for s, request, share in zip(seqs, requests, shares):
        if request is None:
            out.append(_Drafted(Guesses.none(), 0.0, 0))
            continue
        t0 = time.perf_counter()
        guesses = s.proposer.propose(request)
        seconds, count = share + time.perf_counter() - t0, len(guesses)
        if s.strategy.auto and guesses.tokens:  # keep the nodes worth their rows (and their masks) here
            appended = lambda n, s=s: s.proposer.n_appended(s.strategy.guess_k(s.k), n)  # noqa: E731
            believed = tree.trusted(guesses.parents, guesses.confidences, s.tree_trust)
            b = s.bookkeeping_s()  # a pass costs its forward and the loop around it: price both
            priced = lambda q, s=s, b=b: s.pass_time(q) + b  # noqa: E731
            guesses = guesses.select(tree.keep(guesses.parents, believed, priced, appended=appended))
        out.append(_Drafted(finite_prefix(guesses), seconds, count))
    return out


def _draft_together(seqs: list[Sequence], requests: list[DraftRequest | None]) -> list[float]:
    """Announce every row's request (`Proposer.prepare`), then have each proposer that took some draft
    them all at once (`draft_prepared`). Returns each row's seconds of it: a batched draft's time is
    split evenly over the requests it took."""
    takers: dict[int, tuple[Proposer, list[int]]] = {}  # id(proposer) -> (it, the row of each request it took)
    for i, (s, request) in enumerate(zip(seqs, requests)):
        if request is not None:
            for p in s.proposer.prepare(request):
                takers.setdefault(id(p), (p, []))[1].append(i)
    seconds = [0.0] * len(seqs)
    for p, rows in takers.values():
        t0 = time.perf_counter()
        p.draft_prepared()
        share = (time.perf_counter() - t0) / len(rows)
        for i in rows:
            seconds[i] += share
    return seconds


def _request(s: Sequence, view: PassView) -> DraftRequest:
    """What row `s` asks its proposer after a pass: K - 1 guesses, a tree (`tree:N`) or a chain. Drafts
    to be verified (`tree`, `verify`) are never sampled (each guess the proposer's likeliest, the row's
    generator untouched), so verification draws exactly plain decoding's samples (`verify_drafts`);
    the guesses a lossy strategy emits unverified (`static`, `conf_adapt`) are drawn under the row's
    sampling, from its generator."""
    if s.strategy.is_tree:
        return DraftRequest(view, s.k - 1, True)
    if s.strategy.verifies:
        return DraftRequest(view, s.k - 1, False)
    return DraftRequest(view, s.k - 1, False, s.params, s.gen)


def _commit(s: Sequence, cache: KVCache, start: int, block_tokens: int, a: _Accepted, d: _Drafted) -> list[int]:
    """Phases 5-6, one row. Emit by strategy: ntp the model's own token; static it + all guesses;
    conf_adapt the confident prefix of [it, guesses...]; verify the accepted drafts + it, the guesses
    becoming the next pass's drafts. Commit the pending tokens and accepted drafts to the cache (a
    tree's path moved into contiguous slots first; rejected drafts and masks are simply not committed:
    rollback is not advancing the length), deliver the tokens (`_append_output`: EOS, stop strings,
    length) and record the pass in the row's stats. Returns the tokens delivered."""
    preds, confs = [a.own] + d.guesses.tokens, [a.own_conf] + d.guesses.confidences
    n = s.strategy.emit_count(confs)
    new = preds[:n]
    if a.path:
        cache.compact(s.slot, start + len(s.pending), a.path)
    cache.commit(s.slot, len(s.pending) + a.n)
    s.pending = new
    s.drafts = d.guesses if s.strategy.verifies else Guesses.none()
    emitted, produced = _append_output(s, a.tokens + new)
    if a.logprobs is not None:  # lossless: a.tokens + new are the tokens scored; cut as the output was
        s.token_logprobs.extend(a.logprobs)
        del s.token_logprobs[len(s.output) :]
    s.stats.record_pass(
        produced, [1.0] * a.n + confs[:n], block_tokens, a.drafted_by[:produced], a.expected, d.seconds, d.count
    )
    return emitted


class NonFiniteError(ValueError):
    """A forward pass whose logits at ordinary (non-mask) positions are NaN or inf."""


def finite_prefix(g: Guesses) -> Guesses:
    """The guesses up to the first one whose confidence or distribution is not finite: a NaN guess
    is a rejected guess (it never becomes a draft, and no block is emitted from it)."""
    n = 0
    while (
        n < len(g.tokens)
        and math.isfinite(g.confidences[n])
        and (g.probs is None or bool(torch.isfinite(g.probs[n]).all()))
    ):
        n += 1
    if n == len(g.tokens):
        return g
    return g.prefix(n)


def _aux_layers(seqs: list[Sequence]) -> tuple[int, ...]:
    """The trunk layers the batch's proposers read (one set per pass: rows must agree)."""
    wanted = {tuple(s.proposer.aux_layers) for s in seqs if _keeps_state(s)}
    if len(wanted) > 1:
        raise ValueError(f"one pass cannot serve proposers reading different trunk layers: {sorted(wanted)}")
    return wanted.pop() if wanted else ()


def _keeps_state(s: Sequence) -> bool:
    """Whether the row's proposer keeps state that must follow every pass (EAGLE-3, alone or in a merge:
    it reads trunk layers), for a strategy that ever drafts (`ntp` never asks: no drafter runs for it)."""
    return bool(s.proposer.aux_layers) and s.strategy.k > 1


def _branch_layout(seqs: list[Sequence], slots_pos: torch.Tensor, branched: list[bool]):
    """RoPE positions [B, T] and attention [B, T, S] for the rows flagged in `branched` (a token tree,
    or mask groups that branch); the other rows keep the plain causal rule over their slots.

    A flagged row's block is pending (P) + drafts (D) + one group of g masks after each of its
    `Sequence.mask_anchors()`, laid out by `mtp.core.decoding.tree.apply_layout` as one tree: the drafts with
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
        nodes = tree.with_groups(s.drafts.parents, s.mask_anchors(), s.group_size())
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
        cache = KVCache.for_model(
            model, 1, len(seq.prompt_ids) + seq.params.max_new_tokens + block_slack(seq.strategy.k)
        )
        seq.slot = 0
    cache.reset(seq.slot)
    seq.stats = DecodeStats()
    with torch.inference_mode():
        while not seq.finished:
            yield decode_step(model, cache, [seq], mask_id)[0]


def generate(
    model,
    prompt_ids: list[int],
    strategy: Strategy | str = "ntp",
    params: SamplingParams | None = None,
    proposer: Proposer | None = None,
    mask_id: int | None = None,
    eos_ids=(),
    decode_text=None,
) -> Sequence:
    """Decode one prompt to the end and return the finished Sequence (output, stats, finish reason)."""
    strategy = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
    seq = Sequence(
        list(prompt_ids),
        strategy,
        params or SamplingParams(),
        proposer or MaskProposer(),
        eos_ids=tuple(eos_ids),
        decode_text=decode_text,
    )
    for _ in stream(model, seq, mask_id if mask_id is not None else model.config.mask_token_id):
        pass
    return seq
