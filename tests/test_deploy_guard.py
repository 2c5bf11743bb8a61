"""A deploy file is served only as `mtp tune` could have written it (issue 47): a tuned arm outside its
own safety caps or unlike the measurements it carries (W1), caps of the wrong type or unknown (T1), no
hashes tying it to weights and assets (U1) are each refused in one line before any model loads; an
asset the deploy file was tuned with but the engine lacks names the flag that loads it. (S1, /health
behind the API key: tests/test_rollout.py.)"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from mtp.core.policy import deploy as D

REPO = Path(__file__).resolve().parents[1]

# what `mtp tune` writes (mtp/tune/run.py, step 8), cut to the fields `deploy.read` looks at
TUNED = {
    "format": "mtp-deploy",
    "version": 1,
    "tuned": {"strategy": "conf_adapt:0.95:4", "proposer": "mask"},
    "fallback": {"strategy": "verify:4", "proposer": "mask"},
    "tolerance": 0.05,
    "metric": "answer",
    "caps": {"max_k": 4, "min_tau": 0.95},
    "calibration": {},
    "hashes": {"model": "856f0d7611b5a6f7", "adapter": "0123456789abcdef"},
    "measured": {
        "arm": "conf_adapt:0.95:4@mask",
        "tokens_per_s": 20.0,
        "speedup_vs_ntp": 1.3,
        "ms_per_token": 50.0,
        "loss": 0.04,
        "loss_items": 100,
        "tokens_per_forward": 1.6,
        "measure_prompts": 8,
        "data": "gsm8k:x",
        "prompts": 100,
    },
}


def deploy_file(tmp_path, name="deploy.json", **changes) -> Path:
    """TUNED with top-level `changes` (None deletes a field), written to tmp_path/name."""
    data = copy.deepcopy(TUNED)
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def refused(path, capsys, words: str) -> str:
    """`deploy.read` refuses `path` with `words` in its one line, and so does `mtp serve --deploy` (exit 2,
    one `mtp: error:` line, before any model loads)."""
    from mtp.cli import main

    with pytest.raises(ValueError, match=words):
        D.read(path)
    assert main(["serve", "--deploy", str(path), "--model", "/nowhere"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtp: error:") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and "/nowhere" not in err  # refused before the model was looked for
    return err


def test_a_file_as_tune_writes_it_is_read(tmp_path):
    d = D.read(deploy_file(tmp_path))
    assert str(d.tuned) == "conf_adapt:0.95:4@mask" and d.caps == {"max_k": 4, "min_tau": 0.95}


def test_committed_deploy_files_are_read():
    files = sorted((REPO / "benchmarks").rglob("deploy.json"))
    assert files
    for f in files:
        D.read(f)


# ---- W1: the tuned arm within its own caps, and the one the measurements describe -------------------------
def test_w1_tuned_arm_outside_its_own_caps_is_refused(tmp_path, capsys):
    err = refused(
        deploy_file(
            tmp_path, tuned={"strategy": "conf_adapt:0.05:16", "proposer": "mask"}, caps={"max_k": 2, "min_tau": 0.99}
        ),
        capsys,
        "safety cap K <= 2",
    )
    assert "conf_adapt:0.05" in err
    refused(
        deploy_file(tmp_path, tuned={"strategy": "conf_adapt:0.5:4", "proposer": "mask"}),
        capsys,
        "safety cap tau >= 0.95",
    )


def test_w1_the_server_refuses_requests_with_the_same_check():
    """One check for both: a request's own strategy is refused (400) exactly when the deploy-file check
    refuses it as a tuned arm, with the same words."""
    from types import SimpleNamespace

    from mtp.core.decoding.strategy import Strategy

    pytest.importorskip("fastapi")
    from mtp.serving.openai import APIError
    from mtp.serving.state import ServerState

    caps = {"max_k": 4, "min_tau": 0.95}
    deploy = D.Deploy(
        tuned=D.Arm(Strategy.parse("conf_adapt:0.95:4"), "mask"),
        fallback=D.Arm(Strategy.parse("ntp"), "mask"),
        tolerance=0.05,
        metric="answer",
        caps=caps,
    )
    state = SimpleNamespace(config=SimpleNamespace(deploy=deploy))
    for text in ("static:8", "conf_adapt:0.5:4", "conf_adapt:0.99:4", "static:4", "verify:16", "tree:16"):
        s = Strategy.parse(text)
        try:
            D.check_within_caps(s, caps)
            want = None
        except ValueError as e:
            want = str(e)
        try:
            ServerState.check_caps(state, s)
            got = None
        except APIError as e:
            assert e.status == 400
            got = e.body()["error"]["message"]
        assert (got is None) == (want is None), text
        if want is not None:
            assert want.split("safety cap")[1] == got.split("safety cap")[1] and "this server's" in got, (want, got)


@pytest.mark.parametrize(
    "tuned, measured, words",
    [
        # a lossless arm measured with a loss: the measurements are of a lossy one
        ({"strategy": "verify:4", "proposer": "mask"}, {"loss": 0.04}, "lossless"),
        # an arm that emits at most 2 tokens a pass cannot have measured 3.5
        ({"strategy": "conf_adapt:0.95:2", "proposer": "mask"}, {"tokens_per_forward": 3.5}, "tokens_per_forward"),
        ({"strategy": "ntp", "proposer": "mask"}, {"tokens_per_forward": 1.6, "loss": 0.0}, "tokens_per_forward"),
        # tune never chooses an arm whose measured loss is over the tolerance
        ({"strategy": "conf_adapt:0.95:4", "proposer": "mask"}, {"loss": 0.3}, "exceeds the tolerance"),
        ({"strategy": "conf_adapt:0.95:4", "proposer": "mask"}, {"loss": "low"}, "measured.loss must be a number"),
        # tune names the arm it measured: a hand-edited choice no longer matches it
        (
            {"strategy": "conf_adapt:0.96:4", "proposer": "mask"},
            {"arm": "conf_adapt:0.95:4@mask"},
            "the measurements are of 'conf_adapt:0.95:4@mask'",
        ),
    ],
)
def test_w1_tuned_arm_unlike_its_measurements_is_refused(tmp_path, capsys, tuned, measured, words):
    without_arm = {k: v for k, v in TUNED["measured"].items() if k != "arm"}  # as files tuned before it was written
    refused(deploy_file(tmp_path, tuned=tuned, measured={**without_arm, **measured}), capsys, words)


# ---- T1: the caps themselves ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "caps, words",
    [
        ({"max_k": "abc", "min_tau": 0.95}, "caps.max_k must be an integer >= 1"),
        ({"max_k": 0}, "caps.max_k must be an integer >= 1"),
        ({"max_k": 4.0}, "caps.max_k must be an integer >= 1"),
        ({"max_k": True}, "caps.max_k must be an integer >= 1"),
        ({"max_k": 4, "min_tau": -5}, r"caps.min_tau must be a number in \[0, 1\]"),
        ({"max_k": 4, "min_tau": "0.9"}, r"caps.min_tau must be a number in \[0, 1\]"),
        ({"max_k": 4, "max_tokens": 9}, "unknown cap 'max_tokens'"),
        ([4, 0.95], "'caps' must be an object"),
    ],
)
def test_t1_bad_caps_are_refused(tmp_path, capsys, caps, words):
    refused(deploy_file(tmp_path, caps=caps), capsys, words)


def test_t1_caps_left_out_are_the_tuned_arms_own(tmp_path):
    """No caps (or only one) never means no limit on lossy requests: the missing ones are the tuned arm's."""
    assert D.read(deploy_file(tmp_path, caps=None)).caps == {"max_k": 4, "min_tau": 0.95}
    assert D.read(deploy_file(tmp_path, caps={"min_tau": 0.9})).caps == {"max_k": 4, "min_tau": 0.9}
    assert D.read(deploy_file(tmp_path, caps={"max_k": 2 + 2})).caps == {"max_k": 4, "min_tau": 0.95}


