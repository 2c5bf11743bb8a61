"""The server's defects from the hostile-user report, each reproduced against a real running server
(uvicorn on a loopback port, as in test_serve) and checked fixed: abandoned requests leave the
batch, large requests are refused early without stalling others, bounded metrics, plain 4xx errors."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from helpers import LiveServer, assert_error, make_app, slow_engine  # noqa: E402


def metric(text: str, line_start: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(line_start))


# ---- 2. abandoned non-streaming requests free their rows --------------------------------------------
def test_2_abandoned_requests_are_cancelled_while_decoding(engine):
    app = make_app(slow_engine(engine, 0.05), max_batch=8, max_model_len=400)
    with LiveServer(app) as srv:

        def abandon():
            with pytest.raises(httpx.TimeoutException):
                httpx.post(
                    srv.url + "/v1/completions", timeout=1.0, json={"model": "tiny", "prompt": "abc", "max_tokens": 200}
                )  # ~10 s of decoding

        threads = [threading.Thread(target=abandon) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "x", "max_tokens": 8})
        waited = time.perf_counter() - t0
        assert r.status_code == 200
        for _ in range(100):
            text = httpx.get(srv.url + "/metrics").text
            if metric(text, 'mtp_requests_total{endpoint="completions",status="cancelled"}') == 8:
                break
            time.sleep(0.05)
    assert metric(text, 'mtp_requests_total{endpoint="completions",status="cancelled"}') == 8
    assert metric(text, 'mtp_requests_total{endpoint="completions",status="ok"}') == 1
    assert waited < 5, waited  # the abandoned rows had left: ~8 passes, not ~200 x 8 rows of decoding


# ---- 3. one large request stalls nobody ------------------------------------------------------------
def test_3_body_over_the_limit_is_413(engine):
    with LiveServer(make_app(engine, max_body_bytes=4096)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "a" * 8000, "max_tokens": 2})
        assert_error(r, 413)

        def chunks():  # no Content-Length: the limit holds while streaming the body too
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(10):
                yield b"a" * 1000
            yield b'"}'

        r = httpx.post(srv.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert_error(r, 413)
        assert (
            httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 2}).status_code
            == 200
        )


def test_3_prompt_over_the_character_limit_is_refused_before_tokenising(engine, monkeypatch):
    app = make_app(engine, max_prompt_chars=1000)
    state = app.state.mtp

    def no_tokenising(*a, **k):
        raise AssertionError("tokenised a prompt over the character limit")

    monkeypatch.setattr(state.engine, "encode", no_tokenising)
    with LiveServer(app) as srv:
        err = assert_error(
            httpx.post(
                srv.url + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "a" * 2000}]},
            ),
            400,
            "messages",
        )
        assert "1000" in err["message"]
        assert_error(
            httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "a" * 1001}), 400, "prompt"
        )


def test_3_tokenising_never_blocks_other_requests(engine, monkeypatch):
    app = make_app(engine)
    state = app.state.mtp
    encode = state.engine.encode

    def slow_encode(*a, **k):  # a huge prompt's tokenisation, standing in
        time.sleep(2.0)
        return encode(*a, **k)

    monkeypatch.setattr(state.engine, "encode", slow_encode)
    with LiveServer(app) as srv:
        big = threading.Thread(
            target=lambda: httpx.post(
                srv.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "abc", "max_tokens": 2}
            )
        )
        big.start()
        time.sleep(0.3)
        t0 = time.perf_counter()
        assert httpx.get(srv.url + "/health").status_code == 200
        health_s = time.perf_counter() - t0
        big.join()
    assert health_s < 0.5, health_s


# ---- 4. an empty API key is refused -----------------------------------------------------------------
def test_4_empty_api_key_is_refused():
    for key in ("", "   "):
        r = subprocess.run(
            [sys.executable, "-m", "mtp.cli", "serve", "--api-key", key, "--model", "/nowhere"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and "--api-key is empty" in r.stderr and r.stderr.count("\n") == 1, r.stderr


# ---- 9. non-UTF-8 text and tokenizer internals ------------------------------------------------------
def test_9_lone_surrogate_and_chat_errors_are_plain_400(engine):
    with LiveServer(make_app(engine)) as srv:
        body = '{"model": "tiny", "prompt": "hi \\ud800", "max_tokens": 2}'
        err = assert_error(
            httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"}),
            400,
            "prompt",
        )
        assert "UTF-8" in err["message"]
        body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi \\udfff"}]}'
        assert_error(
            httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}),
            400,
            "messages",
        )


def test_9_chat_template_failure_exposes_no_internals(engine, monkeypatch):
    app = make_app(engine)

    def broken(*a, **k):
        raise RuntimeError("jinja2.exceptions.TemplateError: internal detail at line 3")

    monkeypatch.setattr(app.state.mtp.engine, "encode", broken)
    with LiveServer(app) as srv:
        err = assert_error(
            httpx.post(
                srv.url + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            ),
            400,
            "messages",
        )
    assert "jinja" not in err["message"] and "internal" not in err["message"]


# ---- 10 / 17. sampling limits, seeds, HEAD, content without text ---------------------------------
@pytest.mark.parametrize(
    "field, value, param",
    [
        ("temperature", 2.5, "temperature"),
        ("seed", 2**64, "seed"),
        ("seed", -1, "seed"),
        ("top_p", 0.0, "top_p"),
    ],
)
def test_10_17_sampling_limits_are_the_clis(engine, field, value, param):
    with LiveServer(make_app(engine)) as srv:
        r = httpx.post(
            srv.url + "/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 2, field: value}
        )
        err = assert_error(r, 400, param)
    assert "Overflow" not in err["message"]


def test_17_head_health_and_content_without_text(engine):
    with LiveServer(make_app(engine)) as srv:
        assert httpx.head(srv.url + "/health").status_code == 200
        img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        assert_error(
            httpx.post(
                srv.url + "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": [img]}]},
            ),
            400,
            "messages",
        )
        ok = httpx.post(
            srv.url + "/v1/chat/completions",
            json={
                "model": "tiny",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [img, {"type": "text", "text": "hi"}]}],
            },
        )
        assert ok.status_code == 200


# ---- 14. the shadow log's path is checked at start-up ------------------------------------------------
def test_14_shadow_log_pointing_at_a_folder(engine, tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        make_app(engine, shadow_rate=0.5, shadow_log=str(tmp_path))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mtp.cli",
            "serve",
            "--shadow-rate",
            "0.5",
            "--shadow-log",
            str(tmp_path),
            "--model",
            "/nowhere",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "is a directory" in r.stderr and r.stderr.count("\n") == 1, r.stderr


# ---- 15. /metrics label cardinality is bounded ------------------------------------------------------
def test_15_metrics_series_do_not_grow_with_client_strings(engine):
    with LiveServer(make_app(engine)) as srv:
        for i in range(12):
            strategy = f"conf_adapt:0.9{i:04d}:4"
            assert (
                httpx.post(
                    srv.url + "/v1/completions",
                    json={"model": "tiny", "prompt": "ab", "max_tokens": 3, "mtp": {"strategy": strategy}},
                ).status_code
                == 200
            )
        text = httpx.get(srv.url + "/metrics").text
    series = [ln for ln in text.splitlines() if ln.startswith("mtp_tokens_per_forward{")]
    assert series == [ln for ln in series if 'strategy="conf_adapt:kmax=4"' in ln] and len(series) == 1
    assert len(app_chunks(srv)) == 1


def app_chunks(srv):
    return srv.app.state.mtp.scheduler.chunks
