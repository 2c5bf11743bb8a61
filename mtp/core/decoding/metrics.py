"""Every decoding metric, defined once; the CLI, server, benchmarks and trainer all use these.

Definitions (one forward pass = one call of the model on one block, the prompt's pass included):
- tokens_per_forward: tokens emitted / forward passes ("Eff. k"; exactly 1.0 for `ntp`).
- acceptance_by_position[i]: fraction of passes that emitted more than i tokens, i = 0..k_max-1
  (position 0 is always 1.0; position 1 is how often the first proposal was kept, and so on).
- time to first token (ttft_s): from the start of decoding to the end of the first pass.
- tokens_per_s: tokens emitted / wall time.
- mean_block_tokens: tokens fed to the model per pass (pending + drafts + masks), the q of the
  cost model t(q) in mtp.core.policy.costmodel; prompt passes excluded by the caller when it wants steady state.
- speedup (vs a reference): tokens_per_s / reference tokens_per_s, both from the same run.
- match_rate: fraction of items equal to their reference (exact_match of whole outputs against the
  `ntp` output, answer_agreement of extracted answers, accuracy against gold answers).
- rougeL: mean ROUGE-L F1 of outputs against references (the `rouge-score` package).
- oracle_tokens_per_forward(confidences, tau): the tokens per pass a ConfAdapt would reach if every
  prediction were the model's own next-token prediction with its own top-1 probability: the emitted
  sequence is cut into blocks greedily, each block the longest run with confidence >= tau (at
  least one token, at most k_max).
- accepted_by_proposer[p] / accepted_share[p]: of the draft tokens a row accepted (and emitted), how
  many proposer p drafted, and that over all accepted draft tokens. p is a part of a merged proposer
  (`heads+suffix+lookup`) or the single proposer itself (share 1.0). A token several parts drafted
  counts in full for each of them (not split), so a merge's shares may sum to more than 1.
- expected tokens of a tree pass (tree_expected_tokens): 1 + the sum of its draft nodes' confidences
  (each node's estimated probability that its root path is the model's continuation), what `tree:auto`
  maximises per second (mtp.core.decoding.tree.prune). predicted_tokens_per_forward: its mean over steady
  passes (the prompt's excluded), beside steady_tokens_per_forward, the measured tokens per pass of
  the same passes.
- tree_nodes_per_pass: draft nodes a tree row's steady pass verified (its block less the one pending
  token; for `tree:auto` the nodes kept of those drafted).
- proposing_s / guesses of a pass (DecodeStats, timed by the decoding loop): the seconds a row's
  proposer spent drafting after it (its own `propose` call plus its even share of a draft batched over
  rows) and the guesses it returned (before `tree:auto` keeps some); seconds per guess, what `mtp bench`
  and `mtp tune` price proposing by, is their sum over their sum, and the server prices it per pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# the parts of a decoding step outside its forward pass, in `DecodeStats.phase_s` order: laying out the
# block (tokens, positions, a tree's attention), accepting drafts, drafting the next ones, committing
PHASES = ("layout", "accept", "draft", "commit")


@dataclass
class DecodeStats:
    chunks: list[int] = field(default_factory=list)  # tokens emitted by each forward pass
    confidences: list[float] = field(default_factory=list)  # top-1 prob of each emitted token
    blocks: list[int] = field(default_factory=list)  # tokens in each pass's block (pending+drafts+masks)
    # per pass: for each accepted draft token, the proposers that drafted it (merge parts); [] = none accepted
    accepted_from: list[list[tuple[str, ...]]] = field(default_factory=list)
    expected: list[float] = field(default_factory=list)  # tree rows, per pass: tree_expected_tokens of its drafts
    proposing_s: list[float] = field(default_factory=list)  # per pass: seconds the proposer spent drafting after it
    guesses: list[int] = field(default_factory=list)  # per pass: guesses the proposer returned
    # per pass: seconds of its decoding step outside the forward pass by phase (PHASES: laying out the block,
    # accepting, drafting, committing), the whole batch's step for a batched row; `outside_s` sums them
    phase_s: list[tuple[float, ...]] = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_end: float | None = None

    def record_pass(
        self,
        n_emitted: int,
        confidences: list[float],
        block_tokens: int | None = None,
        accepted_from: list[tuple[str, ...]] | None = None,
        expected: float | None = None,
        proposing_s: float = 0.0,
        guesses: int = 0,
    ) -> None:
        self.chunks.append(n_emitted)
        self.proposing_s.append(proposing_s)
        self.guesses.append(guesses)
        if block_tokens is not None:
            self.blocks.append(block_tokens)
        self.accepted_from.append(list(accepted_from or []))
        if expected is not None:
            self.expected.append(expected)
        self.confidences.extend(confidences[:n_emitted])
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_end = now

    @property
    def outside_s(self) -> list[float]:
        """Per pass: seconds of its decoding step outside the forward pass (its phases summed)."""
        return [sum(p) for p in self.phase_s]

    @property
    def forward_passes(self) -> int:
        return len(self.chunks)

    @property
    def tokens(self) -> int:
        return sum(self.chunks)

    @property
    def wall_s(self) -> float:
        return (self.t_end or time.perf_counter()) - self.t_start

    @property
    def ttft_s(self) -> float:
        return (self.t_first or time.perf_counter()) - self.t_start

    def summary(self, k_max: int | None = None) -> dict:
        return {
            "forward_passes": self.forward_passes,
            "tokens_per_forward": tokens_per_forward(self.chunks),
            "acceptance_by_position": acceptance_by_position(self.chunks, k_max),
            "ttft_s": round(self.ttft_s, 4),
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": tokens_per_s(self.tokens, self.wall_s),
        }


def tokens_per_forward(chunks: list[int]) -> float:
    return sum(chunks) / len(chunks) if chunks else 0.0


def tokens_per_s(tokens: int, wall_s: float) -> float:
    return tokens / wall_s if wall_s > 0 else 0.0


def acceptance_by_position(chunks: list[int], k_max: int | None = None) -> list[float]:
    if not chunks:
        return []
    k = k_max or max(chunks)
    return [sum(1 for c in chunks if c > i) / len(chunks) for i in range(k)]


def mean_block_tokens(blocks: list[int]) -> float:
    return sum(blocks) / len(blocks) if blocks else 0.0


def tree_nodes_per_pass(steady_blocks: list[int]) -> float:
    """Draft nodes per pass of a tree row, from its steady blocks (one pending token + the nodes)."""
    return sum(b - 1 for b in steady_blocks) / len(steady_blocks) if steady_blocks else 0.0


def accepted_by_proposer(accepted_from: list[list[tuple[str, ...]]]) -> dict[str, int]:
    """Accepted draft tokens per proposer, over passes (DecodeStats.accepted_from; several runs' lists
    may be concatenated); a token several parts drafted counts for each."""
    counts: dict[str, int] = {}
    for pass_sources in accepted_from:
        for names in pass_sources:
            for name in names:
                counts[name] = counts.get(name, 0) + 1
    return counts


def accepted_share(accepted_from: list[list[tuple[str, ...]]]) -> dict[str, float]:
    """accepted_by_proposer over all accepted draft tokens ({} when none was accepted)."""
    total = sum(len(pass_sources) for pass_sources in accepted_from)
    return {name: n / total for name, n in accepted_by_proposer(accepted_from).items()} if total else {}


def tree_expected_tokens(confidences: list[float]) -> float:
    """Tokens a tree pass is expected to emit: 1 (the model's own token) + its nodes' confidences,
    each clamped to [0, 1]."""
    return 1.0 + sum(min(max(float(c), 0.0), 1.0) for c in confidences)


def speedup(tokens_per_s_run: float, tokens_per_s_reference: float) -> float | None:
    return tokens_per_s_run / tokens_per_s_reference if tokens_per_s_reference > 0 else None


def match_rate(values: list, references: list) -> float | None:
    """Fraction of positions where value == reference (None values never match); None if empty."""
    if len(values) != len(references):
        raise ValueError(f"match_rate: {len(values)} values against {len(references)} references")
    if not values:
        return None
    return sum(1 for v, r in zip(values, references) if v is not None and v == r) / len(values)


def rouge_l(predictions: list[str], references: list[str]) -> float | None:
    """Mean ROUGE-L F1 (rouge-score, with stemming) of each prediction against its reference."""
    if len(predictions) != len(references):
        raise ValueError(f"rouge_l: {len(predictions)} predictions against {len(references)} references")
    if not predictions:
        return None
    from rouge_score import rouge_scorer  # optional [bench] dependency: only ROUGE needs it

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return sum(scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references)) / len(predictions)


def median_spread(values: list[float]) -> tuple[float, float, float] | None:
    """(median, min, max) of repeated measurements; None if there are none."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    n = len(vals)
    med = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
    return med, vals[0], vals[-1]


def oracle_tokens_per_forward(confidences: list[float], tau: float, k_max: int = 16) -> float:
    if not confidences:
        return 0.0
    passes, i = 0, 0
    while i < len(confidences):
        n = 0
        while n < k_max and i + n < len(confidences) and confidences[i + n] >= tau:
            n += 1
        i += max(n, 1)
        passes += 1
    return len(confidences) / passes


def merge(stats: list[DecodeStats], k_max: int | None = None) -> dict:
    """Aggregate over several runs: pooled passes and tokens, summed wall time."""
    chunks = [c for s in stats for c in s.chunks]
    wall = sum(s.wall_s for s in stats)
    return {
        "forward_passes": len(chunks),
        "tokens": sum(chunks),
        "tokens_per_forward": tokens_per_forward(chunks),
        "acceptance_by_position": acceptance_by_position(chunks, k_max),
        "wall_s": wall,
        "tokens_per_s": tokens_per_s(sum(chunks), wall),
        "ttft_s": sum(s.ttft_s for s in stats) / len(stats) if stats else 0.0,
    }


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of latencies and the like; None if empty."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    rank = max(1, -(-len(vals) * q // 100))  # ceil(n * q / 100), at least the first value
    return vals[int(min(rank, len(vals))) - 1]
