"""`/metrics` through `prometheus_client`, on a registry of each app's own (never the process-global
one, so several apps in one process keep apart). The HTTP side and the engine thread update counters
and histograms as requests finish; the scheduler's own counters and gauges are read at scrape time
(`SchedulerCollector`).

Label values are bounded: strategies are labelled by kind and K (`conf_adapt:0.900001:32` and
`conf_adapt:0.9:32` are one series, `conf_adapt:K=32`), never by the string a client sent.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mtp.core.decoding import metrics as M
from mtp.serving.scheduler import Request, Scheduler

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4)
SHADOW_COUNTS = ("requests", "exact_match", "answer_compared", "answer_agree")


class ServerMetrics:
    """The server's metrics on `self.registry`; `render()` is the /metrics body."""

    def __init__(self, sched: Scheduler, rollout=None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "mtp_requests_total", "HTTP requests by endpoint and outcome", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("mtp_prompt_tokens_total", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(
            "mtp_generation_tokens_total", "tokens generated for finished requests", registry=r
        )
        self.latency = Histogram(
            "mtp_request_latency_seconds", "arrival to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "mtp_time_to_first_token_seconds", "arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "mtp_queue_wait_seconds", "arrival to admission into the batch", buckets=LATENCY_BUCKETS, registry=r
        )
        self.shadow = {
            k: Counter(f"mtp_shadow_{k}_total", f"shadow comparisons: {k}", registry=r) for k in SHADOW_COUNTS
        }
        self.shadow_ratio = Histogram(
            "mtp_shadow_latency_ratio", "MTP decode time / ntp shadow decode time", buckets=RATIO_BUCKETS, registry=r
        )
        r.register(SchedulerCollector(sched))
        if rollout is not None:
            r.register(RolloutCollector(rollout))

    def count(self, endpoint: str, status: str) -> None:
        self.requests.labels(endpoint, status).inc()

    def finished(self, req: Request) -> None:
        self.prompt_tokens.inc(len(req.seq.prompt_ids))
        self.generation_tokens.inc(len(req.seq.output))
        if req.t_finish is not None:
            self.latency.observe(req.t_finish - req.t_arrival)
        if req.t_first is not None:
            self.ttft.observe(req.t_first - req.t_arrival)
        if req.t_admitted is not None:
            self.queue_wait.observe(req.t_admitted - req.t_arrival)

    def shadow_done(self, rec: dict) -> None:
        self.shadow["requests"].inc()
        self.shadow["exact_match"].inc(bool(rec["exact_match"]))
        if rec["answer_agree"] is not None:
            self.shadow["answer_compared"].inc()
            self.shadow["answer_agree"].inc(bool(rec["answer_agree"]))
        if rec.get("latency_ratio"):
            self.shadow_ratio.observe(rec["latency_ratio"])

    def value(self, name: str, **labels) -> float:
        """One sample's current value (0 if it has none yet), e.g. `value("mtp_requests_total",
        endpoint="chat", status="ok")`."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SchedulerCollector:
    """The scheduler's counters and gauges, read when scraped (the engine thread owns them)."""

    def __init__(self, sched: Scheduler):
        self.sched = sched

    def describe(self):
        return []  # nothing to check for name clashes up front: the names are fixed below

    def collect(self):
        s = self.sched
        yield GaugeMetricFamily("mtp_queue_length", "requests waiting for a batch row", s.queue_length)
        yield GaugeMetricFamily("mtp_running_requests", "requests in the batch", s.running)
        yield CounterMetricFamily("mtp_forward_passes", "forward passes (prefills included)", s.passes)
        yield CounterMetricFamily("mtp_prefill_passes", "prompt prefill passes", s.prefill_passes)
        yield CounterMetricFamily("mtp_row_passes", "forward passes summed over batch rows", s.row_passes)
        yield CounterMetricFamily("mtp_capped_passes", "passes where the cost model capped K", s.capped_passes)
        caps = CounterMetricFamily("mtp_k_cap_passes", "passes by the K cap the adaptive policy chose", labels=["k"])
        for k, n in sorted(dict(s.k_caps).items()):  # dict(): a copy, taken at once (the engine thread writes)
            caps.add_metric([str(k)], n)
        yield caps
        tpf = GaugeMetricFamily(
            "mtp_tokens_per_forward", "tokens emitted per row pass, recent passes", labels=["strategy"]
        )
        acc = GaugeMetricFamily(
            "mtp_acceptance_by_position",
            "fraction of row passes emitting more than `position` tokens",
            labels=["strategy", "position"],
        )
        for strat, dq in sorted(dict(s.chunks).items()):
            chunks = list(dq)
            tpf.add_metric([strat], M.tokens_per_forward(chunks))
            for i, a in enumerate(M.acceptance_by_position(chunks)):
                acc.add_metric([strat, str(i)], a)
        yield tpf
        yield acc


class RolloutCollector:
    """A rollout's state (`mtp.serving.rollout`), read when scraped."""

    STATES = ("rolling", "full", "fallback")

    def __init__(self, rollout):
        self.rollout = rollout

    def describe(self):
        return []

    def collect(self):
        h = self.rollout.health()
        yield GaugeMetricFamily(
            "mtp_rollout_fraction", "fraction of requests given the tuned configuration", h["fraction"]
        )
        state = GaugeMetricFamily("mtp_rollout_state", "1 for the rollout's current state", labels=["state"])
        for name in self.STATES:
            state.add_metric([name], 1.0 if h["state"] == name else 0.0)
        yield state
        loss = GaugeMetricFamily(
            "mtp_rollout_window_loss", "mean loss over the sliding window of shadow comparisons", labels=["metric"]
        )
        for m, v in h["window_loss"].items():
            if v is not None:
                loss.add_metric([m], v)
        yield loss
        yield CounterMetricFamily(
            "mtp_rollout_fallbacks", "automatic fallbacks to the lossless configuration", h["fallbacks"]
        )
        yield CounterMetricFamily("mtp_rollout_ramps", "steps up of the rollout fraction", h["ramps"])
        yield CounterMetricFamily("mtp_rollout_compared", "shadow comparisons of tuned requests", h["compared"])
        arms = CounterMetricFamily("mtp_rollout_requests", "requests by the configuration assigned", labels=["arm"])
        for arm in ("tuned", "fallback"):
            arms.add_metric([arm], h["assigned"].get(arm, 0))
        yield arms
