"""Log-probabilities, prompt scoring (`echo`) and `n > 1`: in the decoding loop (`Sequence.logprobs`,
`prompt_logprobs`) and through `mtp serve` (OpenAI shapes, streamed and not, the official client), each
checked against an independent computation: a plain forward pass's log-softmax, `ntp`'s records, or
single requests / `mtp generate` with the seeds the choices get."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import LiveServer, Oracle, client_for, make_app, save_tiny, tiny_model

from mtp.core.decoding.decode import Sequence, stream
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from mtp.core.engine import Engine, EngineConfig  # noqa: E402

PROMPT = [5, 17, 3, 44, 9, 5, 17, 3]
TOL = 1e-5  # absolute and relative: the tiny model's peaked logits reach ~1e-5 between block widths (float32)


def forward_logprobs(model, ids: list[int], mask_id: int | None = None) -> torch.Tensor:
    """[T, V] log-softmax of one plain forward pass over `ids` (the mask token, never a prediction, at -inf)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].float()
        if mask_id is not None:
            logits[:, mask_id] = float("-inf")
        return torch.log_softmax(logits, -1)


def oracle(truth: list[int], prompt_len: int) -> Oracle:
    """Drafts the true continuation (`truth`), every third pass with a wrong second token, and as a tree
    a wrong sibling beside it: passes accept 0, 1 or several drafts, so every row of a pass is read."""
    return Oracle(truth, prompt_len, wrong_every=3, sibling=True, vocab=97)


def decode(model, strategy: str, n: int = 30, proposer=None, **kw) -> Sequence:
    seq = Sequence(
        list(PROMPT),
        Strategy.parse(strategy),
        SamplingParams(max_new_tokens=n),
        proposer or oracle([], len(PROMPT)),
        **kw,
    )
    for _ in stream(model, seq, None):
        pass
    return seq


# ---- the decoding loop ----------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["verify:3", "verify:5", "tree:4"])
def test_greedy_logprobs_of_lossless_strategies_equal_ntp_and_a_plain_forward(strategy):
    model = tiny_model(0)
    ntp = decode(model, "ntp", logprobs=5)
    seq = decode(model, strategy, proposer=oracle(ntp.output, len(PROMPT)), logprobs=5)
    assert seq.output == ntp.output
    assert seq.stats.forward_passes < len(seq.output)  # drafts were accepted: their rows were read
    assert len(seq.token_logprobs) == len(seq.output)
    ref = forward_logprobs(model, PROMPT + ntp.output)[len(PROMPT) - 1 : -1]  # row t predicts output[t]
    for t, (a, b) in enumerate(zip(seq.token_logprobs, ntp.token_logprobs)):
        assert a.token == b.token == seq.output[t]
        assert a.logprob == pytest.approx(b.logprob, abs=TOL, rel=TOL)
        assert a.logprob == pytest.approx(float(ref[t, a.token]), abs=1e-4)
        assert [x for x, _ in a.top] == [x for x, _ in b.top] == ref[t].topk(5).indices.tolist()
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=TOL, rel=TOL)


def test_prompt_logprobs_equal_a_plain_forward_and_leave_other_rows_alone():
    """A prefill pass of two rows, one scoring its prompt (every position read) and one not: the scores
    equal a plain forward pass's, and the other row decodes exactly as alone."""
    from mtp.core.decoding.decode import block_slack, decode_step
    from mtp.core.runtime.cache import KVCache

    model = tiny_model(0)
    other_prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # longer: the rows' blocks differ
    alone = decode(model, "ntp", 12)
    other_alone = Sequence(other_prompt, Strategy(), SamplingParams(max_new_tokens=12), oracle([], 11))
    for _ in stream(model, other_alone, None):
        pass

    seqs = [
        Sequence(list(PROMPT), Strategy(), SamplingParams(max_new_tokens=12), oracle([], 8), logprobs=3),
        Sequence(list(other_prompt), Strategy(), SamplingParams(max_new_tokens=12), oracle([], 11), slot=1),
    ]
    seqs[0].prompt_logprobs = True
    cache = KVCache.for_model(model, 2, 64 + block_slack(1))
    with torch.inference_mode():
        while not all(s.finished for s in seqs):
            decode_step(model, cache, [s for s in seqs if not s.finished], None)
    assert seqs[0].output == alone.output and seqs[1].output == other_alone.output
    ref = forward_logprobs(model, PROMPT)
    scored = seqs[0].prompt_token_logprobs
    assert [r.token for r in scored] == PROMPT[1:]
    for t, r in enumerate(scored):
        assert r.logprob == pytest.approx(float(ref[t, PROMPT[t + 1]]), abs=TOL, rel=TOL)
        assert [x for x, _ in r.top] == ref[t].topk(3).indices.tolist()
    assert seqs[1].prompt_token_logprobs == [] and seqs[1].token_logprobs == []


