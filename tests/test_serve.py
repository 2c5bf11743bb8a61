"""`mtp serve` on a tiny random model with a character-level tokenizer: OpenAI schema round-trips
(the official `openai` client, streaming and not), outputs identical to `mtp generate` under
concurrent mixed strategies, queueing, disconnects, every bad input, the API key, SIGTERM, shadow
mode and the adaptive K policy."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from helpers import LiveServer, SlowModel, client_for, free_port, make_app, reference, slow_engine, tiny_model  # noqa: E402

from mtp.core.decoding.sampling import SamplingParams  # noqa: E402
from mtp.core.engine import Engine, EngineConfig  # noqa: E402
from mtp.serving import shadow  # noqa: E402
from mtp.serving.adaptive import AdaptiveK  # noqa: E402
from mtp.serving.scheduler import Request, Scheduler, SchedulerConfig  # noqa: E402


# ---- schema round-trips with the official client ---------------------------------------------------
def test_openai_client_round_trip(engine):
    with LiveServer(make_app(engine)) as srv:
        c = client_for(srv)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        ref = reference(engine, "Hello", "static:2", 20, chat=False)
        r = c.completions.create(
            model="tiny", prompt="Hello", max_tokens=20, temperature=0, extra_body={"mtp": {"strategy": "static:2"}}
        )
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == ref.prompt_tokens
        assert r.model_extra["mtp"]["tokens_per_forward"] == pytest.approx(ref.summary["tokens_per_forward"], abs=1e-3)

        parts = list(
            c.completions.create(
                model="tiny",
                prompt="Hello",
                max_tokens=20,
                temperature=0,
                stream=True,
                extra_body={"mtp": {"strategy": "static:2"}},
            )
        )
        assert "".join(p.choices[0].text for p in parts) == ref.text
        assert parts[-1].choices[0].finish_reason == ref.finish_reason

        ref = reference(engine, "Hi there", "verify:3", 30, chat=True)
        msgs = [{"role": "user", "content": "Hi there"}]
        r = c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=30, temperature=0, extra_body={"mtp": {"strategy": "verify:3"}}
        )
        assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
        parts = list(
            c.chat.completions.create(
                model="tiny",
                messages=msgs,
                max_tokens=30,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"mtp": {"strategy": "verify:3"}},
            )
        )
        assert parts[0].choices[0].delta.role == "assistant"
        assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == ref.text
        assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == ref.finish_reason
        assert parts[-1].usage.completion_tokens == len(ref.token_ids)


def test_sse_wire_format(engine):
    with LiveServer(make_app(engine)) as srv:
        with httpx.stream(
            "POST",
            srv.url + "/v1/completions",
            json={"model": "tiny", "prompt": "abc", "max_tokens": 8, "stream": True},
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(ch["object"] == "text_completion" for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stop", ["e", "ab"])
def test_stop_strings_streamed_and_not(engine, stop):
    ref = reference(engine, "Tell me", "static:3", 60, chat=True, stop=[stop])
    with LiveServer(make_app(engine)) as srv:
        c = client_for(srv)
        kw = dict(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me"}],
            max_tokens=60,
            temperature=0,
            stop=[stop],
            extra_body={"mtp": {"strategy": "static:3"}},
        )
        full = c.chat.completions.create(**kw).choices[0].message.content
        streamed = "".join(p.choices[0].delta.content or "" for p in c.chat.completions.create(stream=True, **kw))
    assert full == streamed == ref.text
    assert stop not in full


# ---- continuous batching ------------------------------------------------------------------------
JOBS = [
    ("Hello", "ntp", 40),
    ("What is 2+2?", "verify:3", 53),
    ("abc def", "static:2", 66),
    ("The quick brown fox", "conf_adapt:0.6", 79),
    ("x", "static:3", 30),
    ("Tell me a story", "verify:2", 90),
    ("Once upon", "conf_adapt:0.9:4", 45),
]


def ask_all(srv, jobs):
    """Every (prompt, strategy, max_tokens) job as a chat request at once; the responses in job order."""
    c = client_for(srv)

    def ask(job):
        p, s, n = job
        return c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": p}],
            max_tokens=n,
            temperature=0,
            extra_body={"mtp": {"strategy": s}},
        )

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(ask, jobs))


@pytest.mark.parametrize("adaptive", [False, True])
def test_concurrent_mixed_strategies_equal_generate(engine, adaptive):
    """7 clients at once, 3 batch rows: joins, leaves (rows moved), queueing; every output equals
    `mtp generate` alone. With the adaptive policy on (flat cost model, measured proposal cost) K may
    be capped, which keeps the lossless strategies identical."""
    refs = [reference(engine, p, s, n, chat=True) for p, s, n in JOBS]
    app = make_app(engine, pass_time=(lambda q: 1.0) if adaptive else None, max_batch=3, max_model_len=200)
    with LiveServer(app) as srv:
        outs = ask_all(srv, JOBS)
        sched = app.state.mtp.scheduler
        assert adaptive or sched.capped_passes == 0
        assert sched.passes < sum(o.model_extra["mtp"]["forward_passes"] for o in outs)  # rows shared passes
    for out, ref, (_, s, _) in zip(outs, refs, JOBS):
        if adaptive and not s.startswith(("ntp", "verify")):
            continue  # a capped conf_adapt / static pass emits what conf_adapt:TAU:K would
        assert out.choices[0].message.content == ref.text
        assert out.usage.completion_tokens == len(ref.token_ids)


TREE_JOBS = [
    ("abcabcabcabc", "tree:8", 60),
    ("la la la la la", "tree:4", 50),
    ("Hello", "verify:3", 40),
    ("xyxyxyxy xyxy", "tree:16", 70),
    ("The quick brown fox", "ntp", 30),
]


@pytest.mark.parametrize("adaptive", [False, True])
def test_concurrent_trees_equal_ntp(tiny_dir, adaptive):
    """Token trees in the server: rows with different trees (and chains, and plain rows) share passes,
    3 batch rows for 5 clients; with the adaptive policy capping K the trees shrink (their top nodes
    kept); every output is ntp's."""
    lookup = Engine.load(EngineConfig(model=str(tiny_dir), adapter="none", proposer="lookup"))
    refs = [reference(lookup, p, "ntp", n, chat=True) for p, _, n in TREE_JOBS]
    app = make_app(
        lookup, pass_time=(lambda q: 0.01 * (1 + q / 8)) if adaptive else None, max_batch=3, max_model_len=200
    )
    with LiveServer(app) as srv:
        outs = ask_all(srv, TREE_JOBS)
        policy = app.state.mtp.scheduler.policy
    if adaptive:  # tree rows' drafting was timed apart from the chain row's (the same proposer), per row and node
        assert "lookup" in policy.node_fit
    for out, ref, (_, s, _) in zip(outs, refs, TREE_JOBS):
        assert out.choices[0].message.content == ref.text, s
        assert out.usage.completion_tokens == len(ref.token_ids)
    if not adaptive:  # the repetitive prompts let lookup's trees through
        assert max(o.model_extra["mtp"]["tokens_per_forward"] for o in outs[:2]) > 1.0


