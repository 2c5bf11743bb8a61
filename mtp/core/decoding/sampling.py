"""Turning logits into tokens: greedy, temperature/top-k/top-p, and lossless draft verification.

Deterministic drafts (what the decoding loop sends: `verify` and `tree` drafts never depend on the
random state) are verified by matching: at each position the model's own token is drawn from p exactly
as plain decoding draws it (one sample, from the sequence's generator, in output order), and the draft
is accepted iff it equals that token; the first mismatch ends the block with the model's token. A draft
d is then accepted with probability p(d), which is rejection sampling's min(1, p(d) / q(d)) for a
one-hot q, and every emitted token is the sample plain decoding would have drawn at that position:
the output equals plain decoding's draw for draw under a seed, whatever K, cap or batch.

Sampled drafts (a distribution q per draft; `verify_drafts` with `draft_probs`) use rejection sampling
(Leviathan et al. 2023; Chen et al. 2023), for a draft token d proposed with probability q(d) where
the target model gives p(d):
- accepted: d is kept with probability min(1, p(d) / q(d));
- recovered: at the first rejection a token is drawn from norm(max(0, p - q)) and the block ends;
- bonus: when every draft is accepted, one more token is drawn from p at the position after them.
The emitted sequence is then distributed exactly as plain sampling from p (equal in distribution, not
draw for draw: the number of random draws depends on the drafts). With greedy decoding (temperature 0)
both reduce to "accept while the draft equals the argmax", and the bonus or recovered token is the
argmax itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

TEMPERATURE_MAX = 2.0  # every front end accepts temperatures in [0, TEMPERATURE_MAX]
SEED_MAX = 2**63 - 1  # torch.Generator seeds are signed 64-bit


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)

    def __post_init__(self):
        """Every limit, checked once for every front end (NaN and infinities fail the range checks)."""
        if not (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and 0 <= self.temperature <= TEMPERATURE_MAX
        ):
            raise ValueError(f"temperature must be a number in [0, {TEMPERATURE_MAX:g}], got {self.temperature}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [0, {SEED_MAX}], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] probabilities after temperature, top-k and top-p filtering."""
    logits = logits.float() / max(params.temperature, 1e-6)
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the tokens ranked above it already reach top_p
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """[N, V] probabilities -> [N] tokens."""
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] each row's index of its largest value, the first of equal ones (a NaN counts as the
    largest), as `torch.argmax`; on CPU float32 rows through numpy, whose argmax over a 49k vocabulary takes
    ~3 us where torch's takes ~35 (every pass of every strategy reads one or more)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.asarray(logits.numpy().argmax(-1)))  # a 0-d array for one row
    return logits.argmax(-1)


def pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None):
    """[N, V] logits -> ([N] tokens, [N, V] probs or None under greedy)."""
    if params.greedy:
        return argmax(logits), None
    probs = probs_from_logits(logits, params)
    return sample(probs, gen), probs


def verify_drafts(
    target_logits: torch.Tensor,  # [D+1, V] the model's logits at the last committed token and each draft
    drafts: list[int],  # D proposed tokens
    draft_probs: torch.Tensor | None,  # [D, V] proposal distributions; None = deterministic drafts
    params: SamplingParams,
    gen: torch.Generator | None,
) -> tuple[int, int]:
    """Return (number of drafts accepted a, the model's own token after them: bonus or recovered).
    Deterministic drafts (`draft_probs` None) are matched against the model's own sample at each
    position, drawn in order from `gen` (one draw per returned token: plain decoding's draws); sampled
    drafts go through rejection sampling (the module docstring)."""
    D = len(drafts)
    if params.greedy:
        model_tokens = argmax(target_logits).tolist()  # [D+1]
        a = 0
        while a < D and drafts[a] == model_tokens[a]:
            a += 1
        return a, model_tokens[a]
    if draft_probs is None:
        for a in range(D + 1):
            own = int(sample(probs_from_logits(target_logits[a : a + 1], params), gen)[0])
            if a == D or own != drafts[a]:
                return a, own
    p = probs_from_logits(target_logits, params)  # [D+1, V]
    for i, d in enumerate(drafts):
        q = draft_probs[i]
        u = float(torch.rand((), generator=gen))
        if u < min(1.0, float(p[i, d]) / max(float(q[d]), 1e-20)):
            continue
        residual = torch.clamp(p[i] - q, min=0.0)
        s = residual.sum()
        residual = residual / s if s > 0 else p[i]
        return i, int(sample(residual.unsqueeze(0), gen))
    return D, int(sample(p[D : D + 1], gen))