def test_logprobs_stay_in_step_with_an_output_cut_by_a_stop_string():
    model = tiny_model(0)
    full = decode(model, "ntp", 30, logprobs=0)
    stop = str(full.output[6])
    seq = Sequence(
        list(PROMPT),
        Strategy.parse("verify:3"),
        SamplingParams(max_new_tokens=30, stop=[stop]),
        oracle(full.output, len(PROMPT)),
        decode_text=lambda ids: " ".join(map(str, ids)),
        logprobs=0,
    )
    for _ in stream(model, seq, None):
        pass
    assert seq.finish_reason == "stop" and len(seq.output) < len(full.output)
    assert [r.token for r in seq.token_logprobs] == seq.output
    assert [r.logprob for r in seq.token_logprobs] == pytest.approx(
        [r.logprob for r in full.token_logprobs[: len(seq.output)]], abs=TOL
    )


@pytest.mark.parametrize("strategy", ["static:3", "conf_adapt:0.9"])
def test_a_lossy_strategy_records_no_logprobs(strategy):
    with pytest.raises(ValueError, match="lossless"):
        Sequence(list(PROMPT), Strategy.parse(strategy), SamplingParams(), oracle([], 8), logprobs=1)


# ---- the server ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # prompt lookup drafts (no adapter needed); the tiny model repeats itself, so drafts get accepted
    d = save_tiny(tmp_path_factory.mktemp("serve-lp") / "tiny")
    return Engine.load(EngineConfig(model=str(d), adapter="none", proposer="lookup"))


def post(srv, path, body):
    return httpx.post(srv.url + path, json={"model": "tiny", **body}, timeout=60)


def sse(srv, path, body) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json={"model": "tiny", "stream": True, **body}, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


PROMPT_TEXT = "abcabcabcabc"
REPEATS = "aaaaaaaa"  # the tiny model answers "yyyy...": prompt lookup's drafts are accepted, then rejected


