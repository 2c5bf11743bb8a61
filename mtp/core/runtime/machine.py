"""The CPU this process runs on, as results and cached measurements name it: `/proc/cpuinfo`'s model
name, family and model (cloud CPUs often share a name, "AMD EPYC", across generations: family and
model tell Zen 3 from Zen 4), falling back to `platform.processor()` where there is no cpuinfo."""

from __future__ import annotations

import platform

FIELDS = {"model name": "name", "cpu family": "family", "model": "model"}


def cpu_info() -> dict:
    """{"name": ..., "family": ..., "model": ...} of the first CPU (missing fields are "")."""
    out = {"name": platform.processor() or "", "family": "", "model": ""}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                field = FIELDS.get(key.strip())
                if field is not None and (field != "name" or value.strip()):
                    out[field] = value.strip()
                if not line.strip() and out["family"]:
                    break  # the first CPU's block is done
    except OSError:
        pass
    return out