def test_t1_caps_are_checked_wherever_a_deploy_is_built():
    from mtp.core.decoding.strategy import Strategy

    with pytest.raises(ValueError, match="caps.max_k"):
        D.Deploy(
            tuned=D.Arm(Strategy.parse("static:2"), "mask"),
            fallback=D.Arm(Strategy.parse("ntp"), "mask"),
            tolerance=0.1,
            metric="exact",
            caps={"max_k": "abc"},
        )


# ---- U1: hashes required -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "hashes, words",
    [
        (None, "'hashes'"),
        ({}, "'hashes'"),
        ({"adapter": "0123456789abcdef"}, '"model"'),
        ({"model": ""}, '"model"'),
        ({"model": 12}, '"model"'),
        ({"model": "856f0d7611b5a6f7", "drafter": "0123"}, "unknown asset 'drafter'"),
        ({"model": "856f0d7611b5a6f7", "heads": "0123"}, "neither arm drafts from"),
    ],
)
def test_u1_deploy_file_without_hashes_is_refused(tmp_path, capsys, hashes, words):
    refused(deploy_file(tmp_path, hashes=hashes), capsys, words)


def test_u1_an_asset_the_arms_draft_from_must_be_hashed(tmp_path, capsys):
    refused(
        deploy_file(
            tmp_path,
            tuned={"strategy": "tree:8", "proposer": "heads+suffix+lookup"},
            caps={"max_k": 9},
            hashes={"model": "856f0d7611b5a6f7", "heads": "0123456789abcdef"},
            measured={**TUNED["measured"], "loss": 0.0},
        ),
        capsys,
        "datastore",
    )


