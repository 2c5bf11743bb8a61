"""`mtp serve --deploy`: gradual rollout with automatic fallback (mtp.serving.rollout), on the tiny
character-level model of test_serve: a bad tuned configuration (`static:8`, whose unverified
guesses change the output) falls back within one window, a lossless one (`verify:4`) ramps up to
every request, and no request is dropped or answered twice across a switch; the deploy file and
rollout flags refuse bad input in one line."""

from __future__ import annotations

import json
import re
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from helpers import make_app, reference  # noqa: E402

from mtp.core.decoding.strategy import Strategy  # noqa: E402
from mtp.core.policy import deploy as D  # noqa: E402
from mtp.serving.rollout import FALLBACK, TUNED, Rollout, bucket  # noqa: E402


def make_deploy(
    tuned: str, fallback: str = "verify:4", tolerance: float = 0.0, metric: str = "exact", **kw
) -> D.Deploy:
    return D.Deploy(
        tuned=D.Arm(Strategy.parse(tuned), "mask"),
        fallback=D.Arm(Strategy.parse(fallback), "mask"),
        tolerance=tolerance,
        metric=metric,
        **kw,
    )


def wait_for(cond, timeout=60.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return True
        time.sleep(0.05)
    return False


PROMPTS = [f"prompt {i}: abc" for i in range(24)]


def serve_all(app, log, n_shadow_expected=None):
    """Every prompt once, in order, each request waiting for the shadow comparisons so far (so the
    rollout state at each admission is deterministic). Returns the responses' texts and arms."""
    out = []
    with TestClient(app) as c:
        state = app.state.mtp
        for p in PROMPTS:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 16})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
            want = sum(1 for a in state.rollout_arms if a == TUNED)
            assert wait_for(lambda want=want: state.rollout.compared >= want), "shadow comparisons never came"
        health = c.get("/health").json()
        metrics = c.get("/metrics").text
    return out, health, metrics


@pytest.fixture
def arm_log(monkeypatch):
    """Record the arm of every request the server admits (in admission order)."""
    from mtp.serving import state as S

    original = S.ServerState.new_request

    def new_request(self, body, ids, max_tokens):
        req = original(self, body, ids, max_tokens)
        self.__dict__.setdefault("rollout_arms", []).append(req.arm)
        return req

    monkeypatch.setattr(S.ServerState, "new_request", new_request)


def test_bad_configuration_falls_back_within_one_window(engine, tmp_path, arm_log):
    log = tmp_path / "shadow.jsonl"
    window = 4
    app = make_app(
        engine,
        shadow_rate=1.0,
        shadow_log=str(log),
        deploy=make_deploy("static:8"),
        rollout=0.5,
        rollout_window=window,
        adaptive=False,
    )
    app.state.mtp.rollout_arms = []
    texts, health, metrics = serve_all(app, log)
    arms = app.state.mtp.rollout_arms
    assert len(texts) == len(PROMPTS) and len(arms) == len(PROMPTS)  # every request answered, once
    # assignment by the request id's hash while rolling out
    tuned_idx = [i for i, a in enumerate(arms) if a == TUNED]
    assert tuned_idx and all(bucket(str(i)) < 0.5 for i in tuned_idx)
    # static:8 differs from ntp on the first comparison (tolerance 0): the fallback comes within one window
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert recs and recs[0]["arm"] == TUNED and recs[0]["loss"]["exact"] == 1.0
    assert len(recs) <= window
    first_bad = tuned_idx[0]
    assert all(a == FALLBACK for a in arms[first_bad + 1 :])
    assert health["rollout"]["state"] == "fallback" and health["rollout"]["fallbacks"] == 1
    assert "mtp_rollout_fallbacks_total 1.0" in metrics
    assert 'mtp_rollout_state{state="fallback"} 1.0' in metrics and "mtp_rollout_fraction 0.0" in metrics
    # each answer is the one its arm gives alone: the fallback requests are exactly verify:4 = ntp
    for i, (text, arm) in enumerate(zip(texts, arms)):
        strategy = "static:8" if arm == TUNED else "ntp"
        assert text == reference(engine, PROMPTS[i], strategy, 16, chat=False).text


def test_good_configuration_ramps_to_every_request(engine, tmp_path, arm_log):
    log = tmp_path / "shadow.jsonl"
    app = make_app(
        engine,
        shadow_rate=1.0,
        shadow_log=str(log),
        deploy=make_deploy("verify:4", "ntp"),
        rollout=0.25,
        rollout_step=0.25,
        rollout_window=2,
        adaptive=False,
    )
    app.state.mtp.rollout_arms = []
    texts, health, metrics = serve_all(app, log)
    arms = app.state.mtp.rollout_arms
    assert len(texts) == len(PROMPTS)
    assert health["rollout"]["state"] == "full" and health["rollout"]["fraction"] == 1.0
    assert health["rollout"]["ramps"] == 3 and health["rollout"]["fallbacks"] == 0
    last_fallback = max(i for i, a in enumerate(arms) if a == FALLBACK)
    assert all(a == TUNED for a in arms[last_fallback + 1 :]) and arms[-1] == TUNED
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert all(r["exact_match"] and r["loss"]["exact"] == 0.0 for r in recs)  # lossless
    assert "mtp_rollout_fraction 1.0" in metrics and "mtp_rollout_ramps_total 3.0" in metrics
    for i, text in enumerate(texts):
        assert text == reference(engine, PROMPTS[i], "ntp", 16, chat=False).text


