"""`mtp tune --toy`: the seed's toy check in one line. Three prompts whose answers are easy to
predict (counting, a repeated phrase, a list), decoded with `ntp` and with each multi-token
strategy this engine can run, printed as the chunk view (each forward pass's tokens on one
background colour) with tokens per pass, so a user sees blocks form before spending time on
their own data."""

from __future__ import annotations

from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy

PROMPTS = (
    "Count from 1 to 30, separated by commas.",
    "Repeat the sentence 'the cat sat on the mat' five times.",
    "List the days of the week, one per line.",
)


def arms(engine) -> list[tuple[Strategy, str | None]]:
    """ntp, then verify:4 with the engine's proposer, and conf_adapt:0.9:4 where it has confidences."""
    out = [(Strategy(), None)]
    if engine.can_propose():
        out.append((Strategy.parse("verify:4"), engine.config.proposer))
        if engine.proposer().has_confidence:
            out.append((Strategy.parse("conf_adapt:0.9:4"), engine.config.proposer))
    return out


def run(engine, max_new_tokens: int = 64, write=print, colour: bool = True) -> list[dict]:
    rows = []
    for prompt in PROMPTS:
        write(f"\n{prompt}")
        ids = engine.encode(prompt, chat=True)
        for strategy, proposer in arms(engine):
            seq = engine.new_sequence(ids, strategy, SamplingParams(max_new_tokens=max_new_tokens), proposer)
            for _ in engine.stream(seq):
                pass
            res = engine.result(seq)
            tpf = res.summary["tokens_per_forward"]
            label = str(strategy) + (f"@{proposer}" if proposer else "")
            view = (
                engine.render_chunks(res)
                if colour
                else "|".join(
                    engine.decode_text(res.token_ids[sum(res.chunks[:i]) : sum(res.chunks[: i + 1])])
                    for i in range(len(res.chunks))
                )
            )
            write(f"  {label:<24} {tpf:.2f} tokens/pass  {view.strip()}")
            rows.append({"prompt": prompt, "strategy": label, "tokens_per_forward": tpf, "tokens": len(res.token_ids)})
    return rows
