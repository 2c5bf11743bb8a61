"""Decoding: turning passes into tokens. Sampling, the strategies (`ntp`, `verify`, `tree`,
`conf_adapt`), token trees, the proposers (one registry), the decoding loop (`decode`), continuous
batching, and the decoding metrics, defined once. Imports only the runtime below it
(tests/test_layers.py)."""
