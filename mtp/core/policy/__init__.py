"""Policy and measurement: what is worth running. The cost model t(q), calibration of proposers,
the quality loss of an output against `ntp`, and deploy files (the tuned choice `mtp serve` runs).
Imports runtime and decoding, never the engine (tests/test_layers.py)."""
