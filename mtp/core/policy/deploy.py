"""The deploy file: what `mtp tune` chose, in the form `mtp serve --deploy` rolls out.

    {"format": "mtp-deploy", "version": 1,
     "tuned":    {"strategy": "conf_adapt:0.95:4", "proposer": "mask"},   # what the tolerance allows
     "fallback": {"strategy": "verify:4", "proposer": "heads"},           # lossless, always safe
     "tolerance": 0.02, "metric": "answer",                              # loss = 1 - agreement with ntp
     "caps": {"max_k": 4, "min_tau": 0.95},                              # safety rails for lossy requests
     "calibration": {"mask": [{"temperature": 1.3, "bias": -0.2}, ...]},  # mtp.core.policy.calibration, per depth
     "hashes": {"model": "...", "adapter": "...", "heads": "...", ...},  # what it was tuned on
     "measured": {...}, "hardware": {...}, "command": "mtp tune ..."}

`read` checks everything a server needs before any model loads (one line per problem: a missing or
truncated file, another format, an unknown strategy, proposer or metric, a tolerance outside
[0, 1], a lossy fallback, caps of the wrong type or unknown, a tuned arm outside its own caps or
unlike the measurements it carries, no hashes tying it to weights and to every asset its arms draft
from); `check_engine` refuses a deploy file made for other weights (the base weights hash, and the
content hash of every adapter/heads/drafter/datastore it names) once the model is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mtp.core.decoding.proposers import check_proposer
from mtp.core.decoding.strategy import Strategy
from mtp.core.policy.calibration import Calibration
from mtp.core.runtime.artifacts import base_hash, file_digest, write_text_atomic
from mtp.core.runtime.weights import CHOICES as WEIGHTS

FORMAT = "mtp-deploy"
VERSION = 1
METRICS = ("exact", "answer", "rougeL")
CAPS = ("max_k", "min_tau")  # K <= max_k, conf_adapt's tau >= min_tau (for lossy strategies only)
MEASURE_SLACK = 1e-9  # float rounding allowed when the measured figures are compared with the arm


@dataclass(frozen=True)
class Asset:
    """An asset kind a deploy file hashes: the file hashed in its directory, what users call it and the
    flag of `mtp serve` (mtp.cli.options.add_model_args) that loads it."""

    file: str
    noun: str
    flag: str


ASSETS = {
    "adapter": Asset("adapter.safetensors", "mask adapter", "--adapter"),
    "heads": Asset("heads.safetensors", "MTP heads checkpoint", "--heads"),
    "eagle3": Asset("model.safetensors", "EAGLE-3 drafter", "--eagle3"),
    "datastore": Asset("datastore.safetensors", "suffix datastore", "--datastore"),
}


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
        self.caps = default_caps(check_caps(self.caps), self.tuned.strategy)
        check_within_caps(self.tuned.strategy, self.caps, "its own")

    @property
    def drafting(self) -> list[str]:
        """The proposers the arms draft from (a plain `ntp` arm drafts from none)."""
        return [a.proposer for a in (self.tuned, self.fallback) if not a.strategy.plain]

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "tuned": self.tuned.to_json(),
            "fallback": self.fallback.to_json(),
            "tolerance": self.tolerance,
            "metric": self.metric,
            "caps": self.caps,
            "calibration": {k: c.to_json() for k, c in self.calibration.items()},
            "hashes": self.hashes,
            **self.extra,
        }

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


def check_caps(caps) -> dict:
    """The safety caps, checked: an object with only CAPS' keys, `max_k` an integer >= 1 and `min_tau` a
    number in [0, 1] (the caps of a file as `mtp tune` writes it); a ValueError line otherwise."""
    if not isinstance(caps, dict):
        raise ValueError('\'caps\' must be an object, e.g. {"max_k": 4, "min_tau": 0.9}')
    for key in caps:
        if key not in CAPS:
            raise ValueError(f"unknown cap {key!r}; the caps are {', '.join(CAPS)}")
    k = caps.get("max_k")
    if "max_k" in caps and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"caps.max_k must be an integer >= 1, got {k!r}")
    if "min_tau" in caps:
        check_tolerance(caps["min_tau"], "caps.min_tau")
    return caps


def default_caps(caps: dict, tuned: Strategy) -> dict:
    """Caps a deploy file leaves out are the tuned arm's own (as `mtp tune` writes them): K <= its K, and
    for conf_adapt tau >= its tau. A file without caps never leaves lossy requests unlimited."""
    out = {"max_k": tuned.k, **caps}
    if tuned.thresholded and "min_tau" not in out:
        out["min_tau"] = tuned.tau
    return out


def check_within_caps(strategy: Strategy, caps: dict, whose: str = "the") -> None:
    """A lossy `strategy` within checked `caps` (K at most `max_k`, conf_adapt's tau at least
    `min_tau`), else a ValueError naming the cap it breaks as `whose` safety cap; a lossless one always
    is. The server holds a request's own strategy to the deploy file's caps with this check, and
    `Deploy` its tuned arm."""
    if strategy.lossless:
        return
    if "max_k" in caps and strategy.k > caps["max_k"]:
        raise ValueError(f"strategy {strategy} exceeds {whose} safety cap K <= {caps['max_k']}")
    if "min_tau" in caps and strategy.thresholded and strategy.tau < caps["min_tau"]:
        raise ValueError(f"strategy {strategy} is below {whose} safety cap tau >= {caps['min_tau']:g}")


def check_measured(deploy: Deploy) -> None:
    """The tuned arm is one the deploy file's "measured" block (what `mtp tune` measured of the arm it
    chose) can describe: the arm it names ("arm", written by `mtp tune`), and what an arm bounds: its
    tokens per forward pass (at most K), and its loss (none for a lossless arm, within the tolerance
    for a lossy one: tune chooses nothing else). A file without the block has nothing to check."""
    measured = deploy.extra.get("measured")
    if measured is None:
        return
    if not isinstance(measured, dict):
        raise ValueError("'measured' must be an object (what mtp tune measured of the tuned arm)")
    for key in ("tokens_per_forward", "loss"):
        v = measured.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"measured.{key} must be a number, got {v!r}")
    tuned, tpf, loss = deploy.tuned, measured.get("tokens_per_forward"), measured.get("loss")
    if "arm" in measured and measured["arm"] != str(tuned):
        raise ValueError(
            f"the tuned arm is {tuned} but the measurements are of {measured['arm']!r}: "
            "rerun mtp tune rather than editing its choice"
        )
    if tpf is not None and tpf > tuned.strategy.k + MEASURE_SLACK:
        raise ValueError(
            f"measured tokens_per_forward {tpf:g} is more than the tuned arm {tuned} emits per pass "
            f"(K = {tuned.strategy.k}): the measurements are of another arm"
        )
    if loss is not None and tuned.strategy.lossless and loss > MEASURE_SLACK:
        raise ValueError(
            f"the tuned arm {tuned} is lossless but its measured loss is {loss:g}: the measurements are of another arm"
        )
    if loss is not None and loss > deploy.tolerance + MEASURE_SLACK:
        raise ValueError(
            f"the tuned arm {tuned}'s measured loss {loss:g} exceeds the tolerance {deploy.tolerance:g}: "
            "mtp tune would not have chosen it"
        )


def check_hashes(hashes, proposers: list[str]) -> dict:
    """The "hashes" block: the base weights' hash ("model") and one for every asset `proposers` draft
    from (the adapter only when there: a mask proposer may run without one), each a non-empty string,
    and none for an asset they do not draft from. Without them `check_engine` could not tell the
    weights it was tuned on from others."""
    if not isinstance(hashes, dict) or not hashes:
        raise ValueError("'hashes' must hold what it was tuned on ({\"model\": ...}); write it with mtp tune")
    for kind, value in hashes.items():
        if kind != "model" and kind not in ASSETS:
            raise ValueError(f"'hashes' names an unknown asset {kind!r}; known: model, {', '.join(ASSETS)}")
        if not isinstance(value, str) or not value:
            raise ValueError(f"'hashes' must give \"{kind}\" as a non-empty string, got {value!r}")
    if "model" not in hashes:
        raise ValueError("'hashes' has no \"model\" hash: nothing ties it to the weights it was tuned on")
    used = asset_kinds(proposers)
    for kind in hashes:
        if kind != "model" and kind not in used:
            raise ValueError(f"'hashes' names the {ASSETS[kind].noun} (\"{kind}\"), which neither arm drafts from")
    missing = sorted(used - set(hashes) - {"adapter"})
    if missing:
        raise ValueError(f"the arms draft from the {ASSETS[missing[0]].noun}, but 'hashes' has no \"{missing[0]}\"")
    return hashes


def read(path: str | Path) -> Deploy:
    """A deploy file, checked; every problem is one ValueError line naming the file. A UTF-8 byte-order
    mark (some editors write one) is read past."""
    path = Path(path)
    if path.is_dir():
        inside = path / "deploy.json"
        hint = f"; did you mean {inside}?" if inside.is_file() else " (mtp tune writes OUT/deploy.json)"
        raise ValueError(f"{path} is a directory, not a deploy file{hint}")
    if not path.is_file():
        raise ValueError(f"deploy file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a complete JSON deploy file (truncated?): {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f'{path}: not an mtp deploy file (no "format": "{FORMAT}"); write one with mtp tune')
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: deploy file version {data.get('version')!r}, this mtp reads version {VERSION}")
    try:
        calib = data.get("calibration") or {}
        if not isinstance(calib, dict):
            raise ValueError("'calibration' must map proposer names to per-depth maps")
        known = ("format", "version", "tuned", "fallback", "tolerance", "metric", "caps", "calibration", "hashes")
        deploy = Deploy(
            tuned=Arm.parse(data.get("tuned"), "tuned"),
            fallback=Arm.parse(data.get("fallback"), "fallback"),
            tolerance=data.get("tolerance"),
            metric=data.get("metric"),
            caps=data.get("caps", {}),
            calibration={str(k): Calibration.from_json(v) for k, v in calib.items()},
            hashes=data.get("hashes"),
            extra={k: v for k, v in data.items() if k not in known},
        )
        check_hashes(deploy.hashes, deploy.drafting)
        check_measured(deploy)
        return deploy
    except ValueError as e:
        raise ValueError(f"{path}: {str(e).splitlines()[0]}") from None


def tuned_weights(deploy: Deploy) -> str | None:
    """The --weights the deploy file was tuned with: the first word of its `hardware.weights` (the line
    `mtp.core.runtime.weights.attach` printed for the engine `mtp tune` measured, e.g. 'native (kernels, avx2):
    ...', or 'torch (...)' when torch ran the model). None when the file records no such line (files
    written before mtp recorded it): then nothing can be checked."""
    hardware = deploy.extra.get("hardware")
    line = hardware.get("weights") if isinstance(hardware, dict) else None
    if not isinstance(line, str) or not line.strip():
        return None
    return line.split()[0]


def check_weights(deploy: Deploy, weights: str, path: str | Path = "the deploy file") -> None:
    """Refuse (one ValueError line, before any model loads) a deploy file tuned with other --weights
    than `weights`, the server's: other arithmetic gives other text, so neither the measured speed nor
    the loss within the tolerance would hold."""
    tuned = tuned_weights(deploy)
    if tuned is None or tuned == weights:
        return
    if tuned not in WEIGHTS:
        raise ValueError(
            f"{path}: its hardware.weights names weights {tuned!r} this mtp does not know ({', '.join(WEIGHTS)})"
        )
    raise ValueError(
        f"{path} was tuned with --weights {tuned}, but this server runs --weights {weights} (other arithmetic, "
        f"other text): serve with --weights {tuned}, or rerun mtp tune with --weights {weights}"
    )


def write(deploy: Deploy, path: str | Path) -> None:
    """Write atomically: a killed tune never leaves half a deploy file."""
    write_text_atomic(Path(path), json.dumps(deploy.to_json(), indent=1) + "\n")


def engine_hashes(engine, proposers: list[str] | None = None) -> dict:
    """The base weights hash and the content hash of the assets `proposers` draft from (default:
    every asset the engine loaded); the adapter counts when a mask proposer is among them."""
    out = {"model": base_hash(engine.model)}
    kinds = None if proposers is None else asset_kinds(proposers)
    if engine.adapter_dir is not None and (kinds is None or "adapter" in kinds):
        out["adapter"] = asset_hash(engine.adapter_dir, "adapter")
    for kind, path in sorted(engine.asset_dirs.items()):
        if kinds is None or kind in kinds:
            out[kind] = asset_hash(path, kind)
    return out


def asset_kinds(proposers: list[str]) -> set[str]:
    """The asset kinds (ASSETS' keys) `proposers` draft from, merges by their parts; the adapter when
    a mask proposer is among them."""
    kinds = set()
    for name in proposers:
        for part in check_proposer(name).parts or (name,):
            p = check_proposer(part)
            if p.needs_mask_token:
                kinds.add("adapter")
            if p.asset is not None:
                kinds.add(p.asset)
    return kinds


def asset_hash(path: str | Path, kind: str) -> str:
    f = Path(path) / (ASSETS[kind].file if kind in ASSETS else "")
    return file_digest(f) if f.is_file() else "missing"


def check_engine(deploy: Deploy, engine) -> None:
    """Refuse a deploy file tuned on other weights or assets than the engine has loaded; an asset it
    names that is not loaded is named with the flag that loads it (ASSETS)."""
    have = engine_hashes(engine)
    for kind, want in deploy.hashes.items():
        asset = ASSETS.get(kind)
        if kind not in have:
            raise ValueError(
                f"the deploy file was tuned with the {asset.noun if asset else kind} hashed {want}, "
                f"which was not loaded here; pass {asset.flag if asset else '--' + kind} DIR"
            )
        if have[kind] != want:
            raise ValueError(
                f"the deploy file was tuned on another {asset.noun if asset else kind} (hash {want}, "
                f"loaded {have[kind]}); rerun mtp tune for this one"
            )