def test_opted_out_requests_are_never_capped(engine):
    """`"mtp": {"adaptive": false}`: a steep cost model caps the other rows to K=1, but the opted-out
    lossy rows keep their K and emit exactly what `mtp generate` does."""
    jobs = [
        ("The quick brown fox", "conf_adapt:0.6", 40, False),
        ("x", "static:3", 30, False),
        ("Tell me a story", "verify:2", 40, True),
    ]
    refs = [reference(engine, p, s, n, chat=True) for p, s, n, _ in jobs]
    app = make_app(engine, pass_time=lambda q: float(q), max_batch=3, max_model_len=200)
    with LiveServer(app) as srv:
        c = client_for(srv)

        def ask(job):
            p, s, n, adaptive = job
            return c.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": p}],
                max_tokens=n,
                temperature=0,
                extra_body={"mtp": {"strategy": s, "adaptive": adaptive}},
            )

        with ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(pool.map(ask, jobs))
        caps = httpx.get(srv.url + "/metrics").text
    assert float(caps.split('mtp_k_cap_passes_total{k="1"} ')[1].split()[0]) > 0  # the verify row was capped
    for out, ref, (_, s, _, adaptive) in zip(outs, refs, jobs):
        assert out.choices[0].message.content == ref.text
        assert (out.model_extra["mtp"]["capped_passes"] > 0) == adaptive, s


def test_newcomers_are_prefilled_together_within_the_token_budget(engine, monkeypatch):
    from types import SimpleNamespace

    import mtp.serving.scheduler as S
    from mtp.core.decoding.batching import prefill_group

    monkeypatch.setattr(S, "PREFILL_TOKENS", 100)
    seqs = [SimpleNamespace(pending=[0] * n) for n in (30, 20, 40, 10, 90)]
    assert prefill_group(seqs, S.PREFILL_TOKENS) == seqs[:2]  # a third would pad 3 rows to 40: 120 > 100
    assert prefill_group(seqs[3:], S.PREFILL_TOKENS) == seqs[3:4]  # 10 then 90: 2 x 90 > 100
    assert prefill_group(seqs[4:], S.PREFILL_TOKENS) == seqs[4:]  # one prompt always goes, whatever its length
    # a wave of 4 requests: one prefill pass for all, outputs still those of generate alone
    jobs = [("Hello", "verify:3", 20), ("abc", "conf_adapt:0.6", 20), ("xyz", "ntp", 20), ("q", "static:2", 20)]
    sched, got = scheduled(engine, jobs, config=dict(max_batch=4, max_model_len=100))
    assert sched.prefill_passes == 1
    for r, (p, st, n) in zip(got, jobs):
        assert r.seq.output == reference(engine, p, st, n, chat=True).token_ids


def scheduled(engine, jobs, **cfg):
    """Run (prompt, strategy, max_tokens) jobs through a Scheduler directly; return the Requests."""
    sched = Scheduler(
        engine.model, engine.mask_id, SchedulerConfig(**cfg.pop("config", {})), cfg.pop("pass_time", None)
    )
    reqs = [Request(engine.new_sequence(engine.encode(p), s, SamplingParams(max_new_tokens=n))) for p, s, n in jobs]
    for r in reqs:
        sched.submit(r)
    sched.start()
    for r in reqs:
        assert r.done.wait(60)
    sched.stop()
    return sched, reqs


def test_queue_waits_when_budget_is_full(engine):
    """A budget for one request at a time: the others queue, FIFO, none dropped."""
    jobs = [("Hello", "verify:2", 30), ("abc", "static:2", 30), ("xyz", "ntp", 30)]
    budget = max(len(engine.encode(p)) + n + 2 for p, _, n in jobs)
    sched, reqs = scheduled(engine, jobs, config=dict(max_batch=3, max_model_len=100, max_cache_tokens=budget))
    for a, b in zip(reqs, reqs[1:]):
        assert b.t_admitted >= a.t_finish  # never two at once, first come first served
    for r, (p, s, n) in zip(reqs, jobs):
        assert r.seq.output == reference(engine, p, s, n, chat=True).token_ids


def test_request_over_budget_is_refused(engine):
    sched = Scheduler(
        engine.model, engine.mask_id, SchedulerConfig(max_batch=2, max_model_len=100, max_cache_tokens=20)
    )
    with pytest.raises(ValueError, match="max-cache-tokens"):
        sched.submit(Request(engine.new_sequence(engine.encode("Hello"), "ntp", SamplingParams(max_new_tokens=50))))


