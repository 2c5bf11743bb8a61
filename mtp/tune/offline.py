"""Offline decoding of many prompts with one candidate, `batch` rows at a time through the one
batching loop (`mtp.core.decoding.batching.Batch`), greedy: what `mtp tune` runs to learn each candidate's
outputs, acceptance and block sizes without paying one single-stream decode per prompt.

Per prompt it keeps the output ids and text, the tokens emitted and fed per pass (`chunks`, `blocks`), and with
`record=True` the confidences of every proposal the row's proposer made, one list per pass (`proposals`); the
proposer's time per guess is clocked over the whole run (`DecodeStats.proposing_s`, timed by the decoding loop).
Rows of one batch share each pass, so wall times here are not single-stream speeds: `mtp tune` prices candidates
with the cost model and measures the best ones alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp.core.decoding.batching import Batch
from mtp.core.decoding.decode import block_slack
from mtp.core.decoding.proposers import DraftRequest, Guesses, Proposer
from mtp.core.decoding.proposers.base import WrappedProposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy


@dataclass
class Output:
    ids: list[int]
    text: str
    chunks: list[int]
    blocks: list[int]
    finish: str
    proposals: list[list[float]] = field(default_factory=list)  # per pass: the guesses' confidences
    trees: list[tuple] = field(default_factory=list)  # per pass of a tree run: (tokens, parents, confidences)


@dataclass
class RunStats:
    outputs: list[Output]
    proposing_s: float  # seconds the proposer spent in total
    guesses: int  # guesses it made in total

    @property
    def guess_s(self) -> float:
        return self.proposing_s / self.guesses if self.guesses else 0.0


class RecordingProposer(WrappedProposer):
    """`inner` with the confidences of each chain of guesses it returns appended to `log`, and each
    tree it drafts to `trees`."""

    def __init__(self, inner: Proposer, log: list[list[float]], trees: list[tuple] | None = None):
        super().__init__(inner)
        self.log, self.trees = log, trees if trees is not None else []

    def propose(self, request: DraftRequest) -> Guesses:
        g = self.inner.propose(request)
        if request.tree:
            self.trees.append((list(g.tokens), list(g.parents), list(g.confidences)))
        else:
            self.log.append(list(g.confidences))
        return g


def decode_all(
    engine,
    prompts: list[list[int]],
    strategy: Strategy,
    proposer: str | None,
    max_new_tokens: int,
    batch: int = 16,
    record: bool = False,
    stop_after=None,
) -> RunStats:
    """Greedy outputs of every prompt under `strategy` drafting from `proposer` (None: the engine's).
    `stop_after(index, output) -> bool` may end the run early (the outputs so far are returned, in
    prompt order, up to the first prompt not yet finished)."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    longest = max(len(p) for p in prompts)
    rows = Batch(
        engine.model,
        engine.mask_id,
        max(1, min(batch, len(prompts))),
        min(engine.context_window, longest + max_new_tokens + block_slack(strategy.k)),
    )
    proposing_s, guesses = 0.0, 0
    done: dict[int, Output] = {}
    logs: dict[int, list[list[float]]] = {}
    trees: dict[int, list[tuple]] = {}
    index: dict[int, int] = {}  # id(seq) -> prompt index
    todo = list(range(len(prompts)))
    stopped = False
    with torch.inference_mode():
        while (todo and not stopped) or rows.active:
            while todo and rows.free and not stopped:
                j = todo.pop(0)
                seq = engine.new_sequence(prompts[j], strategy, params, proposer)
                if record:
                    logs[j], trees[j] = [], []
                    seq.proposer = RecordingProposer(seq.proposer, logs[j], trees[j])
                rows.add(seq)
                index[id(seq)] = j
            rows.step()
            for seq in [s for s in rows.active if s.finished]:
                rows.remove(seq)
                proposing_s += sum(seq.stats.proposing_s)
                guesses += sum(seq.stats.guesses)
                j = index.pop(id(seq))
                done[j] = Output(
                    list(seq.output),
                    engine.decode_text(seq.output),
                    list(seq.stats.chunks),
                    list(seq.stats.blocks),
                    seq.finish_reason or "length",
                    logs.get(j, []),
                    trees.get(j, []),
                )
                if stop_after is not None and stop_after(j, done[j]):
                    stopped = True
    ordered = []
    for j in range(len(prompts)):
        if j not in done:
            break
        ordered.append(done[j])
    return RunStats(ordered, proposing_s, guesses)


def chain_pairs(out: Output) -> list[list[tuple[float, bool]]]:
    """(confidence, right) pairs per depth from a `verify` run with `record=True`: pass p's guesses
    are checked by pass p+1, which emits its accepted drafts plus the model's own token, so guess d
    (0-based) was reached when d <= accepted and was right when d < accepted. The last pass is left
    out (EOS or the length limit may cut what it emits)."""
    pairs: list[list[tuple[float, bool]]] = []
    for p, confs in enumerate(out.proposals[: len(out.chunks) - 2]):
        accepted = out.chunks[p + 1] - 1
        for d, c in enumerate(confs[: accepted + 1]):
            while len(pairs) <= d:
                pairs.append([])
            pairs[d].append((float(c), d < accepted))
    return pairs


def tree_pairs(out: Output) -> list[list[tuple[float, bool]]]:
    """(node confidence, right) pairs per node depth from a lossless tree run with `record=True`: the
    tree drafted after pass p sits where the output stood after that pass, and a node is right when
    its whole root path is what the output continues with (the output is the model's own greedy
    text). Nodes whose path runs past the end of the output are left out (unknown)."""
    pairs: list[list[tuple[float, bool]]] = []
    pos = 0
    for p, (tokens, parents, confs) in enumerate(out.trees):
        pos += out.chunks[p] if p < len(out.chunks) else 0
        paths: list[list[int]] = []
        for t, par, c in zip(tokens, parents, confs):
            path = (paths[par] if par >= 0 else []) + [t]
            paths.append(path)
            if pos + len(path) > len(out.ids):
                continue
            d = len(path) - 1
            while len(pairs) <= d:
                pairs.append([])
            pairs[d].append((float(c), out.ids[pos : pos + len(path)] == path))
    return pairs
