"""t(q) of SmolLM2-135M in float32 (oneDNN-packed, the engine's format) and in bfloat16, one process,
rounds interleaved (3 rounds x median of 3), cache of 128 positions: `python tq.py THREADS`.
Run from a checkout of ba9818c (the reverted `--dtype` commit; see README.md here)."""
import sys

import torch

from mtp.core import loading
from mtp.core.costmodel import measure
from mtp.core.model import pack_weights

torch.set_num_threads(int(sys.argv[1]))
qs = (1, 4, 8, 16, 32)
models = {}
for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    m = loading.load(loading.DEFAULT_MODEL, dtype=dt).model
    pack_weights(m)  # a no-op outside float32
    models[name] = m
res = {n: [] for n in models}
for rnd in range(3):
    for n, m in models.items():
        c = measure(m, qs, 128, 1, 3)
        res[n].append([1e3 * c.pass_time(q) for q in qs])
for n, v in res.items():
    med = [sorted(x[i] for x in v)[1] for i in range(len(qs))]
    print(n, " ".join(f"t({q})={t:.1f}ms" for q, t in zip(qs, med)))