def test_requests_naming_a_strategy_keep_it_within_the_caps(engine, tmp_path):
    deploy = make_deploy("conf_adapt:0.9:4", caps={"max_k": 4, "min_tau": 0.9})
    app = make_app(engine, shadow_rate=1.0, shadow_log=str(tmp_path / "s.jsonl"), deploy=deploy)
    with TestClient(app) as c:
        ok = c.post(
            "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 8, "mtp": {"strategy": "verify:8"}}
        )
        assert ok.status_code == 200  # lossless: no cap
        for s, word in (("static:8", "K <= 4"), ("conf_adapt:0.5:4", "tau >= 0.9")):
            r = c.post(
                "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 8, "mtp": {"strategy": s}}
            )
            assert r.status_code == 400 and word in r.json()["error"]["message"]


def test_rollout_window_arithmetic():
    r = Rollout(make_deploy("static:2", tolerance=0.25), fraction=0.5, step=0.5, window=4)
    assert r.observe({"exact": 1.0}) is None  # 1 of at most 1 allowed loss in a window of 4
    assert r.observe({"exact": 0.0}) is None and r.observe({"exact": 0.0}) is None
    assert r.observe({"exact": 0.0}) == "ramp" and r.fraction == 1.0 and r.state == "full"
    assert r.observe({"exact": 1.0}) is None  # the first loss slid out of the window: [0, 0, 0, 1]
    assert r.observe({"exact": 1.0}) == "fallback"  # [0, 0, 1, 1]: 2 losses > 0.25 x 4
    assert r.state == "fallback" and r.assign(0) == (FALLBACK, r.deploy.fallback)
    assert r.observe({"exact": 0.0}) is None  # a fallback is for good


# ---- bad input: one line, before any model loads ----------------------------------------------------
def run_cli(argv):
    from mtp.cli import main

    return main(argv)


def test_deploy_file_refusals(tmp_path, capsys):
    good = tmp_path / "deploy.json"
    D.write(
        make_deploy("conf_adapt:0.9:4", tolerance=0.02, metric="answer", hashes={"model": "0123456789abcdef"}), good
    )
    back = D.read(good)
    assert str(back.tuned) == "conf_adapt:0.9:4@mask" and back.tolerance == 0.02
    text = good.read_text()
    cases = {
        "truncated": (text[: len(text) // 2], "truncated"),
        "other": (json.dumps({"format": "something"}), "not an mtp deploy file"),
        "tolerance": (text.replace('"tolerance": 0.02', '"tolerance": 1.5'), "must be a number in [0, 1]"),
        "metric": (text.replace('"metric": "answer"', '"metric": "bleu"'), "unknown metric"),
        "lossy-fallback": (text.replace('"strategy": "verify:4"', '"strategy": "static:4"'), "must be lossless"),
        "strategy": (text.replace('"conf_adapt:0.9:4"', '"warp:9"'), "malformed strategy"),
    }
    for name, (body, words) in cases.items():
        p = tmp_path / f"{name}.json"
        p.write_text(body)
        with pytest.raises(ValueError, match=re.escape(words)):
            D.read(p)
        assert run_cli(["serve", "--deploy", str(p)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words.split()[0] in err
    for flags, words in (
        (["--rollout", "1.5"], "--rollout must be in [0, 1]"),
        (["--rollout", "-0.1"], "--rollout must be in [0, 1]"),
        (["--rollout-step", "2"], "--rollout-step must be in [0, 1]"),
        (["--rollout", "0.5", "--shadow-rate", "0"], "needs --shadow-rate > 0"),
    ):
        log = ["--shadow-log", str(tmp_path / "shadow.jsonl")]  # checking the flags touches the log: not in the cwd
        assert run_cli(["serve", "--deploy", str(good), *log, *flags]) == 2
        assert words in capsys.readouterr().err
    assert run_cli(["serve", "--rollout", "0.5"]) == 2
    assert "need --deploy" in capsys.readouterr().err


def test_deploy_for_another_model_is_refused(engine, tmp_path):
    have = D.engine_hashes(engine)
    D.check_engine(make_deploy("verify:4", hashes=have), engine)  # its own hashes pass
    with pytest.raises(ValueError, match="another model"):
        D.check_engine(make_deploy("verify:4", hashes={**have, "model": "0123456789abcdef"}), engine)
    with pytest.raises(ValueError, match="was not loaded here"):
        D.check_engine(make_deploy("verify:4", hashes={**have, "heads": "0123456789abcdef"}), engine)


def test_health_shows_the_rollout_only_with_the_api_key(engine, tmp_path):
    """With an API key, /health without it is the status alone; with it (or with no key configured) the
    rollout block as well (issue 47, S1)."""
    deploy = make_deploy("verify:4", "ntp")
    for key in ("s3cret", None):
        app = make_app(engine, api_key=key, deploy=deploy, shadow_rate=1.0, shadow_log=str(tmp_path / "s.jsonl"))
        with TestClient(app) as c:
            full = c.get("/health", headers={"Authorization": "Bearer s3cret"})
            assert full.status_code == 200 and full.json()["rollout"]["tuned"] == "verify:4@mask"
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = c.get("/health", headers=headers)
                assert r.status_code == 200
                assert r.json() == ({"status": "ok"} if key else full.json()), (key, headers)
            assert c.head("/health").status_code == 200
