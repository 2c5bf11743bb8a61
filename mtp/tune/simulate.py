"""Lossless candidates priced without decoding them: greedy `verify:K` and `tree:N` replayed on the
reference answers.

Under greedy decoding a lossless strategy emits exactly the reference (`ntp`) answer, and a proposer
that reads only the context and the last layer's hidden state (heads, lookup, suffix, and merges of
them) drafts from the same inputs at every pass: the hidden state that predicted the model's own
token at answer position e is the teacher-forced pass's hidden state at prompt length + e - 1. So
one forward pass over prompt + answer per prompt (none for a proposer that reads only the context:
lookup, suffix), then the proposer alone, pass by pass, gives every
pass's drafts, how many of them the model would accept (the longest matching prefix, or the tree path
of the answer's tokens) and the block it fed: the same chunks and blocks a real decode records (up
to the floating-point differences between a full pass and incremental passes, which may flip a
near-tie of a draft). EAGLE-3 reads, besides the context, the trunk's residual streams at the
positions each pass committed: the same teacher-forced pass returns them at every position, and each
replayed pass hands the drafter the rows of the positions its predecessor committed, as a decode does.
Mask proposers (their guesses come from mask tokens inside the pass) cannot be replayed this way:
those are decoded.

The proposer's calls are timed, as the decoding loop times them, so pricing includes its cost.
A proposer that reads the hidden state (the heads) answers the same question at the same position
of the same answer whichever candidate asks, so its answers are kept across replays (`memo`,
`MemoProposer`), and a kept answer is charged the seconds it took when it was computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mtp.core.decoding import tree
from mtp.core.decoding.proposers import DraftRequest, Guesses, PassView, check_proposer
from mtp.core.decoding.proposers.base import GREEDY, WrappedProposer
from mtp.core.decoding.strategy import Strategy
from mtp.tune.offline import Output, RecordingProposer, RunStats
from mtp.tune.predictability import forward_over, teacher_forced


class MemoProposer(WrappedProposer):
    """`inner`'s greedy answers kept in `memo` by (name, position, call, size); `saved` sums the
    seconds each answer first took, for every time it is handed out again."""

    def __init__(self, inner, name: str, memo: dict):
        super().__init__(inner)
        self.key, self.memo, self.saved = name, memo, 0.0

    def _kept(self, key, compute):
        hit = self.memo.get(key)
        if hit is None:
            t0 = time.perf_counter()
            guesses = compute()
            hit = self.memo[key] = (guesses, time.perf_counter() - t0)
        else:
            self.saved += hit[1]
        return hit[0]

    def propose(self, request: DraftRequest) -> Guesses:
        if not request.tree and request.params is not GREEDY:
            return self.inner.propose(request)
        return self._kept(
            (self.key, len(request.view.context), request.tree, request.n), lambda: self.inner.propose(request)
        )


def can_replay(proposer: str) -> bool:
    """Whether `proposer` drafts from the context, hidden state and trunk streams alone (heads, lookup,
    suffix, merges of them, EAGLE-3): not from mask tokens inside the pass."""
    spec = check_proposer(proposer)
    return all(not check_proposer(p).needs_mask_token for p in (spec.parts or (proposer,)))


def accepted(guesses: Guesses, truth: list[int], is_tree: bool) -> int:
    """Drafts the model accepts when its own next tokens are `truth` (greedy)."""
    if not is_tree:
        a = 0
        while a < len(guesses.tokens) and a < len(truth) and guesses.tokens[a] == truth[a]:
            a += 1
        return a
    node, a = -1, 0
    while a < len(truth):
        nxt = next(
            (j for j, (t, p) in enumerate(zip(guesses.tokens, guesses.parents)) if p == node and t == truth[a]), None
        )
        if nxt is None:
            break
        node, a = nxt, a + 1
    return a


def replay(
    engine,
    prompts: list[list[int]],
    answers: list[Output],
    strategy: Strategy,
    proposer: str,
    record: bool = False,
    hidden_cache: dict | None = None,
    memo: dict | None = None,
) -> RunStats:
    """The passes of `strategy` drafting from `proposer` on each prompt, replayed on its reference
    answer (an `Output` of the `ntp` run: ids, and finish 'stop' when it ended in EOS). Returns
    outputs with the reference ids and the replayed chunks, blocks (and with `record`, the drafts'
    confidences and trees, as `offline.decode_all` records them). `hidden_cache` (prompt index ->
    hidden states, and (index, layers) -> trunk streams for EAGLE-3) spares repeated teacher-forced
    passes; `memo` (prompt index -> kept answers) the heads' repeated answers across replays."""
    if not strategy.verifies:
        raise ValueError(f"only lossless strategies can be replayed, not {strategy}")
    spent = Spent()
    eos = list(engine.loaded.eos_ids[:1])
    outs, saved = [], 0.0
    for j, (prompt, ref) in enumerate(zip(prompts, answers)):
        seq = ref.ids + (eos if ref.finish == "stop" and eos else [])  # what the passes produce, EOS included
        kept = memo.setdefault(j, {}) if memo is not None else None
        memos: list[MemoProposer] = []

        def keep(name, p, kept=kept, memos=memos):
            if kept is None or not p.needs_hidden:
                return p
            memos.append(MemoProposer(p, name, kept))
            return memos[-1]

        base = engine.proposer(proposer, wrap=keep)
        hidden = hidden_states(engine.model, base, prompt, ref.ids, hidden_cache, j)
        aux = trunk_streams(engine.model, prompt, ref.ids, base.aux_layers, hidden_cache, j)
        logs, trees = [], []
        prop = RecordingProposer(base, logs, trees) if record else base
        chunks, blocks = passes(engine, prop, strategy, prompt, seq, hidden, aux, spent)
        outs.append(Output(list(ref.ids), ref.text, chunks, blocks, ref.finish, logs, trees))
        saved += sum(m.saved for m in memos)
    return RunStats(outs, spent.proposing_s + saved, spent.guesses)