@pytest.mark.parametrize("strategy", ["verify:3", "tree:4"])
def test_completion_logprobs_of_lossless_strategies_equal_ntp(engine, strategy):
    with LiveServer(make_app(engine)) as srv:
        got = {}
        for s in ("ntp", strategy):
            r = post(
                srv, "/v1/completions", {"prompt": REPEATS, "max_tokens": 24, "logprobs": 3, "mtp": {"strategy": s}}
            )
            assert r.status_code == 200, r.text
            got[s] = r.json()
        parts = sse(
            srv,
            "/v1/completions",
            {"prompt": REPEATS, "max_tokens": 24, "logprobs": 3, "mtp": {"strategy": strategy}},
        )
    a, b = got["ntp"]["choices"][0], got[strategy]["choices"][0]
    assert got[strategy]["mtp"]["tokens_per_forward"] > 1  # drafts accepted
    assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    assert "".join(b["logprobs"]["tokens"]) == b["text"]
    assert b["logprobs"]["text_offset"] == [len("".join(b["logprobs"]["tokens"][:i])) for i in range(len(b["text"]))]
    assert b["logprobs"]["token_logprobs"] == pytest.approx(a["logprobs"]["token_logprobs"], abs=TOL, rel=TOL)
    for x, y in zip(a["logprobs"]["top_logprobs"], b["logprobs"]["top_logprobs"]):
        assert list(x) == list(y) and list(x.values()) == pytest.approx(list(y.values()), abs=TOL, rel=TOL)
    # in-process: the same numbers from the decoding loop
    seq = engine.new_sequence(engine.encode(REPEATS, chat=False), "ntp", SamplingParams(max_new_tokens=24), logprobs=3)
    for _ in engine.stream(seq):
        pass
    assert a["logprobs"]["token_logprobs"] == pytest.approx([r.logprob for r in seq.token_logprobs], abs=TOL, rel=TOL)
    # streamed: the same text, tokens and values, spread over the chunks
    streamed = [p["choices"][0] for p in parts if p["choices"]]
    assert "".join(c["text"] for c in streamed) == b["text"]
    tokens = [t for c in streamed if c["logprobs"] for t in c["logprobs"]["tokens"]]
    values = [v for c in streamed if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    offsets = [o for c in streamed if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert tokens == b["logprobs"]["tokens"] and offsets == b["logprobs"]["text_offset"]
    assert values == pytest.approx(b["logprobs"]["token_logprobs"], abs=TOL, rel=TOL)


def test_chat_logprobs_with_the_openai_client(engine):
    msgs = [{"role": "user", "content": "abcabc"}]
    with LiveServer(make_app(engine)) as srv:
        c = client_for(srv)
        kw = dict(model="tiny", messages=msgs, max_tokens=20, temperature=0, logprobs=True, top_logprobs=4)
        full = c.chat.completions.create(**kw, extra_body={"mtp": {"strategy": "verify:3"}})
        ntp = c.chat.completions.create(**kw, extra_body={"mtp": {"strategy": "ntp"}})
        parts = list(c.chat.completions.create(**kw, stream=True, extra_body={"mtp": {"strategy": "tree:4"}}))
        plain = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0)
    content = full.choices[0].logprobs.content
    assert "".join(e.token for e in content) == full.choices[0].message.content == plain.choices[0].message.content
    assert plain.choices[0].logprobs is None
    assert [e.logprob for e in content] == pytest.approx(
        [e.logprob for e in ntp.choices[0].logprobs.content], abs=TOL, rel=TOL
    )
    for e in content:
        assert len(e.top_logprobs) == 4 and bytes(e.bytes).decode() == e.token
        assert e.top_logprobs[0].logprob >= e.logprob - TOL  # the likeliest first
    streamed = [e for p in parts if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOL, rel=TOL)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_like_a_plain_forward(engine, max_tokens):
    """The loglikelihood request of lm-eval (echo, logprobs 1, max_tokens 1) and pure prompt scoring
    (max_tokens 0), on token ids, under a lossy server default (scoring runs as ntp)."""
    ids = engine.encode("The cat sat on the mat.", chat=False)
    ref = forward_logprobs(engine.model, ids, engine.mask_id)
    with LiveServer(make_app(engine, strategy="conf_adapt:0.9")) as srv:
        r = post(
            srv,
            "/v1/completions",
            {"prompt": [ids], "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0},
        )
        parts = sse(srv, "/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    lp = ch["logprobs"]
    n = len(ids) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [float(ref[t, ids[t + 1]]) for t in range(len(ids) - 1)]
    assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=TOL, rel=TOL)
    for t in range(1, len(ids)):  # the top-1 alternative: the argmax of the same distribution
        assert list(lp["top_logprobs"][t].values()) == pytest.approx([float(ref[t - 1].max())], abs=TOL, rel=TOL)
    prompt_text = engine.decode_text(ids)
    assert ch["text"].startswith(prompt_text) and lp["text_offset"][: len(ids)] == [
        len(engine.decode_text(ids[:i])) for i in range(len(ids))
    ]
    assert body["usage"]["completion_tokens"] == max_tokens
    if max_tokens:  # the generated token: the argmax after the prompt
        assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1].max()), abs=TOL, rel=TOL)
    else:
        assert ch["text"] == prompt_text and ch["finish_reason"] == "length"
    streamed = [p["choices"][0] for p in parts if p["choices"]]
    assert "".join(c["text"] for c in streamed) == ch["text"]
    values = [v for c in streamed if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert values[0] is None and values[1:] == pytest.approx(lp["token_logprobs"][1:], abs=TOL, rel=TOL)


def test_greedy_n_gives_n_identical_choices(engine):
    with LiveServer(make_app(engine)) as srv:
        one = post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 16, "logprobs": 2}).json()
        r = post(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 16, "n": 3, "logprobs": 2}).json()
        chat = post(
            srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "n": 2}
        ).json()
        parts = sse(srv, "/v1/completions", {"prompt": "Hello", "max_tokens": 16, "n": 3})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert all(
        c["text"] == one["choices"][0]["text"] and c["logprobs"] == one["choices"][0]["logprobs"] for c in r["choices"]
    )
    assert r["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    assert len(chat["choices"]) == 2 and chat["choices"][0]["message"] == chat["choices"][1]["message"]
    texts = [
        "".join(p["choices"][0]["text"] for p in parts if p["choices"] and p["choices"][0]["index"] == i)
        for i in range(3)
    ]
    assert texts == [one["choices"][0]["text"]] * 3


@pytest.mark.parametrize("strategy", ["ntp", "verify:3"])
def test_seeded_sampling_n_gives_each_seeds_sample(engine, strategy):
    """n = 2 at temperature 0.8, seed s: choice i is the sample `mtp generate` draws with seed s + i
    (choice 1 decodes from choice 0's prefill), streamed or not."""
    seed, n_tok = 11, 24
    refs = [
        engine.generate(
            PROMPT_TEXT, strategy, SamplingParams(temperature=0.8, seed=seed + i, max_new_tokens=n_tok), chat=False
        )
        for i in range(2)
    ]
    assert refs[0].token_ids != refs[1].token_ids  # two different samples, so the check below can fail
    body = {
        "prompt": PROMPT_TEXT,
        "max_tokens": n_tok,
        "n": 2,
        "temperature": 0.8,
        "seed": seed,
        "mtp": {"strategy": strategy},
    }
    with LiveServer(make_app(engine)) as srv:
        r = post(srv, "/v1/completions", body).json()
        parts = sse(srv, "/v1/completions", body)
    assert [c["text"] for c in r["choices"]] == [x.text for x in refs]
    assert [c["shared_prefill"] for c in r["mtp"]["choices"]] == [False, True]
    texts = [
        "".join(p["choices"][0]["text"] for p in parts if p["choices"] and p["choices"][0]["index"] == i)
        for i in range(2)
    ]
    assert texts == [x.text for x in refs]


BAD = [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"n": 9}, "n"),
    ("/v1/chat/completions", {"logprobs": True, "mtp": {"strategy": "conf_adapt:0.9"}}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 1, "mtp": {"strategy": "static:3"}}, "logprobs"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 9}, "n"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 0, "logprobs": 1}, "max_tokens"),
]


def test_bad_input_is_one_line_400_and_nothing_else_is_affected(engine):
    from fastapi.testclient import TestClient

    with TestClient(make_app(engine)) as c:
        before = c.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 8}).json()
        for path, extra, param in BAD:
            base = {"model": "tiny", "max_tokens": 8}
            base.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hello"})
            r = c.post(path, json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", extra
            assert "\n" not in err["message"] and len(err["message"]) < 200
        after = c.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 8}).json()
        # a lossy strategy that generates one token is the model's own: allowed, run as ntp
        one = c.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 1, "logprobs": 1, "mtp": {"strategy": "static:3"}},
        )
        health = c.get("/health").json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert one.status_code == 200 and one.json()["mtp"]["strategy"] == "ntp"
    assert health["running"] == 0 and health["queued"] == 0
