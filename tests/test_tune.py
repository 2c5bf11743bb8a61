"""`mtp tune` (mtp.tune) and calibration (mtp.core.policy.calibration): calibration halves the error of
over-confident guesses on held-out pairs, the (confidence, right) pairs come from the right passes,
offline batched decoding gives the single-stream outputs, predictability reads the model's own
confidences, the end-to-end run writes a deploy file whose choice is the fastest measured
configuration within the tolerance, the toy check prints blocks, and bad input is one line."""

from __future__ import annotations

import json
import random
import re

import pytest

from mtp.core.decoding.proposers import DraftRequest, Guesses, Proposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.engine import Engine, EngineConfig
from mtp.core.policy import calibration as calib
from mtp.core.policy import deploy as D
from mtp.tune import predictability
from mtp.tune.offline import Output, chain_pairs, decode_all, tree_pairs


def overconfident(n, seed):
    """Pairs whose real probability of being right is c**3 (a proposer far too sure of itself)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        c = rng.uniform(0.3, 1.0)
        out.append((c, rng.random() < c**3))
    return out


def test_calibration_halves_the_error_on_held_out_pairs():
    fitted = calib.fit([overconfident(3000, 0)])
    held_out = overconfident(3000, 1)
    before = calib.expected_calibration_error(held_out)
    after = calib.expected_calibration_error([(fitted.map(0, c), r) for c, r in held_out])
    assert before > 0.1 and after < before / 2
    assert fitted.depths[0].temperature != 1.0
    # monotone: the order of guesses is kept
    cs = [0.31, 0.5, 0.7, 0.9, 0.99]
    mapped = [fitted.map(0, c) for c in cs]
    assert mapped == sorted(mapped)
    # depths beyond the fitted ones use the last map; the identity when there is nothing to learn
    assert fitted.map(5, 0.7) == fitted.map(0, 0.7)
    assert calib.fit_depth([(0.9, True)] * 50) == calib.DepthMap()
    # confidences all near 1 but right half the time (an over-sure mask group): the map learns the rate,
    # within bounds, instead of running off to a step function
    rng = random.Random(2)
    sure = [(rng.uniform(0.999, 1.0), rng.random() < 0.5) for _ in range(300)]
    m = calib.fit_depth(sure)
    rate = sum(r for _, r in sure) / len(sure)
    assert abs(m(0.9995) - rate) < 0.05 and calib.W_RANGE[0] <= 1 / m.temperature <= calib.W_RANGE[1]
    assert calib.expected_calibration_error([]) is None
    with pytest.raises(ValueError, match="temperatures must be finite"):
        calib.Calibration.from_json([{"temperature": 0, "bias": 0}])
    with pytest.raises(ValueError, match="a calibration is a list"):
        calib.Calibration.from_json({"temperature": 1})


def test_calibrated_proposer_maps_confidences_and_keeps_tokens():
    class Fixed(Proposer):
        name = "fixed"

        def propose(self, request):
            return Guesses([5, 6, 7], [0.9, 0.8, 0.7])

    c = calib.Calibration((calib.DepthMap(2.0, 0.0), calib.DepthMap(1.0, -1.0)))
    g = calib.CalibratedProposer(Fixed(), c).propose(DraftRequest(None, 3))
    assert g.tokens == [5, 6, 7]
    assert g.confidences == pytest.approx([c.map(0, 0.9), c.map(1, 0.8), c.map(1, 0.7)])
    assert g.confidences[0] == pytest.approx(0.75)  # sigmoid(logit(0.9) / 2) = 3 / (3 + 1)


def test_chain_pairs_reads_each_proposal_against_the_next_pass():
    out = Output(
        ids=[],
        text="",
        chunks=[1, 3, 1, 4, 2],
        blocks=[],
        finish="length",
        proposals=[[0.9, 0.8, 0.7], [0.6, 0.5, 0.4], [0.9, 0.9, 0.9], [0.1, 0.1, 0.1], [0.2]],
    )
    pairs = chain_pairs(out)
    # pass 1 emitted 3 = 2 accepted + its own: guesses 0, 1 right, guess 2 reached and wrong;
    # pass 2 accepted none; pass 3 accepted 3; the last pass (4) may be cut, so proposal 3 is left out
    assert pairs[0] == [(0.9, True), (0.6, False), (0.9, True)]
    assert pairs[1] == [(0.8, True), (0.9, True)]
    assert pairs[2] == [(0.7, False), (0.9, True)]


def test_tree_pairs_check_each_nodes_path_against_the_output():
    # after pass 0 (1 token) the output continues 7 8 9; after pass 1 (3 tokens) it continues 4
    out = Output(
        ids=[1, 7, 8, 9, 4],
        text="",
        chunks=[1, 3, 1],
        blocks=[],
        finish="length",
        trees=[([7, 5, 8, 9], [-1, -1, 0, 2], [0.9, 0.5, 0.6, 0.4]), ([4, 6], [-1, 0], [0.8, 0.3]), ([2], [-1], [0.7])],
    )
    pairs = tree_pairs(out)
    assert pairs[0] == [(0.9, True), (0.5, False), (0.8, True)]
    assert pairs[1] == [(0.6, True)]  # 7 8; the path 4 6 runs past the output's end: unknown, left out
    assert pairs[2] == [(0.4, True)]  # 7 8 9


def test_merge_compares_calibrated_node_probabilities():
    from mtp.core.decoding.proposers import MergedProposer

    class Part(Proposer):
        def __init__(self, name, token, conf):
            self.name, self.token, self.conf = name, token, conf

        def propose(self, request):
            return Guesses([self.token], [self.conf], None, [-1])

    # uncalibrated: fixed priors (heads 1.0 x 0.5 beats lookup 0.5 x 1.0 only on ties: both 0.5 here)
    heads, lookup = Part("heads", 11, 0.6), Part("lookup", 22, 1.0)
    one_node = DraftRequest(None, 1, True)
    g = MergedProposer([heads, lookup]).propose(one_node)
    assert g.tokens == [11]  # 0.6 > 0.5 x 1.0
    # calibrated: lookup's 1.0 means "right 90 % of the time", heads' 0.6 means 0.3: lookup's node wins
    lookup_cal = calib.CalibratedProposer(lookup, tree=calib.fit([[(1.0, True)] * 90 + [(1.0, False)] * 10]))
    heads_cal = calib.CalibratedProposer(heads, tree=calib.Calibration((calib.DepthMap(1.0, -1.253),)))
    g = MergedProposer([heads_cal, lookup_cal]).propose(one_node)
    assert g.tokens == [22] and g.confidences[0] == pytest.approx(0.9, abs=1e-3)
    assert heads_cal.propose(one_node).confidences[0] == pytest.approx(0.3, abs=1e-3)
    from mtp.core.decoding.proposers import PromptLookupProposer  # a tree map gives lookup no chain confidences

    assert calib.CalibratedProposer(PromptLookupProposer(), tree=lookup_cal.tree_calibration).has_confidence is False


def test_offline_batches_give_the_single_stream_outputs(engine):
    prompts = [engine.encode(p, chat=True) for p in ("abc", "hello there", "x", "count: 1 2 3")]
    ntp = decode_all(engine, prompts, Strategy(), None, 12, batch=3)
    ver = decode_all(engine, prompts, Strategy.parse("verify:4"), "mask", 12, batch=3, record=True)
    for p, a, b in zip(prompts, ntp.outputs, ver.outputs):
        want = engine.generate(p, "ntp", SamplingParams(max_new_tokens=12))
        assert a.ids == want.token_ids and b.ids == want.token_ids  # batched and lossless
        assert len(b.proposals) == len(b.chunks)  # one proposal per pass
        assert sum(len(d) for d in chain_pairs(b)) > 0
    assert ver.guesses > 0 and ver.proposing_s > 0 and ver.guess_s > 0
    stopped = decode_all(engine, prompts, Strategy(), None, 12, batch=1, stop_after=lambda j, o: j == 1)
    assert [o.ids for o in stopped.outputs] == [o.ids for o in ntp.outputs[:2]]


def test_predictability_reads_the_models_own_confidences(engine):
    ids = engine.encode("hello there", chat=True)
    res = engine.generate(ids, "ntp", SamplingParams(max_new_tokens=10))
    logits, hidden = predictability.teacher_forced(engine.model, ids, res.token_ids)
    assert hidden.shape[0] == len(ids) + len(res.token_ids)
    entropy, top1 = predictability.token_stats(logits)
    assert len(top1) == len(res.token_ids)
    assert top1 == pytest.approx(res.confidences[: len(top1)], abs=1e-4)  # teacher-forced = decoded
    assert all(e >= 0 for e in entropy)
    rep = predictability.report(
        engine.model,
        [{"prompt": "a", "category": "x"}, {"prompt": "b", "category": "y"}],
        [ids, ids],
        [res.token_ids, res.token_ids],
    )
    assert set(rep) == {"x", "y", "all"} and rep["all"]["tokens"] == 2 * len(top1)
    shares = [rep["all"]["share_at_least"][t] for t in ("0.5", "0.8", "0.9", "0.95", "0.99")]
    assert shares == sorted(shares, reverse=True)


def prompts_file(path, n=4):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"say {i} {i} {i}", "category": "rep" if i % 2 else "say"}) + "\n")
    return path


def test_tune_end_to_end_chooses_the_fastest_measured_within_tolerance(tiny_dir, tmp_path, capsys):
    from mtp.cli import main

    data = prompts_file(tmp_path / "p.jsonl")
    out = tmp_path / "tuned"
    argv = [
        "tune",
        "--model",
        str(tiny_dir),
        "--adapter",
        "none",
        "--data",
        f"prompts:{data}",
        "--tolerance",
        "0",
        "--metric",
        "exact",
        "--limit",
        "4",
        "--probe",
        "2",
        "--calibrate",
        "3",
        "--measure",
        "2",
        "--max-new-tokens",
        "12",
        "--candidates",
        "verify:4@mask,static:4@mask,static:2@mask,conf_adapt:0.9:4@mask,tree:4@lookup",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert "mtp tune:" in capsys.readouterr().out
    deploy = D.read(out / "deploy.json")
    res = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == {
        "ntp",
        "verify:4@mask",
        "static:4@mask",
        "static:2@mask",
        "conf_adapt:0.9:4@mask",
        "tree:4@lookup",
    }
    assert rows["tree:4@lookup"]["note"] == "replayed on 4 answers" and rows["tree:4@lookup"]["qualifies"]
    assert rows["verify:4@mask"]["note"] == "decoded on 3 prompts"  # its calibration run: --calibrate 3
    assert rows["verify:4@mask"]["qualifies"] and rows["verify:4@mask"]["loss"] == 0.0
    static = rows["static:2@mask"]
    assert static["qualifies"] is False and static["probe_loss"] > 0  # random guesses change the output
    # its lossier family member is not even probed
    assert rows["static:4@mask"]["qualifies"] is False and rows["static:4@mask"]["note"].startswith("not probed")
    measured = [r for r in rows.values() if r["qualifies"] and r["measured_tps"] is not None]
    best = max(measured, key=lambda r: r["measured_tps"])
    assert str(deploy.tuned) in (best["name"], "ntp") and res["chosen"] == best["name"]
    assert deploy.fallback.strategy.lossless and deploy.tolerance == 0 and deploy.metric == "exact"
    loaded = Engine.load(EngineConfig(model=str(tiny_dir), adapter="none"))
    D.check_engine(deploy, loaded)  # tuned on these weights
    assert set(res["predictability"]) == {"say", "rep", "all"}
    acc = rows["verify:4@mask"]["by_category"]
    assert set(acc) == {"say", "rep"} and all(a["acceptance_by_position"][0] == 1.0 for a in acc.values())
    assert "mask" in res["calibration"] and res["calibration"]["mask"]["test_pairs"] > 0
    html = (out / "report.html").read_text()
    assert "Predictability" in html and "Calibration" in html and (out / "pareto.png").stat().st_size > 0
    assert main(argv) == 0  # a folder tune wrote may be replaced
    # --measure-all: every candidate that is lossless or passed its probe is measured; the default rule's
    # pick is read from the same interleaved run and is never faster than the sweep's best
    full = tmp_path / "full"
    wide = argv[: argv.index("--out")] + ["--tolerance", "1", "--measure-all", "--out", str(full)]
    assert main(wide) == 0
    res = json.loads((full / "results.json").read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert res["measure_all"] and res["price_pick"] in rows
    assert all(r["measured_tps"] is not None for r in rows.values() if r["lossless"])
    lossy = [r for r in rows.values() if not r["lossless"] and r["qualifies"] is not False]
    assert lossy and all(r["measured_tps"] is not None for r in lossy)
    best = max(
        (r for r in rows.values() if r["qualifies"] and r["measured_tps"] is not None), key=lambda r: r["measured_tps"]
    )
    assert res["chosen"] == best["name"] and res["price_pick_vs_best"] <= 1.0


def test_tune_refuses_bad_input_in_one_line(tiny_dir, tmp_path, capsys):
    from mtp.cli import main

    data = prompts_file(tmp_path / "p.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    bad_cfg = tmp_path / "cfg.toml"
    bad_cfg.write_text("tolerance = 0.02\nwarp = 9\n")
    good_cfg = tmp_path / "cfg.json"
    good_cfg.write_text(json.dumps({"data": f"prompts:{data}", "tolerance": 0.5, "metric": "exact"}))
    base = ["tune", "--model", str(tiny_dir), "--adapter", "none"]
    cases = [
        (["--data", f"prompts:{data}", "--tolerance", "1.5", "--out", str(tmp_path / "o")], "[0, 1]"),
        (["--data", f"prompts:{data}", "--tolerance", "-0.1", "--out", str(tmp_path / "o")], "[0, 1]"),
        (
            ["--data", f"prompts:{data}", "--tolerance", "0.1", "--metric", "bleu", "--out", str(tmp_path / "o")],
            "unknown metric",
        ),
        (["--data", f"prompts:{empty}", "--tolerance", "0.1", "--out", str(tmp_path / "o")], "no items"),
        (["--data", f"prompts:{data}", "--tolerance", "0.1", "--out", str(foreign)], "did not write"),
        (["--config", str(bad_cfg), "--out", str(tmp_path / "o")], "unknown option 'warp'"),
        (["--tolerance", "0.1", "--out", str(tmp_path / "o")], "needs --data"),
        (["--config", str(good_cfg), "--tolerance", "3", "--out", str(tmp_path / "o")], "[0, 1]"),
        (
            ["--data", f"prompts:{data}", "--tolerance", "0.1", "--candidates", "ntp", "--out", str(tmp_path / "o")],
            "names no candidate",
        ),
        (
            ["--data", f"prompts:{data}", "--tolerance", "0.1", "--probe", "0", "--out", str(tmp_path / "o")],
            "--probe must be",
        ),
    ]
    for flags, words in cases:
        assert main(base + flags) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search(re.escape(words), err), (flags, err)
    assert (foreign / "notes.txt").read_text() == "mine" and not (tmp_path / "o").exists()


def test_toy_check_prints_blocks(engine, capsys):
    from mtp.tune import toy

    lines = []
    rows = toy.run(engine, max_new_tokens=12, write=lines.append, colour=False)
    strategies = {r["strategy"] for r in rows}
    assert strategies == {"ntp", "verify:4@mask", "conf_adapt:0.9:4@mask"}
    assert all(r["tokens_per_forward"] == 1.0 for r in rows if r["strategy"] == "ntp")
    assert sum(1 for line in lines if "tokens/pass" in line) == len(rows) == 3 * len(toy.PROMPTS)


def test_a_map_that_makes_held_out_answers_worse_is_not_used():
    from mtp.tune.run import fit_held_out

    rng = random.Random(3)
    # even-numbered prompts: confident guesses mostly wrong; odd ones: confident guesses right
    even = [[(rng.uniform(0.8, 1.0), rng.random() < 0.1) for _ in range(200)]]
    odd = [[(rng.uniform(0.8, 1.0), rng.random() < 0.95) for _ in range(200)]]
    fitted, rep = fit_held_out([even, odd, even, odd])
    assert rep["ece_after"] > rep["ece_before"] and rep["used"] is False
    assert fitted.map(0, 0.9) == pytest.approx(0.9)  # the raw confidences stay
    _, rep = fit_held_out([[overconfident(400, seed)] for seed in range(4)])
    assert rep["used"] is True and rep["ece_after"] < rep["ece_before"]


def test_held_out_error_is_the_mean_of_two_cross_fitted_folds():
    from mtp.core.policy import calibration as calib
    from mtp.tune.run import fit_held_out

    prompts = [[overconfident(150, seed), overconfident(100, seed + 50)] for seed in range(6)]  # 2 depths each
    fitted, rep = fit_held_out(prompts)
    by_hand = []
    for fit_on in (0, 1):  # a map fitted on one parity of prompts, scored on the other, by hand
        pick = lambda parity: [[p for j, pr in enumerate(prompts) if j % 2 == parity for p in pr[d]] for d in (0, 1)]
        m, scored = calib.fit(pick(fit_on)), pick(1 - fit_on)
        by_hand.append(
            (
                calib.expected_calibration_error([p for d in scored for p in d]),
                calib.expected_calibration_error([(m.map(d, c), r) for d in (0, 1) for c, r in scored[d]]),
            )
        )
    assert rep["folds"] == 2 and rep["test_pairs"] == rep["fit_pairs"] == 6 * 250  # every prompt held out once
    assert rep["ece_before"] == pytest.approx((by_hand[0][0] + by_hand[1][0]) / 2)
    assert (
        rep["ece_after"] == pytest.approx((by_hand[0][1] + by_hand[1][1]) / 2) and rep["ece_after"] < rep["ece_before"]
    )
    assert (
        fitted.to_json() == calib.fit([[p for pr in prompts for p in pr[d]] for d in (0, 1)]).to_json()
    )  # all prompts


def test_quality_losses():
    from mtp.core.policy import quality

    assert quality.item_loss("exact", [1, 2], "a", [1, 2], "a") == 0.0
    assert quality.item_loss("exact", [1, 2], "a", [1, 3], "a") == 1.0
    assert quality.item_loss("answer", [1], "so 12", [2], "it is 12") == 0.0
    assert quality.item_loss("answer", [1], "so 12", [2], "it is 13") == 1.0
    assert quality.item_loss("rougeL", [1], "你好", [1], "你好") == 0.0  # identical, though ROUGE sees no tokens
    assert 0 < quality.item_loss("rougeL", [1], "the cat sat", [2], "the dog sat") < 1
    with pytest.raises(ValueError, match="unknown metric"):
        quality.item_loss("bleu", [], "", [], "")


def test_lossy_bound_prices_the_recorded_passes():
    from mtp.core.policy.costmodel import CostModel
    from mtp.tune.bound import lossy_bound
    from mtp.tune.offline import RunStats

    cost = CostModel({1: 0.1, 2: 0.15, 4: 0.2})
    # two prompts; the first pass (the prompt's) is left out of the pricing
    outs = [
        Output([], "", [1, 1, 1], [5, 1, 1], "length", proposals=[[0.1, 0.1, 0.1], [0.99, 0.97, 0.5], [0.2, 0.9, 0.9]]),
        Output([], "", [1, 1], [5, 1], "length", proposals=[[0.0] * 3, [0.96, 0.1, 0.99]]),
    ]
    records = RunStats(outs, proposing_s=0.09, guesses=9)  # 0.01 s per guess
    # conf_adapt:0.95:4: passes emit 1 + leading guesses >= 0.95 -> 3, 1, 2 (own token taken as sure)
    tpf, tps = lossy_bound(Strategy.parse("conf_adapt:0.95:4"), 0, cost, records)
    fed = [1, 3, 1]  # each pass feeds what the previous one emitted
    seconds = sum(cost.pass_time(q) for q in fed) + 3 * 0.03
    assert tpf == pytest.approx(2.0) and tps == pytest.approx(6 / seconds)
    # masks appended to every pass are paid for; a calibration lowers what passes the threshold
    _, tps_masks = lossy_bound(Strategy.parse("conf_adapt:0.95:4"), 3, cost, records)
    assert tps_masks == pytest.approx(6 / (sum(cost.pass_time(q + 3) for q in fed) + 3 * 0.03))
    halved = calib.Calibration((calib.DepthMap(temperature=1.0, bias=-3.0),))
    assert lossy_bound(Strategy.parse("conf_adapt:0.95:4"), 0, cost, records, halved)[0] == pytest.approx(1.0)
    # static:K emits K every pass and pays K-1 guesses of proposing
    tpf, tps = lossy_bound(Strategy.parse("static:2"), 0, cost, records)
    assert tpf == 2 and tps == pytest.approx(6 / (cost.pass_time(1) + 2 * cost.pass_time(2) + 3 * 0.01))
    # more guesses than were recorded: no bound
    assert lossy_bound(Strategy.parse("conf_adapt:0.9:8"), 0, cost, records) is None


# ---- issue 47: which GSM8K file `mtp tune --data gsm8k:...` reads -----------------------------------
def gsm8k_folder(path, train=True, test=True):
    """A GSM8K-style folder: test.jsonl (3 questions) and train.jsonl (2 other questions)."""
    path.mkdir(parents=True, exist_ok=True)
    splits = {
        "test.jsonl": [("What is 2 + 3?", "5"), ("What is 7 - 4?", "3"), ("What is 3 * 3?", "9")],
        "train.jsonl": [("Add 10 and 20.", "30"), ("Take 1 from 8.", "7")],
    }
    for name, rows in splits.items():
        if (name == "test.jsonl" and test) or (name == "train.jsonl" and train):
            (path / name).write_text(
                "".join(json.dumps({"question": q, "answer": f"so #### {a}"}) + "\n" for q, a in rows)
            )
    return path


TINY_TUNE = [
    "--adapter",
    "none",
    "--tolerance",
    "0.02",
    "--max-new-tokens",
    "8",
    "--probe",
    "2",
    "--calibrate",
    "2",
    "--measure",
    "1",
    "--measure-rows",
    "1",
    "--candidates",
    "verify:2@lookup",
    "--threads",
    "1",
]


def test_tune_reads_a_gsm8k_folders_test_split_and_says_which_file(tiny_dir, tmp_path, capsys):
    """gsm8k:DIR is DIR/test.jsonl (the evaluation split, never train.jsonl beside it), and the log line,
    results.json and deploy.json name that file, not just the folder."""
    import torch

    from mtp.cli import main

    folder = gsm8k_folder(tmp_path / "gsm8k")
    out = tmp_path / "tuned"
    threads = torch.get_num_threads()
    try:  # --threads 1 (a tiny model's t(q) on a busy machine) sets this process's torch threads
        assert main(["tune", "--model", str(tiny_dir), *TINY_TUNE, "--data", f"gsm8k:{folder}", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    test_file = folder / "test.jsonl"
    assert f"tune: 3 prompts (gsm8k:{test_file})" in err, err
    res = json.loads((out / "results.json").read_text())
    assert res["kind"] == "gsm8k" and res["prompts"] == 3  # the test split's 3 questions, not train's 2
    assert D.read(out / "deploy.json").extra["measured"]["data"] == f"gsm8k:{test_file}"


def test_tune_refuses_a_gsm8k_folder_without_test_split_and_a_training_split(tiny_dir, tmp_path, capsys):
    """A folder without test.jsonl is one line (its train.jsonl is never read instead); a GSM8K training
    split (named train*, no GSM8K test question in it; a link named otherwise included) is one line:
    mtp's proposers learn from GSM8K train, so tune would measure them on their own training prompts.
    A file named train.jsonl that holds GSM8K test questions is evaluation data (by its content)."""
    from mtp.cli import main
    from mtp.tune.run import tune_data

    only_train = gsm8k_folder(tmp_path / "only-train", test=False)
    both = gsm8k_folder(tmp_path / "both")
    link = tmp_path / "my-questions.jsonl"
    link.symlink_to(both / "train.jsonl")
    cases = [
        (f"gsm8k:{only_train}", "is a folder without test.jsonl"),
        (f"gsm8k:{tmp_path / 'empty-folder'}", "is a folder without test.jsonl"),
        (f"gsm8k:{both / 'train.jsonl'}", "is a training split (named train.jsonl"),
        (f"gsm8k:{link}", "is a training split (named my-questions.jsonl -> train.jsonl"),
    ]
    (tmp_path / "empty-folder").mkdir()
    for data, words in cases:
        code = main(["tune", "--model", str(tiny_dir), *TINY_TUNE, "--data", data, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("mtp: error:") and err.count("\n") == 1 and words in err, (data, err)
    assert not (tmp_path / "o").exists()
    import mtp.training.eval_guard as guard  # a train-named file of GSM8K test questions is evaluation data

    real = guard.evaluation_set
    try:
        guard.evaluation_set = lambda text: "GSM8K test" if text.startswith("Add 10") else real(text)
        assert tune_data(f"gsm8k:{both / 'train.jsonl'}", None) == f"gsm8k:{both / 'train.jsonl'}"
    finally:
        guard.evaluation_set = real
