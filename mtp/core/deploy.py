"""The deploy file: what `mtp tune` chose, in the form `mtp serve --deploy` rolls out.

    {"format": "mtp-deploy", "version": 1,
     "tuned":    {"strategy": "conf_adapt:0.95:4", "proposer": "mask"},   # what the tolerance allows
     "fallback": {"strategy": "verify:4", "proposer": "heads"},           # lossless, always safe
     "tolerance": 0.02, "metric": "answer",                              # loss = 1 - agreement with ntp
     "caps": {"max_k": 4, "min_tau": 0.95},                              # safety rails for lossy requests
     "calibration": {"mask": [{"temperature": 1.3, "bias": -0.2}, ...]},  # mtp.core.calibration, per depth
     "hashes": {"model": "...", "adapter": "...", "heads": "...", ...},  # what it was tuned on
     "measured": {...}, "hardware": {...}, "command": "mtp tune ..."}

`read` checks everything a server needs before any model loads (one line per problem: a missing or
truncated file, another format, an unknown strategy, proposer or metric, a tolerance outside
[0, 1], a lossy fallback); `check_engine` refuses a deploy file made for other weights (the base
weights hash, and the content hash of every adapter/heads/drafter/datastore it names) once the
model is loaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mtp.core.artifacts import base_hash, file_digest, write_text_atomic
from mtp.core.calibration import Calibration
from mtp.core.proposers import check_proposer
from mtp.core.strategy import Strategy

FORMAT = "mtp-deploy"
VERSION = 1
METRICS = ("exact", "answer", "rougeL")
ASSET_FILES = {"adapter": "adapter.safetensors", "heads": "heads.safetensors", "eagle3": "model.safetensors",
               "datastore": "datastore.safetensors"}


@dataclass(frozen=True)
class Arm:
    """A strategy with the proposer it drafts from."""
    strategy: Strategy
    proposer: str

    def __str__(self) -> str:
        return str(self.strategy) + ("" if self.strategy.plain else f"@{self.proposer}")

    def to_json(self) -> dict:
        return {"strategy": str(self.strategy), "proposer": self.proposer}

    @classmethod
    def parse(cls, data, what: str) -> "Arm":
        if not isinstance(data, dict) or not isinstance(data.get("strategy"), str):
            raise ValueError(f"deploy file: '{what}' needs a 'strategy' string")
        proposer = data.get("proposer") or "mask"
        if not isinstance(proposer, str):
            raise ValueError(f"deploy file: '{what}.proposer' must be a string")
        check_proposer(proposer)
        return cls(Strategy.parse(data["strategy"]), proposer)


@dataclass
class Deploy:
    tuned: Arm
    fallback: Arm
    tolerance: float
    metric: str
    caps: dict = field(default_factory=dict)
    calibration: dict[str, Calibration] = field(default_factory=dict)
    hashes: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # measured figures, hardware, command: kept, not interpreted

    def __post_init__(self):
        check_tolerance(self.tolerance, "the tolerance")
        check_metric(self.metric)
        if not self.fallback.strategy.lossless:
            raise ValueError(f"deploy file: the fallback {self.fallback} must be lossless (ntp, verify or tree)")

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "tuned": self.tuned.to_json(),
                "fallback": self.fallback.to_json(), "tolerance": self.tolerance, "metric": self.metric,
                "caps": self.caps, "calibration": {k: c.to_json() for k, c in self.calibration.items()},
                "hashes": self.hashes, **self.extra}

    def calibration_json(self) -> dict:
        return {k: c.to_json() for k, c in self.calibration.items()}


def check_tolerance(t, what: str = "--tolerance") -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:
        raise ValueError(f"{what} must be a number in [0, 1], got {t!r}")
    return float(t)


def check_metric(m) -> str:
    if m not in METRICS:
        raise ValueError(f"unknown metric {m!r}; choose from {', '.join(METRICS)}")
    return m


def read(path: str | Path) -> Deploy:
    """A deploy file, checked; every problem is one ValueError line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"deploy file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a complete JSON deploy file (truncated?): {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not an mtp deploy file (no \"format\": \"{FORMAT}\"); write one with mtp tune")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: deploy file version {data.get('version')!r}, this mtp reads version {VERSION}")
    try:
        calib = data.get("calibration") or {}
        if not isinstance(calib, dict):
            raise ValueError("'calibration' must map proposer names to per-depth maps")
        known = ("format", "version", "tuned", "fallback", "tolerance", "metric", "caps", "calibration", "hashes")
        caps = data.get("caps") or {}
        hashes = data.get("hashes") or {}
        if not isinstance(caps, dict) or not isinstance(hashes, dict):
            raise ValueError("'caps' and 'hashes' must be objects")
        return Deploy(tuned=Arm.parse(data.get("tuned"), "tuned"), fallback=Arm.parse(data.get("fallback"), "fallback"),
                      tolerance=data.get("tolerance"), metric=data.get("metric"), caps=caps,
                      calibration={str(k): Calibration.from_json(v) for k, v in calib.items()},
                      hashes=hashes, extra={k: v for k, v in data.items() if k not in known})
    except ValueError as e:
        raise ValueError(f"{path}: {str(e).splitlines()[0]}") from None


def write(deploy: Deploy, path: str | Path) -> None:
    """Write atomically: a killed tune never leaves half a deploy file."""
    write_text_atomic(Path(path), json.dumps(deploy.to_json(), indent=1) + "\n")


def engine_hashes(engine, proposers: list[str] | None = None) -> dict:
    """The base weights hash and the content hash of the assets `proposers` draft from (default:
    every asset the engine loaded); the adapter counts when a mask proposer is among them."""
    out = {"model": base_hash(engine.model)}
    kinds = None
    if proposers is not None:
        kinds, mask = set(), False
        for name in proposers:
            spec = check_proposer(name)
            for part in spec.parts or (name,):
                p = check_proposer(part)
                mask = mask or p.needs_mask_token
                if p.asset is not None:
                    kinds.add(p.asset)
        if mask:
            kinds.add("adapter")
    if engine.adapter_dir is not None and (kinds is None or "adapter" in kinds):
        out["adapter"] = asset_hash(engine.adapter_dir, "adapter")
    for kind, path in sorted(engine.asset_dirs.items()):
        if kinds is None or kind in kinds:
            out[kind] = asset_hash(path, kind)
    return out


def asset_hash(path: str | Path, kind: str) -> str:
    f = Path(path) / ASSET_FILES.get(kind, "")
    return file_digest(f) if f.is_file() else "missing"


def check_engine(deploy: Deploy, engine) -> None:
    """Refuse a deploy file tuned on other weights or assets than the engine has loaded."""
    have = engine_hashes(engine)
    for kind, want in deploy.hashes.items():
        if kind not in have:
            raise ValueError(f"the deploy file was tuned with a {kind} ({want}) that was not loaded here; "
                             f"pass --{kind} DIR")
        if have[kind] != want:
            raise ValueError(f"the deploy file was tuned on another {kind} (hash {want}, loaded {have[kind]}); "
                             f"rerun mtp tune for this one")
