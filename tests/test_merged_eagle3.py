"""EAGLE-3 inside merged proposers (`--proposer eagle3+suffix+lookup`, issue 50): lossless greedy and seeded
sampling on tiny models and SmolLM2, the drafter's state following the committed tokens whichever part
drafted them, the trunk streams a merge gathers for its parts, and bad input refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import Oracle, committed_kv, committed_state, random_drafter, require_smollm2, save_drafter, tiny_model

from mtp.core.decoding.decode import Sequence, block_slack, decode_step, generate
from mtp.core.decoding.proposers import (
    REGISTRY,
    MergedProposer,
    PromptLookupProposer,
    check_proposer,
)
from mtp.core.decoding.proposers.eagle3 import Eagle3Proposer
from mtp.core.decoding.proposers.suffix import Datastore, SuffixProposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.runtime.cache import KVCache

PROMPT = [5, 17, 3, 44, 2, 9]


def params(n=30, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, **kw)


def merge(model, store=None, drafter_seed=1) -> MergedProposer:
    return MergedProposer(
        [Eagle3Proposer(model, random_drafter(model, seed=drafter_seed)), SuffixProposer(store), PromptLookupProposer()]
    )


def truth(seq: list[int], depth: int = 3) -> Oracle:
    """A merge part that knows the greedy continuation: its next `depth` tokens as a chain, sure of them,
    so the merged tree keeps them and the accepted nodes are mostly this part's, not the drafter's."""
    return Oracle.following([seq], depth=depth, confidence=1.0, name="truth")


def test_merge_exposes_the_union_of_its_parts_trunk_layers():
    model = tiny_model(3)
    a = Eagle3Proposer(model, random_drafter(model, aux=(0, 2)))
    b = Eagle3Proposer(model, random_drafter(model, aux=(1, 2), seed=2))
    b.name = "eagle3b"
    m = MergedProposer([a, PromptLookupProposer(), b])
    assert m.aux_layers == (0, 2, 1) and m.name == "eagle3+lookup+eagle3b"
    assert MergedProposer([SuffixProposer(None), PromptLookupProposer()]).aux_layers == ()
    with pytest.raises(ValueError, match="each part once"):
        MergedProposer([a, a])


@pytest.mark.parametrize("strategy", ["tree:1", "tree:4", "tree:8", "tree:31", "verify:2", "verify:4", "tree:auto"])
def test_greedy_eagle3_merges_equal_ntp(strategy):
    """Greedy `tree:N`, `tree:auto` and `verify:K` with eagle3+suffix+lookup give ntp's tokens exactly,
    with a datastore that knows the answer (its drafts accepted) and without one."""
    model = tiny_model(3)
    for prompt in (PROMPT, [7], [44, 2, 9, 9, 81, 30, 44, 2]):
        want = generate(model, prompt, "ntp", params()).output
        for store in (None, Datastore.from_answers([want[2:], want[7:]])):
            seq = Sequence(list(prompt), _strategy(strategy), params(), merge(model, store), pass_time=lambda q: 1.0)
            _run(model, seq)
            assert torch.equal(torch.tensor(seq.output), torch.tensor(want)), (strategy, prompt, store is None)


def test_seeded_sampling_eagle3_merge_trees_make_plain_samplings_draws():
    model = tiny_model(3)
    for seed in range(4):
        p = params(24, temperature=0.9, top_p=0.95, seed=seed)
        want = generate(model, PROMPT, "ntp", p).output
        store = Datastore.from_answers([want[2:], want[6:]])
        for strategy in ("tree:6", "tree:31"):
            got = generate(model, PROMPT, strategy, p, proposer=merge(model, store)).output
            assert torch.equal(torch.tensor(got), torch.tensor(want)), (seed, strategy)


def test_drafter_state_follows_nodes_another_part_drafted():
    """After every pass, the drafter's state inside the merge equals its state after feeding only the
    committed tokens, on passes whose accepted nodes the `truth` part drafted (the drafter, random, drafts
    almost none of them)."""
    model = tiny_model(3)
    want = generate(model, PROMPT, "ntp", params(40)).output
    drafter = Eagle3Proposer(model, random_drafter(model))
    merged = MergedProposer([drafter, truth(PROMPT + want), PromptLookupProposer()])
    seq = Sequence(list(PROMPT), _strategy("tree:6"), params(40), merged)
    cache = KVCache.for_model(model, 1, 128)
    others = 0
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)
            others += sum("eagle3" not in names for names in seq.stats.accepted_from[-1])
            if seq.finished:
                break
            n = cache.lengths[0]
            got, ref = seq.proposer_state["eagle3"], committed_state(model, drafter, seq.prompt_ids + seq.output, n)
            assert got["len"] == ref["len"] == n
            for a, b in zip((*committed_kv(got), got["h"]), (*committed_kv(ref), ref["h"])):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert seq.output == want and others >= 10, others  # most accepted nodes were truth's


def test_two_stateful_parts_read_their_own_layers_and_keep_their_own_state():
    """Two drafters over different trunk layers in one merge: each gets the streams of its own layers
    (columns of the union) and its own state, and both follow the committed tokens."""
    model = tiny_model(3)
    a = Eagle3Proposer(model, random_drafter(model, aux=(0, 2)))
    b = Eagle3Proposer(model, random_drafter(model, aux=(1, 2), seed=2))
    b.name = "eagle3b"
    want = generate(model, PROMPT, "ntp", params(30)).output
    seq = Sequence(list(PROMPT), _strategy("tree:8"), params(30), MergedProposer([a, b, truth(PROMPT + want, 2)]))
    cache = KVCache.for_model(model, 1, 128)
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)
            if seq.finished:
                break
            n = cache.lengths[0]
            for name, p in (("eagle3", a), ("eagle3b", b)):
                ref = committed_state(model, p, seq.prompt_ids + seq.output, n)
                got = committed_kv(seq.proposer_state[name])[0]
                torch.testing.assert_close(got, committed_kv(ref)[0], rtol=1e-4, atol=1e-4)
    assert seq.output == want


def test_capped_passes_still_feed_the_drafter_in_a_merge():
    """A scheduler's cap to K = 1 asks for no nodes; the merge still hands the drafter what the pass committed."""
    model = tiny_model(3)
    merged = merge(model)
    seq = Sequence(list(PROMPT), _strategy("tree:4"), params(30), merged)
    cache = KVCache.for_model(model, 1, 128)
    with torch.inference_mode():
        while not seq.finished:
            seq.k_override = 1 if seq.stats.forward_passes % 3 == 1 else None
            decode_step(model, cache, [seq], None)
    assert seq.output == generate(model, PROMPT, "ntp", params(30)).output