def test_disconnect_frees_the_row(engine):
    app = make_app(slow_engine(engine), max_batch=1, max_model_len=250)
    state = app.state.mtp
    with LiveServer(app) as srv:
        with httpx.stream(
            "POST",
            srv.url + "/v1/completions",
            json={"model": "tiny", "prompt": "abc", "max_tokens": 200, "stream": True},
        ) as r:
            next(r.iter_lines())  # one event, then hang up
        for _ in range(200):
            if state.scheduler.running == 0:
                break
            time.sleep(0.05)
        assert state.scheduler.running == 0
        assert state.metrics.value("mtp_requests_total", endpoint="completions", status="cancelled") == 1
        assert state.metrics.value("mtp_generation_tokens_total") < 200
        # the single row is free again: the next request is served
        r = httpx.post(
            srv.url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 5}, timeout=30
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


# ---- bad input, auth ----------------------------------------------------------------------------
LONG = "y" * 300  # over the tiny model's 256-token window
BAD = [
    ("/v1/completions", b"{not json", "invalid_request_error", None),
    ("/v1/completions", b"[1, 2]", "invalid_request_error", None),
    ("/v1/completions", {"model": "tiny"}, "invalid_request_error", "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, "invalid_request_error", "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, "invalid_request_error", "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10_000}, "invalid_request_error", "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": LONG}, "invalid_request_error", "prompt"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "temperature": "hot"},
        "invalid_request_error",
        "temperature",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 3.0}, "invalid_request_error", "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, "invalid_request_error", "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 9}, "invalid_request_error", "n"),  # over max_n 8
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "mtp": {"strategy": "fast"}},
        "invalid_request_error",
        "mtp.strategy",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "mtp": {"strategy": "static:0"}},
        "invalid_request_error",
        "mtp.strategy",
    ),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "mtp": {"strategy": "static:999"}},
        "invalid_request_error",
        "mtp.strategy",
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "mtp": {"strategi": "ntp"}}, "invalid_request_error", "mtp"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "mtp": {"adaptive": "no"}}, "invalid_request_error", "mtp"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 99999]}, "invalid_request_error", "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "invalid_request_error", "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, "invalid_request_error", "messages"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": LONG}]},
        "invalid_request_error",
        "messages",
    ),
]


@pytest.mark.parametrize("path,body,etype,param", BAD)
def test_bad_input_is_400(engine, path, body, etype, param):
    from fastapi.testclient import TestClient

    with TestClient(make_app(engine)) as c:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = c.post(path, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == etype and err["param"] == param and err["message"]


def test_unknown_model_is_404_and_strategy_needing_adapter_is_400(engine):
    from fastapi.testclient import TestClient

    no_mask = Engine(engine.loaded, engine.config)
    no_mask.model = SlowModel(engine.model, 0.0)
    no_mask.model.__dict__["config"] = type(engine.model.config)(
        **{**engine.model.config.to_dict(), "mask_token_id": None}
    )
    with TestClient(make_app(no_mask)) as c:
        r = c.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "mtp": {"strategy": "static:2"}})
        assert r.status_code == 400 and "adapter" in r.json()["error"]["message"]
        assert c.get("/v1/nothing").status_code == 404 and "error" in c.get("/v1/nothing").json()


