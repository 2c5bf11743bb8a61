import time, torch
from mtp.core.engine import Engine, EngineConfig
from mtp.core.proposers import TimedProposer
from mtp.core.sampling import SamplingParams
from mtp.eval.bench import load_data
import os
_, items = load_data("gsm8k:" + os.environ["MTP_DATA_DIR"] + "/gsm8k/test.jsonl", 3)
for prop in ("heads", "suffix", "lookup", "heads+suffix+lookup"):
    e = Engine.load(EngineConfig(adapter="none", proposer=prop, threads=1))
    for strat in ("verify:4", "tree:8"):
        clock, counts, passes, t0 = {}, {}, 0, time.perf_counter()
        for it in items:
            seq = e.new_sequence(e.encode(it["prompt"], chat=True), strat, SamplingParams(max_new_tokens=64))
            seq.proposer = TimedProposer(seq.proposer, clock, counts)
            for _ in e.stream(seq):
                pass
            passes += seq.stats.forward_passes
        wall = time.perf_counter() - t0
        print(f"{prop:22s} {strat:9s} proposing {1e3*sum(clock.values())/passes:.2f} ms/pass, pass+all {1e3*wall/passes:.1f} ms/pass, {sum(counts.values())/passes:.1f} guesses/pass")
