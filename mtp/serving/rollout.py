"""Gradual rollout of a tuned configuration with automatic fallback (`mtp serve --deploy`).

A request that names no strategy of its own is assigned once, at admission, by a hash of its id:
the tuned configuration when the hash falls below the current fraction, the lossless fallback
otherwise. Shadow mode re-decodes the tuned requests with `ntp` (at `--shadow-rate`) and reports
each comparison here as a loss per metric (`mtp.core.policy.quality`: exact, answer, rougeL).

A sliding window holds the last `window` losses of each metric; the deploy file's metric decides:
- fallback: as soon as the window's summed loss exceeds tolerance x window (its mean is then above
  the tolerance whatever the rest of the window brings), every later request gets the fallback,
  for good (a log line, `mtp_rollout_fallbacks_total`, `mtp_rollout_state`, `/health`);
- ramp: after each `window` comparisons within the tolerance, the fraction grows by `step` (up to
  1; state `full` there).
A switch only changes how later requests are assigned: a request in flight keeps the configuration
it was admitted with, so nothing is dropped or answered twice.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading

from mtp.core.policy.deploy import METRICS, Arm, Deploy

log = logging.getLogger("mtp.serve")
TUNED, FALLBACK = "tuned", "fallback"


def check_fraction(value: float, flag: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{flag} must be in [0, 1], got {value!r}")
    return float(value)


def bucket(key: str, seed: int = 0) -> float:
    """A stable number in [0, 1) for a request id."""
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


class Rollout:
    def __init__(self, deploy: Deploy, fraction: float = 1.0, step: float = 0.0, window: int = 20, seed: int = 0):
        self.deploy = deploy
        self.fraction = check_fraction(fraction, "--rollout")
        self.step = check_fraction(step, "--rollout-step")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"--rollout-window must be an integer >= 1, got {window!r}")
        self.window, self.seed = window, seed
        self.losses = {m: collections.deque(maxlen=window) for m in METRICS}
        self.since_change = 0  # comparisons since the last ramp (a ramp needs a whole clean window)
        self.fell_back = False
        self.fallbacks = self.ramps = self.compared = 0
        self.assigned: collections.Counter = collections.Counter()
        self.lock = threading.Lock()

    @property
    def state(self) -> str:
        return "fallback" if self.fell_back else "full" if self.fraction >= 1 else "rolling"

    def assign(self, request_id) -> tuple[str, Arm]:
        """(TUNED or FALLBACK, its configuration) for a new request."""
        with self.lock:
            arm = FALLBACK if self.fell_back or bucket(str(request_id), self.seed) >= self.fraction else TUNED
            self.assigned[arm] += 1
        return arm, self.deploy.tuned if arm == TUNED else self.deploy.fallback

    def window_loss(self, metric: str | None = None) -> float | None:
        d = self.losses[metric or self.deploy.metric]
        return sum(d) / len(d) if d else None

    def observe(self, losses: dict[str, float]) -> str | None:
        """One shadow comparison of a tuned request (loss per metric): 'fallback', 'ramp' or None."""
        with self.lock:
            self.compared += 1
            for m, v in losses.items():
                if m in self.losses and v is not None:
                    self.losses[m].append(float(v))
            if self.fell_back:
                return None
            self.since_change += 1
            window = self.losses[self.deploy.metric]
            if sum(window) > self.deploy.tolerance * self.window + 1e-12:
                self.fell_back = True
                self.fallbacks += 1
                event = "fallback"
            elif self.since_change >= self.window and self.step > 0 and self.fraction < 1:
                self.fraction = min(1.0, self.fraction + self.step)
                self.ramps += 1
                self.since_change = 0
                event = "ramp"
            else:
                return None
            fraction, loss = self.fraction, self.window_loss()
        if event == "fallback":
            log.warning(
                "mtp serve: rollout of %s FELL BACK to %s: %s loss %.3f over the last %d comparisons "
                "exceeds the tolerance %g",
                self.deploy.tuned,
                self.deploy.fallback,
                self.deploy.metric,
                loss,
                len(window),
                self.deploy.tolerance,
            )
        else:
            log.info(
                "mtp serve: rollout of %s ramped to %.0f%% of requests (%s loss %.3f within %g)",
                self.deploy.tuned,
                100 * fraction,
                self.deploy.metric,
                loss,
                self.deploy.tolerance,
            )
        return event

    def health(self) -> dict:
        with self.lock:
            return {
                "state": self.state,
                "fraction": 0.0 if self.fell_back else self.fraction,
                "tuned": str(self.deploy.tuned),
                "fallback": str(self.deploy.fallback),
                "metric": self.deploy.metric,
                "tolerance": self.deploy.tolerance,
                "window": self.window,
                "compared": self.compared,
                "window_loss": {m: (sum(d) / len(d) if d else None) for m, d in self.losses.items()},
                "fallbacks": self.fallbacks,
                "ramps": self.ramps,
                "assigned": dict(self.assigned),
            }