@dataclass
class Spent:
    """What a replay's proposer spent over every prompt: seconds proposing, guesses made."""

    proposing_s: float = 0.0
    guesses: int = 0


def passes(engine, prop, strategy: Strategy, prompt: list[int], seq: list[int], hidden, aux, spent: Spent):
    """(chunks, blocks) of `strategy`'s passes over answer `seq` (EOS included) of `prompt`, `prop` drafting
    at each from what a decode would hand it (`hidden`, `aux`: the teacher-forced pass's); the model accepts
    the drafts that match `seq` (`accepted`). `spent` adds the proposer's time and guesses."""
    P = len(prompt)
    chunks, blocks = [1], [P]  # the prompt's pass emits the first token
    e, state, start = 1, {}, 0  # start: the cache length before the pass that emitted seq[e - 1]
    trust: list = []  # a tree row's record of promised against accepted nodes (tree.trusted), as decoding keeps
    with torch.inference_mode():
        while e < len(seq):
            # that pass committed positions start .. P + e - 2 (the prompt's pass: the whole prompt)
            view = PassView(
                context=list(prompt) + seq[:e],
                mask_logits=torch.empty(0),
                hidden=None if hidden is None else hidden[P + e - 2],
                masks_valid=False,
                aux=None if aux is None else aux[start : P + e - 1],
                start=start,
                state=state,
            )
            t0 = time.perf_counter()
            g = prop.propose(DraftRequest(view, strategy.k - 1, strategy.is_tree))
            spent.proposing_s += time.perf_counter() - t0
            spent.guesses += len(g)
            if strategy.auto and g.tokens:
                believed = tree.trusted(g.parents, g.confidences, trust)
                g = g.select(tree.keep(g.parents, believed, engine.pass_time()))
            elif not strategy.is_tree:
                g = g.prefix(strategy.k - 1)
            a = accepted(g, seq[e:], strategy.is_tree)
            if strategy.is_tree:
                tree.record_trust(trust, g.parents, g.confidences[: len(g)], a)
            n = min(a + 1, len(seq) - e)
            chunks.append(n)
            blocks.append(1 + len(g.tokens))
            start = P + e - 1
            e += n
    return chunks, blocks


def hidden_states(model, proposer, prompt: list[int], answer: list[int], cache: dict | None, j: int):
    """The last layer's hidden state at every position of prompt + answer, from one teacher-forced pass (kept
    in `cache` under j); None for a proposer that does not read it. Pass e reads the hidden state at
    P + e - 2 < P + len(answer): the answer without its EOS is enough."""
    if not proposer.needs_hidden:
        return None
    if cache is not None and j in cache:
        return cache[j]
    hidden = teacher_forced(model, prompt, answer)[1] if answer else torch.empty(0)
    if cache is not None:
        cache[j] = hidden
    return hidden


def trunk_streams(
    model, prompt: list[int], answer: list[int], aux_layers: tuple[int, ...], cache: dict | None, j: int
) -> torch.Tensor | None:
    """The residual streams of `aux_layers` at every position of prompt + answer ([P + A, len * dim]), from
    one teacher-forced pass (kept in `cache` under (j, aux_layers)); None for a proposer without them."""
    if not aux_layers:
        return None
    key = (j, tuple(aux_layers))
    if cache is not None and key in cache:
        return cache[key]
    aux = forward_over(model, list(prompt) + list(answer), aux_layers=tuple(aux_layers))[2][0].cpu()
    if cache is not None:
        cache[key] = aux
    return aux
