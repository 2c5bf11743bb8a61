"""Where a bench (or tune) run happened, as results record it: the machine (CPU, threads, library
versions, the llama.cpp build) and, given an engine, what it ran (model, adapter and heads by a
machine-independent name, proposer, weights, device, packing)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from mtp.core.runtime.artifacts import ASSETS
from mtp.core.runtime.machine import cpu_info
from mtp.core.runtime.model import Linear
from mtp.interop import llamacpp_env


def environment(engine=None) -> dict:
    env = {
        "cpu": cpu_info()["name"],
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        env["transformers"] = __import__("transformers").__version__
    except Exception:
        pass
    # the `make llamacpp` build (version or None) and whether AMX is usable here (the kernel's grant, not
    # just the CPU flag), with the flags llama-server runs need because of it (`--no-repack`)
    env["llamacpp"] = llamacpp_env.environment()
    if engine is not None:
        env.update(
            model=engine.loaded.name,
            adapter=asset_name(engine.adapter_dir),
            heads=asset_name(engine.asset_dirs.get("heads")),
            proposer=engine.config.proposer,
            weights=getattr(engine, "weights_line", ""),  # what ran the model (mtp.core.runtime.weights.attach)
            device=str(engine.model.device),
            packed=_packed(engine.model),
        )
    return env


def asset_name(path) -> str | None:
    """How results name an adapter or heads directory: `shipped:<model>/<kind>` for the packaged ones,
    else the path as given (results get shared: no machine-specific prefix for shipped assets)."""
    if path is None:
        return None
    try:
        return "shipped:" + Path(path).resolve().relative_to(ASSETS.resolve()).as_posix()
    except ValueError:
        return str(path)


def _packed(model) -> bool:
    return any(isinstance(m, Linear) and m.packed is not None for m in model.modules())