def test_api_key_enforced(engine):
    with LiveServer(make_app(engine, api_key="s3cret")) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(srv.url + path).status_code == 401
            assert httpx.get(srv.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(srv.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client_for(srv, "wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
        r = client_for(srv, "s3cret").completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2


def test_metrics_exposition(engine):
    from fastapi.testclient import TestClient

    with TestClient(make_app(engine)) as c:
        for s in ("ntp", "static:2"):
            assert (
                c.post(
                    "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 6, "mtp": {"strategy": s}}
                ).status_code
                == 200
            )
        c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 0})
        text = c.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("mtp_requests_total", endpoint="completions", status="ok") == 2
    assert value("mtp_requests_total", endpoint="completions", status="invalid") == 1
    assert value("mtp_generation_tokens_total") == 12
    assert value("mtp_tokens_per_forward", strategy="ntp") == 1.0
    assert value("mtp_tokens_per_forward", strategy="static:2") == 2.0
    assert value("mtp_acceptance_by_position", strategy="static:2", position="1") == 1.0
    assert value("mtp_request_latency_seconds_count") == 2 and value("mtp_queue_length") == 0


# ---- SIGTERM -------------------------------------------------------------------------------------
SERVER_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from helpers import make_app, slow_engine
from mtp.core.engine import Engine, EngineConfig
from mtp.serving.app import serve_app
engine = slow_engine(Engine.load(EngineConfig(model={model!r}, adapter="none")), 0.02)
sys.exit(serve_app(make_app(engine), "127.0.0.1", {port}, "warning", 300))  # ample on a loaded machine
"""


def test_sigterm_finishes_running_requests_and_exits_0(tiny_dir, tmp_path):
    port = free_port()
    script = tmp_path / "srv.py"
    script.write_text(SERVER_SCRIPT.format(tests=str(Path(__file__).parent), model=str(tiny_dir), port=port))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        lines = []
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=60,
            json={"model": "tiny", "prompt": "abc", "max_tokens": 60, "stream": True},
        ) as r:
            it = r.iter_lines()
            lines.append(next(it))
            proc.send_signal(signal.SIGTERM)  # mid-stream: ~60 passes of 20 ms are still to come
            lines += list(it)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [ln for ln in lines if ln]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health")


def test_cli_rejects_bad_flags_in_one_line():
    for argv in (["serve", "--strategy", "bogus"], ["serve", "--port", "0"], ["shadow-report", "/nonexistent.jsonl"]):
        r = subprocess.run([sys.executable, "-m", "mtp.cli", *argv], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.startswith("mtp: error:") and len(r.stderr.strip().splitlines()) == 1


# ---- shadow mode -----------------------------------------------------------------------------------
def test_shadow_mode_logs_divergence_and_report(engine, tmp_path, capsys):
    log = tmp_path / "shadow.jsonl"
    app = make_app(engine, shadow_rate=1.0, shadow_log=str(log))
    from fastapi.testclient import TestClient

    jobs = [("Hello", "static:3"), ("abc", "verify:3"), ("zz", "ntp")]
    with TestClient(app) as c:
        for p, s in jobs:
            assert (
                c.post(
                    "/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 24, "mtp": {"strategy": s}}
                ).status_code
                == 200
            )
        for _ in range(400):
            if log.exists() and len(log.read_text().splitlines()) == 2:
                break
            time.sleep(0.05)
        text = c.get("/metrics").text
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["strategy"] for r in recs] == ["static:3", "verify:3"]  # ntp requests are not shadowed
    for rec, (p, s) in zip(recs, jobs):
        mine = reference(engine, p, s, 24, chat=False)
        ntp = reference(engine, p, "ntp", 24, chat=False)
        assert rec["exact_match"] == (mine.token_ids == ntp.token_ids)
        assert rec["first_divergence"] == shadow.first_divergence(mine.token_ids, ntp.token_ids)
        assert rec["latency_ratio"] > 0 and rec["shadow_tokens"] == len(ntp.token_ids)
    assert recs[1]["exact_match"] is True  # verify is lossless
    assert "mtp_shadow_requests_total 2" in text
    assert f"mtp_shadow_exact_match_total {sum(r['exact_match'] for r in recs)}" in text

    from mtp.cli import main

    assert main(["shadow-report", str(log)]) == 0
    out = capsys.readouterr().out
    assert "static:3" in out and "verify:3" in out and "all" in out
    assert main(["shadow-report", str(log), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["verify:3"]["exact_match_rate"] == 1.0 and summary["all"]["requests"] == 2


def test_shadow_compare():
    assert shadow.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert shadow.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert shadow.first_divergence([1, 2], [1, 2, 3]) == 2
    rec = shadow.compare([1, 2], "so #### 1,200", [1, 3], "The answer is 1200.")
    assert rec == {
        "exact_match": False,
        "first_divergence": 1,
        "answer": "1200",
        "shadow_answer": "1200",
        "answer_agree": True,
    }
    assert shadow.compare([1], "no number", [1], "none")["answer_agree"] is None
    assert shadow.compare([1], "it is 3", [2], "it is 4")["answer_agree"] is False


def test_shadow_report_rejects_garbage(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"a": 1}\n')
    with pytest.raises(ValueError, match="not a shadow record"):
        shadow.read_log(bad)


# ---- adaptive K ------------------------------------------------------------------------------------
class FakeSeq:
    def __init__(self, strategy, pending=1, drafts=0, branch=True):
        from mtp.core.decoding.proposers import Guesses, MaskProposer
        from mtp.core.decoding.strategy import Strategy

        self.strategy, self.proposer = Strategy.parse(strategy), MaskProposer(branch)
        self.pending, self.drafts = [0] * pending, Guesses([0] * drafts, [0.0] * drafts)


def test_adaptive_policy_choices():
    seqs = [FakeSeq("conf_adapt:0.9:4")]
    # flat cost: proposals are free, use the whole K
    assert AdaptiveK(lambda q: 1.0).choose(seqs) == 4
    # cost proportional to tokens fed: with the 0.5 prior K=2 yields 1.5 tokens for 2 tokens' time -> K=1
    assert AdaptiveK(lambda q: float(q)).choose(seqs) == 1
    # t(q) = 1 + 0.1 q: K=1 -> 1/1.1; K=2 -> 1.5/1.2; K=3 -> 1.75/1.3; K=4 -> 1.875/1.4 -> K=3 best
    assert AdaptiveK(lambda q: 1 + 0.1 * q).choose(seqs) == 3
    # 16 rows: q = 16 x block; the same linear cost now forbids proposals
    assert AdaptiveK(lambda q: 1 + 0.1 * q).choose(seqs * 16) == 1
    # no row can propose -> nothing to decide
    assert AdaptiveK(lambda q: 1.0).choose([FakeSeq("ntp"), FakeSeq("verify:1")]) is None


def test_adaptive_policy_decides_verify_on_its_steady_state():
    # a verify row with or without drafts in hand gets the same cap: it is priced as it runs under that cap
    # (k-1 drafts + k-1 masks); priced on this pass's drafts, a row without drafts looked cheap (K=4 wins),
    # the next pass with 3 drafts dear (capped, drafts dropped), and verify alternated down to 1 token a pass
    cost = lambda q: 1 + 0.25 * q  # noqa: E731
    without, with_drafts = FakeSeq("verify:4", drafts=0, branch=False), FakeSeq("verify:4", drafts=3, branch=False)
    assert AdaptiveK(cost).choose([without]) == AdaptiveK(cost).choose([with_drafts])
    # the steady-state prices: K=2 -> 1.5 tokens over t(3); K=4 -> 1.875 over t(7) -> K=2 beats K=4 and K=1
    assert AdaptiveK(cost).choose([without]) == 2
    assert AdaptiveK.block(without, 4, steady=True) == 7 and AdaptiveK.block(without, 4) == 4
    # branched mask groups (the default): K=4 feeds 1 + 3 drafts + 4 groups of 3 masks
    without, with_drafts = FakeSeq("verify:4", drafts=0), FakeSeq("verify:4", drafts=3)
    assert AdaptiveK.block(without, 4, steady=True) == 16 and AdaptiveK.block(without, 4) == 4
    assert AdaptiveK.block(with_drafts, 4) == 16 and AdaptiveK.block(with_drafts, 2) == 4
    # t(q) = 1 + 0.25 q now prefers K=1 (K=2: 1.5 over t(4) = 2.0 < 1 over t(2)); 1 + 0.05 q: K=2 (1.5/1.2)
    assert AdaptiveK(cost).choose([without]) == AdaptiveK(cost).choose([with_drafts]) == 1
    assert AdaptiveK(lambda q: 1 + 0.05 * q).choose([with_drafts]) == 2


def test_adaptive_policy_prices_emitted_guesses_as_next_pending():
    # a conf_adapt row feeds back what it emitted: with the 0.5 prior, k=3 emits 1 + 0.5 + 0.25 tokens
    pol = AdaptiveK(lambda q: 1.0)
    one, ver = FakeSeq("conf_adapt:0.9:3"), FakeSeq("verify:3")
    assert pol.steady_pending([one], 3) == pytest.approx(1.75)
    # two rows pad to the longer: P(max >= 2) = 1 - 0.5^2, P(max >= 3) = 1 - 0.75^2
    assert pol.steady_pending([one, one], 3) == pytest.approx(1 + 0.75 + 0.4375)
    assert pol.steady_pending([one, ver], 3) == pytest.approx(1.75)  # verify rows feed 1 pending
    # steady block: expected pending + 2 masks; verify: 1 pending + 2 drafts + 3 groups of 2 masks
    assert AdaptiveK.block(one, 3, steady=True, pending=1.75) == pytest.approx(3.75)
    assert AdaptiveK.block(ver, 3, steady=True) == 9


def test_adaptive_policy_needs_a_clear_gain_to_propose():
    # static:2 at the 0.5 prior: K=2 yields 1.5 tokens over a block of 1.5 pending + 1 mask; with
    # t(q) = 0.7 + 0.3 q that is 1.5 / 1.45 = 1.034x the rate of K=1 -- under the 5% margin
    seqs, cost = [FakeSeq("static:2")], (lambda q: 0.7 + 0.3 * q)
    assert AdaptiveK(cost).choose(seqs) == 1
    assert AdaptiveK(cost, margin=0.0).choose(seqs) == 2
    assert AdaptiveK(lambda q: 0.8 + 0.2 * q).choose(seqs) == 2  # 1.5 / 1.3 = 1.15x clears it


def test_adaptive_policy_explores_now_and_then():
    pol = AdaptiveK(lambda q: float(q), explore_every=8)  # proposals never pay at this cost
    picks = [pol.choose([FakeSeq("static:3")]) for _ in range(16)]
    assert [i for i, k in enumerate(picks) if k > 1] == [7, 8, 9, 15]  # 3 passes in a row, every 8th
    assert AdaptiveK(lambda q: float(q), explore_every=0).choose([FakeSeq("static:3")]) == 1


def test_adaptive_policy_learns_acceptance():
    pol = AdaptiveK(lambda q: float(q) ** 0.5)
    s = FakeSeq("static:4")
    assert pol.rates(pol.key(s), 3) == [0.5, 0.5, 0.5]
    for _ in range(50):
        pol.observe(s, attempted=4, emitted=4)  # static: every guess is emitted
    assert all(p > 0.95 for p in pol.rates(pol.key(s), 3))
    assert pol.choose([s]) == 4  # 4 tokens for sqrt(4 pending + 3 masks) = 2.6x the time of one
    v = FakeSeq("verify:4", drafts=3)
    for _ in range(50):
        pol.observe(v, attempted=4, emitted=1)  # drafts always rejected
    assert pol.rates(pol.key(v), 1)[0] < 0.05
    assert pol.choose([v]) == 1


def test_capped_k_keeps_lossless_outputs(engine):
    """A steep cost model caps every non-prefill pass to K=1; verify stays identical to generate."""
    jobs = [("Hello", "verify:3", 40), ("abc", "verify:2", 25), ("q", "ntp", 30)]
    sched, reqs = scheduled(engine, jobs, config=dict(max_batch=3, max_model_len=100), pass_time=lambda q: float(q))
    assert sched.capped_passes > 0 and sched.k_caps[1] > 0
    for r, (p, s, n) in zip(reqs, jobs):
        assert r.seq.output == reference(engine, p, s, n, chat=True).token_ids
        assert r.capped_passes > 0 or r.seq.strategy.k == 1


def test_measured_cost_is_monotone_and_covers_the_batch():
    from mtp.core.policy.costmodel import measured_cost

    cost = measured_cost(tiny_model(0), max_batch=4, cache_len=32, repeats=1)
    qs = sorted(cost.points)
    assert {1, 4, 8, 16, 64}.issubset(qs)  # batch-1 blocks and 4 rows x {1, 2, 4}
    assert all(cost.points[a] <= cost.points[b] for a, b in zip(qs, qs[1:]))
    assert cost.pass_time(128) >= cost.pass_time(64)


def test_adaptive_policy_learns_load_and_proposal_cost():
    pol = AdaptiveK(lambda q: 1.0)
    s = FakeSeq("static:4")
    for _ in range(50):
        pol.observe(s, attempted=4, emitted=4)
    assert pol.choose([s]) == 4  # flat pass time, no known proposal cost: every guess is free
    for _ in range(200):
        pol.observe_time(1, {}, 3.0)  # the machine got 3x slower than the cost model
    assert pol.scale == pytest.approx(3.0, rel=1e-3)
    for _ in range(200):  # each proposal depth costs 5 s, timed apart from the pass
        pol.observe_time(1, {"mask": 3}, 3.0 + 3 * 5.0, {"mask": 3 * 5.0})
    assert pol.scale == pytest.approx(3.0, rel=1e-3)
    assert pol.proposal_s["mask"] == pytest.approx(5.0, rel=1e-3)
    # K=4: ~4 tokens in 3 + 15 s; K=2: ~2 tokens in 8 s; K=1: 1 token in 3 s -> K=1
    assert pol.choose([s]) == 1


def test_adaptive_policy_trusts_observed_pass_times():
    """A cost model that calls 4-token passes free is overruled once such passes are seen to be slow."""
    pol = AdaptiveK(lambda q: 1.0)
    s = FakeSeq("verify:4", drafts=3)
    for _ in range(50):
        pol.observe(s, attempted=4, emitted=2)  # one of three drafts accepted: p1 ~ 1, p2 ~ 0
    assert pol.choose([s]) == 4
    for _ in range(3):
        pol.observe_time(1, {}, 1.0)
        pol.observe_time(7, {"mask": 3}, 3.0)  # 1 + 3 drafts + 3 masks took 3x a plain pass
    assert pol.trunk_time(7) == pytest.approx(3.0) and pol.trunk_time(1) == pytest.approx(1.0)
    assert pol.choose([s]) < 4  # K=4: ~2 tokens in 3 s, worse than one token in 1 s


def test_adaptive_policy_extrapolates_unseen_blocks_from_observed_passes():
    pol = AdaptiveK(lambda q: 1.0)  # a start-up model that calls every block size equally cheap
    for _ in range(5):
        pol.observe_time(16, {}, 1.0 + 0.1 * 16)
        pol.observe_time(32, {}, 1.0 + 0.1 * 32)
    a, b = pol.line()
    assert a == pytest.approx(1.0) and b == pytest.approx(0.1)
    assert pol.trunk_time(256) == pytest.approx(1.0 + 25.6)  # not the start-up model's flat guess
    assert pol.trunk_time(16) == pytest.approx(2.6)  # seen block sizes use their own running time


def test_adaptive_policy_times_passes_with_masks_apart():
    """A pass with mask tokens also runs the adapter's low-rank path: the same q costs more."""
    pol = AdaptiveK(lambda q: 1.0)
    for _ in range(3):
        pol.observe_time(16, {}, 1.0)
        pol.observe_time(32, {}, 2.0)
    assert pol.trunk_time(16, masks=True) == pytest.approx(1.0)  # none with masks timed yet: as without
    for _ in range(3):
        pol.observe_time(16, {"mask": 3}, 1.5, masks=True)
        pol.observe_time(32, {"mask": 3}, 2.5, masks=True)
    assert pol.trunk_time(16) == pytest.approx(1.0) and pol.trunk_time(16, masks=True) == pytest.approx(1.5)
    assert pol.trunk_time(24, masks=True) == pytest.approx(2.0) and pol.trunk_time(24) == pytest.approx(1.5)


# ---- adaptive K for token trees --------------------------------------------------------------------
class FakeTree:
    """A tree row for the policy: `tree:N`, a stub proposer `name`, nodes in hand (parents, confidences)."""

    def __init__(self, strategy="tree:8", parents=(), confidences=(), name="stub", pending=1):
        from mtp.core.decoding.proposers import Guesses, Proposer
        from mtp.core.decoding.strategy import Strategy

        self.strategy, self.proposer = Strategy.parse(strategy), Proposer()
        self.proposer.name = name
        self.pending = [0] * pending
        self.drafts = Guesses(list(range(10, 10 + len(parents))), list(confidences), None, list(parents))
        self.k_override = None

    @property
    def k(self):
        k = self.strategy.k
        return k if self.k_override is None else max(1, min(k, self.k_override))


# 8 nodes: a confident chain 0 -> 1 -> 2, then cheap alternatives. Ranked confidences 0.9, 0.8, 0.7,
# 0.2, 0.1, 0.1, 0.05, 0.05, so budgets n = 0..8 expect E(n) = 1, 1.9, 2.7, 3.4, 3.6, 3.7, 3.8, 3.85, 3.9
KNEE = ([-1, 0, 1, -1, 0, 3, 2, 4], [0.9, 0.8, 0.7, 0.2, 0.1, 0.1, 0.05, 0.05])


def test_tree_policy_prices_nodes_by_confidence():
    from mtp.serving.adaptive import ranked_confidences

    assert ranked_confidences(*KNEE) == [0.9, 0.8, 0.7, 0.2, 0.1, 0.1, 0.05, 0.05]
    expected, nodes = AdaptiveK(lambda q: 1.0).tree_expected(FakeTree(parents=KNEE[0], confidences=KNEE[1]))
    assert expected == pytest.approx([1, 1.9, 2.7, 3.4, 3.6, 3.7, 3.8, 3.85, 3.9])
    assert nodes == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # in hand: every node is fed
    # flat pass time, no proposing cost: every node is free, the full tree (K = N + 1 = 9)
    assert AdaptiveK(lambda q: 1.0).choose([FakeTree(parents=KNEE[0], confidences=KNEE[1])]) == 9
    assert AdaptiveK(lambda q: 1.0).choose([FakeTree(parents=KNEE[0], confidences=KNEE[1]) for _ in range(16)]) == 9
    # t(q) = 1 + 0.3 q, one row: E(n) / (1.3 + 0.3 n): n=2 2.7/1.9 = 1.42, n=3 3.4/2.2 = 1.55, n=4 3.6/2.5 = 1.44
    assert AdaptiveK(lambda q: 1 + 0.3 * q).choose([FakeTree(parents=KNEE[0], confidences=KNEE[1])]) == 4
    # t(q) = q at batch 16: plain 16 tokens / t(16) = 1; one node 16 x 1.9 / t(32) = 0.95; more is worse: plain
    assert (
        AdaptiveK(lambda q: float(q)).choose([FakeTree(parents=KNEE[0], confidences=KNEE[1]) for _ in range(16)]) == 1
    )


def test_tree_policy_pads_the_batch_to_its_largest_tree():
    # one row in hand with 8 nodes, one with 2 (then the prior's 0.5 per node): cap K prices both at min(K-1, 8)
    # nodes, and the pass feeds 2 x (1 + the larger block); flat time: K = 9
    small = FakeTree(parents=[-1, 0], confidences=[0.9, 0.8])
    pol = AdaptiveK(lambda q: 1.0)
    assert pol.tree_expected(small)[0][:4] == pytest.approx([1, 1.9, 2.7, 3.2])  # rank 2 from the prior
    assert pol.choose([small, FakeTree(parents=KNEE[0], confidences=KNEE[1])]) == 9
    # t(q) = 1 + 0.15 q: two rows, q = 2 (1 + n): (E_big + E_small) / (1.3 + 0.3 n):
    # n=2 5.4/1.9 = 2.84, n=3 6.6/2.2 = 3.0, n=4 7.3/2.5 = 2.92 -> K = 4
    assert AdaptiveK(lambda q: 1 + 0.15 * q).choose([small, FakeTree(parents=KNEE[0], confidences=KNEE[1])]) == 4


def test_tree_policy_prices_proposing_per_node():
    row = FakeTree(parents=KNEE[0], confidences=KNEE[1])
    pol = AdaptiveK(lambda q: 1.0)
    assert pol.choose([row]) == 9
    for _ in range(20):  # 8 nodes drafted in 2 s besides a 1 s pass: 0.25 s per node asked for
        pol.observe_time(9, {}, 3.0, {}, False, {"stub": (1, 8)}, {"stub": 2.0})
    assert pol.trunk_time(9) == pytest.approx(1.0) and pol.node_cost("stub") == pytest.approx((0.0, 0.25))
    # E(n) / (1 + 0.25 n): n=2 2.7/1.5 = 1.8, n=3 3.4/1.75 = 1.94, n=4 3.6/2 = 1.8 -> 3 nodes
    assert pol.choose([row]) == 4
    # another proposer (named apart) is unaffected: its rows still get the full tree
    assert pol.choose([FakeTree(parents=KNEE[0], confidences=KNEE[1], name="cheap")]) == 9


def test_tree_policy_tells_rows_from_nodes_in_proposing_time():
    pol = AdaptiveK(lambda q: 1.0)
    for _ in range(5):  # 0.5 s per drafting row + 0.1 s per node
        pol.observe_time(9, {}, 2.3, {}, False, {"p": (1, 8)}, {"p": 1.3})
        pol.observe_time(6, {}, 2.4, {}, False, {"p": (2, 4)}, {"p": 1.4})
    assert pol.node_cost("p") == pytest.approx((0.5, 0.1))
    assert pol.tree_proposing_time({"p": (3, 6)}) == pytest.approx(2.1)
    assert pol.node_cost("unseen") == (0.0, 0.0)


def test_tree_policy_learns_the_average_tree_for_rows_without_one():
    pol = AdaptiveK(lambda q: 1.0)
    bare = FakeTree()  # no tree in hand (after a plain pass or a prefill): priced by its key's average tree
    present, conf = pol.tree_profile(pol.key(bare), 3)
    assert present == [1.0, 1.0, 1.0] and conf == [0.5, 0.5, 0.5]  # the prior: every untried rank like the last
    for _ in range(20):  # trees drafted with room for 8 nodes held only 2
        pol.observe_tree(FakeTree(parents=[-1, 0], confidences=[0.9, 0.8]), 8)
    present, conf = pol.tree_profile(pol.key(bare), 3)
    assert conf[0] == pytest.approx((20 * 0.9 + 2 * 0.5) / 22) and present[0] == 1.0
    assert conf[1] == pytest.approx((20 * 0.8 + 2 * conf[0]) / 22)
    assert present[2] == pytest.approx(2 / 22) and conf[2] == pytest.approx(2 * conf[1] / 22)
    # nodes that are rarely there add little to the block and little to the tokens; priced per node at
    # 0.2 s, two nodes win: E(2) = 2.67 over 1 + 0.4 s
    for _ in range(20):
        pol.observe_time(3, {}, 1.4, {}, False, {"stub": (1, 2)}, {"stub": 0.4})
    assert pol.choose([bare]) == 3
    # ranks at or beyond the budget a tree was drafted under are not counted
    pol.observe_tree(FakeTree(parents=[-1], confidences=[1.0]), 1)
    assert pol.ranks[pol.key(bare)][0][0] == 21 and pol.ranks[pol.key(bare)][1][0] == 20


def test_tree_policy_learns_how_much_the_confidences_over_promise():
    row = FakeTree(parents=KNEE[0], confidences=KNEE[1])
    pol = AdaptiveK(lambda q: 1 + 0.3 * q)
    assert pol.tree_honesty(pol.key(row)) == 1.0 and pol.choose([row]) == 4  # as priced above: 3 nodes
    for _ in range(48):  # trees that promised 2 accepted drafts accepted 1: half what they promise
        pol.observe_tree_outcome(row, 2.0, 1)
    assert pol.tree_honesty(pol.key(row)) == pytest.approx((48 + 2) / (96 + 2))
    h = pol.tree_honesty(pol.key(row))
    assert pol.tree_expected(row)[0][:3] == pytest.approx([1, 1 + 0.9 * h, 1 + 1.7 * h])
    # E(n) = 1 + h * S(n) over 1.3 + 0.3 n: n=1 1.46/1.6 = 0.91, n=2 1.87/1.9 = 0.98, n=3 2.22/2.2 = 1.01
    # and plain 1/1.3 = 0.77: the best is now 3 nodes at 1.01 (n=4 2.32/2.5 = 0.93), so K = 4 still, but
    # a steeper t(q) = 1 + 0.5 q leaves plain (1/1.5 = 0.67) vs n=1 1.46/2.0 = 0.73, n=2 1.87/2.5 = 0.75,
    # n=3 2.22/3.0 = 0.74: K = 3, where the honest confidences pick n=3 (3.4/3.0 = 1.13 > 2.7/2.5 = 1.08)
    assert pol.choose([row]) == 4
    steep, honest = AdaptiveK(lambda q: 1 + 0.5 * q), AdaptiveK(lambda q: 1 + 0.5 * q)
    steep.tree_truth = dict(pol.tree_truth)
    assert honest.choose([row]) == 4 and steep.choose([row]) == 3
    # passes with nothing promised (chains, empty trees) teach nothing
    pol.observe_tree_outcome(row, 0.0, 0)
    assert pol.tree_honesty(pol.key(row)) == pytest.approx(h)


def test_tree_policy_prices_a_mask_trees_groups():
    from mtp.core.decoding.proposers.mask import MaskProposer

    stub, mask = FakeTree(parents=KNEE[0], confidences=KNEE[1]), FakeTree(parents=KNEE[0], confidences=KNEE[1])
    mask.proposer = MaskProposer()
    # this pass: 1 pending + 8 nodes + groups of min(8, 3) = 3 masks after the root and 7 nodes (8 groups)
    assert AdaptiveK.block(stub, 9) == 9 and AdaptiveK.block(mask, 9) == 9 + 3 * 8
    # t(q) = 1 + 0.3 q: the stub tree takes 3 nodes (see above); a mask tree of n nodes also feeds
    # min(n, 3) x (1 + min(n, 7)) masks, q = 1 + n + masks: plain 1/1.3 = 0.77, n=1 (q = 4) 1.9/2.2 = 0.86,
    # n=2 (q = 9) 2.7/3.7 = 0.73, n=3 (q = 16) 3.4/5.8 = 0.59: one node, K = 2
    assert AdaptiveK(lambda q: 1 + 0.3 * q).choose([stub]) == 4
    assert AdaptiveK(lambda q: 1 + 0.3 * q).choose([mask]) == 2


def test_trim_tree_keeps_the_most_confident_nodes():
    # confidences 0.9, 0.7, 0.5, 0.6, 0.4, 0.3, 0.5, 0.2; the top 4: nodes 0, 1, 3 and, of the two at 0.5,
    # the shallower node 2 (tree.keep's tie rule); node 3's parent 1 becomes index 1
    row = FakeTree(parents=[-1, 0, -1, 1, 0, 2, 3, 4], confidences=[0.9, 0.7, 0.5, 0.6, 0.4, 0.3, 0.5, 0.2])
    AdaptiveK.trim_tree(row, 4)
    assert row.drafts.tokens == [10, 11, 12, 13] and row.drafts.parents == [-1, 0, -1, 1]
    assert row.drafts.confidences == [0.9, 0.7, 0.5, 0.6]
    AdaptiveK.trim_tree(row, 8)  # a budget above the tree's size changes nothing
    assert row.drafts.tokens == [10, 11, 12, 13]
    AdaptiveK.trim_tree(row, 0)
    assert row.drafts.tokens == [] and row.drafts.parents == []


def test_chain_rows_are_priced_as_chains_beside_trees():
    """Chain-only batches never enter the tree pricing, and a chain row priced by it gets the chain price."""
    pol = AdaptiveK(lambda q: 1 + 0.1 * q)
    for seqs in (
        [FakeSeq("conf_adapt:0.9:4")],
        [FakeSeq("verify:4", drafts=3)] * 3,
        [FakeSeq("static:3"), FakeSeq("verify:2", branch=False), FakeSeq("ntp")],
    ):
        assert pol._tree_rates(seqs, set(), 4) == pol._chain_rates(seqs, set(), 4)
    pol._tree_rates = None  # the existing chain choices (test_adaptive_policy_choices) do not touch it
    assert pol.choose([FakeSeq("conf_adapt:0.9:4")]) == 3 and pol.choose([FakeSeq("conf_adapt:0.9:4")] * 16) == 1


def test_trimmed_trees_keep_ntp_outputs(tiny_dir, monkeypatch):
    """The policy alone steers (observed pass times ignored, the start-up costs fixed: a deterministic run):
    as rows join and leave the tree budget moves, a row holding more nodes than a new cap keeps its most
    confident ones (`AdaptiveK.trim_tree`), and every output is still ntp's."""
    from mtp.core.policy.costmodel import CostModel

    lookup = Engine.load(EngineConfig(model=str(tiny_dir), adapter="none", proposer="lookup"))
    lookup.cost_model = CostModel({1: 0.01, 32: 0.05})  # tree:auto's own pruning, per row
    trims, trim = [], AdaptiveK.trim_tree

    def counted(seq, n):
        trims.append(len(seq.drafts) > n)
        trim(seq, n)

    monkeypatch.setattr(AdaptiveK, "trim_tree", staticmethod(counted))
    monkeypatch.setattr(AdaptiveK, "observe_time", lambda *a, **kw: None)
    jobs = TREE_JOBS[:1] + [("la la la la la", "tree:auto", 50)] + TREE_JOBS[2:]
    sched, reqs = scheduled(
        lookup, jobs, config=dict(max_batch=3, max_model_len=200), pass_time=lambda q: 0.01 * (1 + q / 8)
    )
    for r, (p, s, n) in zip(reqs, jobs):
        assert r.seq.output == reference(lookup, p, "ntp", n, chat=True).token_ids, s
    assert any(trims) and len([k for k in sched.k_caps if 1 < k < 17]) >= 2  # trimmed; budgets between plain and full
