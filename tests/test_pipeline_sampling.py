"""Sampling through `mtp pipeline` (issue 47): `--temperature/--top-k/--top-p/--seed` decode across the
stages to exactly the tokens (and per-pass chunks) of the single-process `mtp generate` with the same
flags, for ntp and the lossless `verify` and `tree` strategies, with drafts really accepted; a bad
sampling flag is one line before any stage starts.

The model: a tiny word-level model whose layers barely touch the residual stream (o_proj and
down_proj scaled by 0.02), so its next token is mostly a function of the current one, with a sharper
head: sampled text falls into short cycles that prompt lookup drafts, and rejection sampling then
both accepts and rejects drafts (a random tiny model never accepts a sampled draft)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_model, word_tokenizer

from mtp.cli import build_parser
from mtp.cli import main as cli_main
from mtp.pipeline.launch import launch_local

PROMPT = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"
SAMPLING = ["--temperature", "1.0", "--top-k", "20", "--top-p", "0.95", "--max-new-tokens", "40"]
JOBS = [("ntp", "11"), ("verify:3", "11"), ("tree:5", "11"), ("ntp", "12")]


@pytest.fixture(autouse=True)
def keep_threads():
    """The runs here use one thread (`--threads 1` sets this process's torch threads): put them back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cycling_model(tmp_path_factory):
    from mtp.core.runtime.loading import save_hf_dir

    fast = word_tokenizer()
    model = tiny_model(0)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.mul_(0.02)
            layer.mlp.down_proj.weight.mul_(0.02)
        model.lm_head.weight.mul_(3.0)
    path = tmp_path_factory.mktemp("cycling") / "model"
    save_hf_dir(model, path, fast)
    return path


def flags(model, strategy, seed):
    return [
        PROMPT,
        "--model",
        str(model),
        "--adapter",
        "none",
        "--proposer",
        "lookup",
        "--strategy",
        strategy,
        *SAMPLING,
        "--seed",
        seed,
        "--threads",
        "1",
        "--json",
    ]


def generate_json(model, strategy, seed, capture) -> dict:
    """`mtp generate` (one process) with the same flags; `capture`: capsys or capfd."""
    assert cli_main(["generate", *flags(model, strategy, seed)]) == 0
    return json.loads(capture.readouterr().out.strip().splitlines()[-1])


def _stage(rank, world, model, outfile):
    """What `mtp pipeline` runs in each stage (`launch.cli_stage`), for several flag sets in one launch:
    the flags parsed by the CLI's own parser, the engine loaded from them, `Engine.generate` with
    `sampling_params(args)` through the pipeline model."""
    from mtp.cli.options import engine_config, sampling_params
    from mtp.cli.pipeline import config_from_args
    from mtp.core.engine import Engine
    from mtp.pipeline.stages import run_stage

    torch.set_num_threads(1)
    parsed = [build_parser().parse_args(["pipeline", *flags(model, s, seed)]) for s, seed in JOBS]
    engine = Engine.load(engine_config(parsed[0]))

    def stage0(pipe):
        engine.model = pipe
        rows = []
        for args in parsed:
            r = engine.generate(args.prompt, args.strategy, sampling_params(args), chat=args.chat)
            rows.append({"token_ids": r.token_ids, "chunks": r.to_json()["chunks"]})
        with open(outfile, "w") as f:
            json.dump(rows, f)

    run_stage(rank, world, engine.model, config_from_args(parsed[0]), stage0)
    return 0


def test_sampled_pipeline_equals_single_process_generate(cycling_model, tmp_path, capsys):
    torch.set_num_threads(1)
    refs = [generate_json(cycling_model, s, seed, capsys) for s, seed in JOBS]
    out = tmp_path / "stage0.json"
    assert launch_local(2, _stage, (str(cycling_model), str(out))) == 0
    got = json.loads(out.read_text())
    for (strategy, seed), ref, res in zip(JOBS, refs, got):
        assert res["token_ids"] == ref["token_ids"], (strategy, seed)
        assert res["chunks"] == ref["chunks"], (strategy, seed)
    for (strategy, _), ref in zip(JOBS, refs):
        if strategy != "ntp":  # sampled drafts were accepted (and rejected): rejection sampling ran both ways
            assert max(ref["chunks"]) > 1 and min(ref["chunks"]) == 1, strategy
    assert refs[0]["token_ids"] != refs[3]["token_ids"]  # the seed is used: another seed, other text


def test_mtp_pipeline_command_samples_like_generate(cycling_model, capfd):
    """The command itself (`mtp pipeline --stages 2`, flags → stage processes): tree:5, sampled."""
    torch.set_num_threads(1)
    ref = generate_json(cycling_model, "tree:5", "11", capfd)
    assert cli_main(["pipeline", "--stages", "2", *flags(cycling_model, "tree:5", "11")]) == 0
    got = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert got["token_ids"] == ref["token_ids"] and got["chunks"] == ref["chunks"] and got["stages"] == 2


@pytest.mark.parametrize(
    "bad, words",
    [
        (["--temperature", "nan"], "temperature"),
        (["--seed", "-1"], "seed"),
        (["--top-p", "0"], "top_p"),
        (["--top-k", "-3"], "top_k"),
        (["--temperature", "3"], "temperature"),
    ],
)
def test_bad_sampling_flags_are_one_line_before_any_stage(cycling_model, capfd, bad, words):
    code = cli_main(["pipeline", "--stages", "2", *flags(cycling_model, "tree:5", "11"), *bad])
    out, err = capfd.readouterr()
    assert code == 2 and out == "", out
    assert err.startswith("mtp: error:") and err.count("\n") == 1 and words in err, err
    assert "stage" not in err  # refused here, not by a stage
