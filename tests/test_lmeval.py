"""lm-evaluation-harness, the real client, against a live `mtp serve` (SmolLM2-135M, `ntp`): its
per-item results equal what mtp computes in-process. Two tasks from local files (no hub): a multiple-
choice set scored through prompt log-probabilities (`echo` + `logprobs`; each continuation's
log-likelihood equals the decoding loop's prefill scores to 1e-5, and so does its is-greedy flag), and
10 GSM8K test problems by `generate_until` (each generation equals `Engine.generate`'s on the same ids
and stop strings). lm-eval runs from .venv-lmeval (`make lmeval`) in a subprocess; skipped without it,
without the packaged model, and (the GSM8K half) without MTP_DATA_DIR's gsm8k/test.jsonl."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import require_smollm2

from mtp.core.decoding.sampling import SamplingParams

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "quality_lmeval.py"
_spec = importlib.util.spec_from_file_location("quality_lmeval", BENCH)
Q = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(Q)

pytestmark = [
    pytest.mark.lmeval,
    pytest.mark.slow,
    pytest.mark.skipif(Q.lmeval_python() is None, reason="lm-eval is not installed in .venv-lmeval (make lmeval)"),
]

N_GSM8K, MAX_GEN_TOKS = 10, 64


def gsm8k_file() -> Path | None:
    root = os.environ.get("MTP_DATA_DIR")
    path = Path(root) / "gsm8k" / "test.jsonl" if root else None
    return path if path is not None and path.is_file() else None


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """lm-eval's per-item samples from one run over both tasks against `mtp serve --adapter none`."""
    require_smollm2()
    folder = tmp_path_factory.mktemp("lmeval")
    tasks = [t for t in Q.write_tasks(folder / "tasks", gsm8k_file(), N_GSM8K, MAX_GEN_TOKS) if t != "mtp_qa"]
    port = Q.free_port()
    server = Q.start_server(port, folder / "serve.log", "--adapter", "none", "--strategy", "ntp")
    try:
        out = Q.run_lmeval(Q.lmeval_python(), f"http://127.0.0.1:{port}", tasks, folder / "tasks", timeout=1200)
    finally:
        Q.stop_server(server)
    return out


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into tokens (TemplateLM._encode_pair)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx) :]


def test_multiple_choice_loglikelihoods_equal_the_prefill_scores(harness, smollm2):
    samples = harness["samples"]["mtp_mc"]
    assert len(samples) == len(Q.MC_ITEMS)
    assert harness["results"]["mtp_mc"]["acc,none"] > 0.5  # a task this model can do (4 choices each)
    for s in samples:
        assert len(s["arguments"]) == len(s["resps"]) == 4
        for (context, continuation), ((ll, greedy),) in zip(s["arguments"], s["resps"]):
            ctx, cont = encode_pair(smollm2.tokenizer, context, continuation)
            seq = smollm2.new_sequence(
                ctx + cont, "ntp", SamplingParams(max_new_tokens=1), logprobs=1, prompt_logprobs=True
            )
            for _ in smollm2.stream(seq):
                pass
            scored = seq.prompt_token_logprobs[len(ctx) - 1 :]  # record t scores prompt token t + 1
            assert [r.token for r in scored] == cont
            assert ll == pytest.approx(sum(r.logprob for r in scored), abs=1e-5)
            assert greedy == all(r.logprob == r.top[0][1] for r in scored)


def test_gsm8k_generations_equal_mtp_generate(harness, smollm2):
    if gsm8k_file() is None:
        pytest.skip("set MTP_DATA_DIR to a folder holding gsm8k/test.jsonl")
    samples = harness["samples"]["mtp_gsm8k"]
    assert len(samples) == N_GSM8K
    eos = smollm2.tokenizer.eos_token
    for s in samples:
        ((context, gen_kwargs),) = s["arguments"]
        stop = list(gen_kwargs["until"]) + ([eos] if eos and eos not in gen_kwargs["until"] else [])
        ids = smollm2.tokenizer(context, add_special_tokens=False)["input_ids"]
        ref = smollm2.generate(ids, "ntp", SamplingParams(max_new_tokens=gen_kwargs["max_gen_toks"], stop=stop))
        assert s["resps"][0][0] == ref.text
    assert any(s["resps"][0][0].strip() for s in samples)


def test_lmeval_environment_is_its_own():
    """lm-eval lives in .venv-lmeval, never in the project's environment (its pins are its own)."""
    out = subprocess.run(
        [str(Q.lmeval_python()), "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True
    )
    assert Path(out.stdout.strip()) != Path(sys.prefix)