@pytest.mark.parametrize(
    "name, words",
    [
        ("eagle3+eagle3", "each part once"),
        ("eagle3+mask", "cannot be merged"),
        ("mask-single+eagle3+suffix", "cannot be merged"),
    ],
)
def test_bad_merges_are_refused_by_name(name, words):
    with pytest.raises(ValueError, match=words):
        check_proposer(name)


def test_eagle3_merges_are_accepted_by_name():
    assert check_proposer("eagle3+suffix+lookup").parts == ("eagle3", "suffix", "lookup")
    assert check_proposer("heads+eagle3+suffix+lookup").parts == ("heads", "eagle3", "suffix", "lookup")


def _cli(tiny_hf_dir, *extra) -> list[str]:
    return [
        "generate",
        "--model",
        str(tiny_hf_dir),
        "--adapter",
        "none",
        "--strategy",
        "tree:8",
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
        "--json",
        *extra,
        "hello",
    ]


def test_cli_eagle3_merge_bad_input_is_one_line(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    """eagle3+eagle3 (refused before the model loads), a drafter made for another model, and suffix
    without a datastore: one line, exit 2; the good merge runs and equals ntp."""
    from mtp.cli import main
    from mtp.core.runtime import loading

    model = loading.load(str(tiny_hf_dir)).model
    save_drafter(model, tmp_path / "good", random_drafter(model, draft_vocab=500))
    other = tiny_model(9, vocab_size=49152)
    save_drafter(other, tmp_path / "other", random_drafter(other, draft_vocab=500))
    ds = tmp_path / "ds"
    Datastore.from_answers([[5, 6, 7, 8]]).save(ds, model)

    assert main(_cli(tiny_hf_dir, "--strategy", "ntp")) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    good = ["--proposer", "eagle3+suffix+lookup", "--eagle3", str(tmp_path / "good"), "--datastore", str(ds)]
    assert main(_cli(tiny_hf_dir, *good)) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want

    bad = [
        (["--proposer", "eagle3+eagle3"], "each part once"),
        (
            ["--proposer", "eagle3+suffix+lookup", "--eagle3", str(tmp_path / "other"), "--datastore", str(ds)],
            "another",
        ),
        (
            ["--proposer", "eagle3+suffix+lookup", "--eagle3", str(tmp_path / "good"), "--datastore", "none"],
            "--datastore",
        ),
    ]
    for argv, needle in bad:
        assert main(_cli(tiny_hf_dir, *argv)) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("mtp: error:") and needle in err, err

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad name was refused")

    monkeypatch.setattr(loading, "load", refuse)
    assert main(_cli(tiny_hf_dir, "--proposer", "eagle3+eagle3")) == 2
    assert "each part once" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smollm2_merge():
    """SmolLM2 with the shipped drafter and datastore, `--proposer eagle3+suffix+lookup` (loaded once)."""
    require_smollm2()
    from mtp.core.engine import Engine, EngineConfig

    return Engine.load(EngineConfig(adapter="none", proposer="eagle3+suffix+lookup"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tree:8", "tree:auto", "verify:4"])
def test_smollm2_eagle3_merge_equals_ntp(smollm2_merge, strategy):
    """The shipped drafter, datastore and prompt lookup merged on the real model: greedy output is ntp's
    token for token, in fewer passes, and seeded sampling of a tree makes plain sampling's draws."""
    engine = smollm2_merge
    for prompt in (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "Repeat this list twice: apple, pear, plum, cherry, fig.",
    ):
        ids = engine.encode(prompt)
        ref = engine.generate(ids, "ntp", SamplingParams(max_new_tokens=32))
        out = engine.generate(ids, strategy, SamplingParams(max_new_tokens=32))
        assert torch.equal(torch.tensor(out.token_ids), torch.tensor(ref.token_ids)), (strategy, prompt)
        assert out.summary["forward_passes"] < ref.summary["forward_passes"]
        assert set(engine.proposer().aux_layers) == set(engine.proposer("eagle3").aux_layers)
        if strategy == "tree:8":
            p = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=3)
            want = engine.generate(ids, "ntp", p).token_ids
            assert torch.equal(torch.tensor(engine.generate(ids, strategy, p).token_ids), torch.tensor(want))


def _strategy(text):
    return Strategy.parse(text)


def _run(model, seq):
    cache = KVCache.for_model(model, 1, len(seq.prompt_ids) + seq.params.max_new_tokens + block_slack(seq.strategy.k))
    with torch.inference_mode():
        while not seq.finished:
            decode_step(model, cache, [seq], None)


def test_auto_default_is_the_shipped_merge_less_what_the_user_turned_off():
    from mtp.core.decoding.proposers import SHIPPED_DEFAULT, resolve_default

    best = SHIPPED_DEFAULT["smollm2-135m"]
    assert len(check_proposer(best).parts) > 1  # a merge
    assert resolve_default("auto", "smollm2-135m") == best
    assert resolve_default("auto", "/some/hf/dir") == "mask"  # no shipped drafters: the mask proposer
    assert resolve_default("heads", "smollm2-135m") == "heads"  # a name given is kept
    for off in (("heads",), ("eagle3",), ("datastore",), ("heads", "eagle3", "datastore")):
        less = resolve_default("auto", "smollm2-135m", off)
        assert check_proposer(less) and not {REGISTRY[p].asset for p in less.split("+")} & set(off), (off, less)


def test_generate_and_serve_default_to_auto_other_commands_to_mask():
    import argparse

    from mtp.cli import bench, generate, pipeline, serve
    from mtp.cli.options import engine_config

    for module, want in ((generate, "auto"), (serve, "auto"), (bench, "mask"), (pipeline, "mask")):
        ap = argparse.ArgumentParser()
        module.add_parser(ap.add_subparsers())
        sub = ap._subparsers._group_actions[0].choices
        (parser,) = sub.values()
        assert parser.get_default("proposer") == want, module.__name__
    args = argparse.Namespace(
        model="smollm2-135m", adapter="none", proposer="auto", heads="auto", eagle3="auto", datastore="none"
    )
    args.threads, args.device = 0, "cpu"
    cfg = engine_config(args)
    assert cfg.proposer == args.proposer and "suffix" not in cfg.proposer.split("+")  # --datastore none