# ---- the missing-asset message names the flag that loads it -------------------------------------------------
class FakeEngine:
    """What `check_engine` reads of an engine: the weights and the assets loaded."""

    def __init__(self, model):
        self.model, self.adapter_dir, self.asset_dirs = model, None, {}


@pytest.mark.parametrize(
    "kind, flag, noun",
    [
        ("eagle3", "--eagle3", "EAGLE-3 drafter"),
        ("heads", "--heads", "MTP heads"),
        ("datastore", "--datastore", "suffix datastore"),
        ("adapter", "--adapter", "mask adapter"),
    ],
)
def test_missing_asset_names_its_own_flag(tiny, kind, flag, noun):
    from mtp.cli import build_parser
    from mtp.core.decoding.strategy import Strategy

    engine = FakeEngine(tiny)
    deploy = D.Deploy(
        tuned=D.Arm(Strategy.parse("verify:4"), "mask"),
        fallback=D.Arm(Strategy.parse("ntp"), "mask"),
        tolerance=0.0,
        metric="exact",
        hashes={**D.engine_hashes(engine), kind: "0123456789abcdef"},
    )
    with pytest.raises(ValueError) as e:
        D.check_engine(deploy, engine)
    msg = str(e.value)
    assert f"pass {flag} DIR" in msg and noun in msg and "\n" not in msg
    others = {"--eagle3", "--heads", "--datastore", "--adapter"} - {flag}
    assert not any(o in msg for o in others)
    args = build_parser().parse_args(["serve", flag, "/some/dir"])  # the flag `mtp serve` really has
    assert getattr(args, flag[2:]) == "/some/dir"


# ---- issue 64: S3, a deploy file tuned with other --weights; U5, a folder, a byte-order mark ----------------
def hardware(weights: str) -> dict:
    return {"cpu": "x", "weights": weights, "t_q_ms": {"1": 10.0}}


@pytest.mark.parametrize(
    "line, flags",
    [
        ("native (kernels, avx2): 210 q4_1, 1 q8_0 linears", ["--weights", "native-int8"]),
        ("native (kernels, avx2): 210 q4_1, 1 q8_0 linears", ["--weights", "torch"]),
        ("native (kernels, avx2): 210 q4_1, 1 q8_0 linears", ["--no-pack"]),
        ("native-int8 (kernels, avx2): 211 q8_0 linears", []),
        ("torch (oneDNN-packed float32, not batch-invariant)", ["--weights", "float32"]),
    ],
)
def test_s3_deploy_file_tuned_with_other_weights_is_refused(tmp_path, capsys, line, flags):
    """`mtp serve --deploy` refuses a file whose `hardware.weights` (what `mtp tune` ran) is not the
    --weights this server runs, naming both, before any model loads (it used to start and roll out
    "loss within the tolerance" measured on other arithmetic)."""
    from mtp.cli import main

    path = deploy_file(tmp_path, hardware=hardware(line))
    D.read(path)  # the file itself is fine
    assert main(["serve", "--deploy", str(path), "--model", "/nowhere", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtp: error:") and len(err.strip().splitlines()) == 1, err
    tuned = line.split()[0]
    here = flags[1] if flags[:1] == ["--weights"] else ("torch" if flags == ["--no-pack"] else "native")
    assert f"--weights {tuned}" in err and f"--weights {here}" in err and "/nowhere" not in err


def test_s3_the_same_weights_or_no_record_pass():
    d = D.read(REPO / "benchmarks/results/tune/gsm8k100-full/deploy.json")  # written before mtp recorded them
    assert D.tuned_weights(d) is None
    D.check_weights(d, "native-int8")
    d.extra["hardware"] = hardware("native-int8 (kernels, avx2): 211 q8_0 linears")
    D.check_weights(d, "native-int8")
    with pytest.raises(ValueError, match="tuned with --weights native-int8, but this server runs --weights native"):
        D.check_weights(d, "native")


def test_u5_a_folder_or_a_byte_order_mark(tmp_path, capsys):
    """`--deploy DIR` says it is a folder (and which file inside it was meant); a UTF-8 byte-order mark
    is read past instead of reported as a truncated file."""
    path = deploy_file(tmp_path)
    err = refused(tmp_path, capsys, "is a directory")
    assert "not found" not in err and "deploy.json?" in err
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert str(D.read(bom).tuned) == "conf_adapt:0.95:4@mask"
