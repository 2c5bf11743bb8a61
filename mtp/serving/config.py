"""What `mtp serve` is configured with, checked when built (before any model loads): the request
defaults, authentication, shadow mode and the limits on what one request may carry (body, prompt,
messages, `n`, `top_logprobs`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.policy.deploy import Deploy
from mtp.serving.rollout import check_fraction
from mtp.serving.scheduler import SchedulerConfig
from mtp.serving.shadow import check_log_path

MAX_BODY_BYTES = 4 << 20  # default request body limit (HTTP 413 above it)
PROMPT_CHARS_PER_TOKEN = 32  # default prompt character limit = this x max_model_len (checked before tokenising)
MAX_MESSAGES = 256  # default limit on a chat request's messages (checked before validating them)
SHUTDOWN_GRACE_S = 5.0  # after --shutdown-timeout: how long uvicorn waits for the 503s / error events to go out
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there
MAX_TOP_LOGPROBS = 20  # `logprobs` (completions) / `top_logprobs` (chat): alternatives per token, at most
MAX_N = 8  # default limit on a request's `n` (choices; each sampled one is a row of the batch)


def check_shutdown_timeout(seconds) -> float:
    """--shutdown-timeout: a finite number of seconds >= 0. Below 0 uvicorn would get less than
    SHUTDOWN_GRACE_S to send the 503s / error events of the requests the scheduler cancels (and
    cancel them unanswered); nan would never cancel them, inf never end the wait."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {seconds!r}")
    return float(seconds)


@dataclass
class ServeConfig:
    model_name: str = "smollm2-135m"  # the id clients pass as `model`
    strategy: str = "ntp"  # default when a request has no `mtp.strategy`
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128  # default when a request has no `max_tokens`
    stop: list[str] = field(default_factory=list)  # default when a request has no `stop`
    seed: int | None = None  # default when a request has no `seed`
    api_key: str | None = None
    shadow_rate: float = 0.0
    shadow_log: str = "mtp-shadow.jsonl"
    shadow_seed: int = 0
    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_chars: int = 0  # 0 = PROMPT_CHARS_PER_TOKEN x scheduler.max_model_len
    max_messages: int = MAX_MESSAGES
    max_n: int = MAX_N  # a request's `n` at most
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    deploy: Deploy | None = None  # `mtp tune`'s choice, rolled out (mtp.serving.rollout)
    rollout: float = 1.0  # fraction of requests given the tuned configuration at start
    rollout_step: float = 0.0  # added to the fraction after each clean window
    rollout_window: int = 20  # shadow comparisons per window

    def __post_init__(self):
        Strategy.parse(self.strategy)
        SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_new_tokens=max(1, self.max_tokens),
        )
        if not 0 <= self.shadow_rate <= 1:
            raise ValueError(f"--shadow-rate must be in [0, 1], got {self.shadow_rate}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_tokens}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError(
                "--api-key is empty (an unset variable?); give a key, or leave the flag out for no authentication"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_prompt_chars < 0:
            raise ValueError(f"--max-prompt-chars must be >= 0, got {self.max_prompt_chars}")
        if self.max_messages < 1:
            raise ValueError(f"--max-messages must be >= 1, got {self.max_messages}")
        if isinstance(self.max_n, bool) or not isinstance(self.max_n, int) or self.max_n < 1:
            raise ValueError(f"max_n must be an integer >= 1, got {self.max_n!r}")
        if not self.max_prompt_chars:
            self.max_prompt_chars = PROMPT_CHARS_PER_TOKEN * self.scheduler.max_model_len
        check_fraction(self.rollout, "--rollout")
        check_fraction(self.rollout_step, "--rollout-step")
        if isinstance(self.rollout_window, bool) or not isinstance(self.rollout_window, int) or self.rollout_window < 1:
            raise ValueError(f"--rollout-window must be an integer >= 1, got {self.rollout_window!r}")
        if self.deploy is not None and self.rollout < 1 and self.shadow_rate == 0:
            raise ValueError(
                "--rollout below 1 needs --shadow-rate > 0: without shadow comparisons the rollout "
                "can neither ramp up nor fall back"
            )
        if self.shadow_rate > 0:
            check_log_path(self.shadow_log)
