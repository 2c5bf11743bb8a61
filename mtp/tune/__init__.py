"""`mtp tune`: the adoption checklist as one command (`mtp.tune.run`), built on the core and the
benchmarks: offline batched decoding, predictability, calibration, candidates, the report and the toy check."""
