"""The engine's number format: `--dtype float32 | bfloat16 | auto`.

float32 is the reference: the shipped assets were trained and measured against it, and on a CPU it runs
with oneDNN-packed weights (`mtp.core.model.pack_weights`). bfloat16 halves the weights' memory traffic
and is faster where the CPU has native bf16 arithmetic (AVX512-BF16 or AMX); elsewhere torch emulates it
and it is slower. It also changes the greedy text (another rounding of every activation), so lossless
strategies are lossless relative to `ntp` in the same dtype, not to float32.

`auto` keeps float32 on a CPU without native bf16 (the flags in /proc/cpuinfo); on one with it, it
measures one pass over 1 and over `AUTO_BLOCK` tokens in both formats (the model as the engine runs it)
and keeps the faster for that block; on a GPU it takes bfloat16. `resolve` returns the choice with its
reason (and the timings when it measured), which `mtp bench` records in its environment.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

NAMES = ("float32", "bfloat16", "auto")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
AUTO_BLOCK = 9  # the block of a `tree:8` pass: what auto prices besides a one-token pass
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass
class DtypeChoice:
    name: str  # float32 | bfloat16
    asked: str
    reason: str
    timings_ms: dict = field(default_factory=dict)  # dtype -> {q: ms per pass}, when auto measured

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def to_json(self) -> dict:
        return {"dtype": self.name, "asked": self.asked, "reason": self.reason, "timings_ms": self.timings_ms}


def check(name: str) -> str:
    if name not in NAMES:
        raise ValueError(f"--dtype must be one of {', '.join(NAMES)}, got {name!r}")
    return name


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(flags: set[str] | None = None) -> bool:
    """Whether this CPU computes in bf16 natively (else torch emulates it, slower than float32)."""
    return any(f in (cpu_flags() if flags is None else flags) for f in BF16_FLAGS)


def resolve(asked: str, model_name: str, device: str = "cpu", flags: set[str] | None = None,
            repeats: int = 3) -> DtypeChoice:
    check(asked)
    if asked != "auto":
        return DtypeChoice(asked, asked, "asked for")
    if device != "cpu":
        return DtypeChoice("bfloat16", asked, f"auto on {device}: bfloat16")
    if not native_bf16(flags):
        return DtypeChoice("float32", asked, "auto: this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag)")
    from mtp.core import loading
    from mtp.core.costmodel import measure
    from mtp.core.model import pack_weights

    timings = {}
    for name, dtype in DTYPES.items():
        model = loading.load(model_name, dtype=dtype, device=device).model
        pack_weights(model)  # what the engine does (a no-op outside float32)
        cost = measure(model, (1, AUTO_BLOCK), 128, 1, repeats)
        timings[name] = {q: round(1e3 * cost.pass_time(q), 3) for q in (1, AUTO_BLOCK)}
        del model
    faster = min(timings, key=lambda n: timings[n][1] + timings[n][AUTO_BLOCK])
    return DtypeChoice(faster, asked, f"auto: measured t(1) + t({AUTO_BLOCK}) in both, {faster} is faster here",
                       timings)
