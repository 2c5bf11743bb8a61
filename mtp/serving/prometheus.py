"""Prometheus text for `/metrics`: counters and histograms the HTTP side and the engine thread update.

Label values are bounded: strategies are labelled by kind and K (`conf_adapt:0.900001:32` and
`conf_adapt:0.9:32` are one series, `conf_adapt:K=32`), never by the string a client sent.
"""
from __future__ import annotations

import threading

from mtp.core import metrics as M
from mtp.serving.scheduler import Request, Scheduler

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4)


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.n}')
        lab = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{lab} {self.sum:.6f}", f"{name}_count{lab} {self.n}"]


class ServerMetrics:
    """Counters the HTTP side and the engine thread update; rendered as Prometheus text."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.queue_wait = Histogram(LATENCY_BUCKETS)
        self.shadow = {"requests": 0, "exact_match": 0, "answer_compared": 0, "answer_agree": 0}
        self.shadow_ratio = Histogram(RATIO_BUCKETS)

    def count(self, endpoint: str, status: str) -> None:
        with self.lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def finished(self, req: Request) -> None:
        with self.lock:
            self.prompt_tokens += len(req.seq.prompt_ids)
            self.completion_tokens += len(req.seq.output)
            if req.t_finish is not None:
                self.latency.observe(req.t_finish - req.t_arrival)
            if req.t_first is not None:
                self.ttft.observe(req.t_first - req.t_arrival)
            if req.t_admitted is not None:
                self.queue_wait.observe(req.t_admitted - req.t_arrival)

    def shadow_done(self, rec: dict) -> None:
        with self.lock:
            self.shadow["requests"] += 1
            self.shadow["exact_match"] += bool(rec["exact_match"])
            if rec["answer_agree"] is not None:
                self.shadow["answer_compared"] += 1
                self.shadow["answer_agree"] += bool(rec["answer_agree"])
            if rec.get("latency_ratio"):
                self.shadow_ratio.observe(rec["latency_ratio"])

    def render(self, sched: Scheduler) -> str:
        out = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        with self.lock:
            metric("mtp_requests_total", "counter", "HTTP requests by endpoint and outcome",
                   [f'mtp_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())])
            metric("mtp_prompt_tokens_total", "counter", "prompt tokens of finished requests",
                   [f"mtp_prompt_tokens_total {self.prompt_tokens}"])
            metric("mtp_generation_tokens_total", "counter", "tokens generated for finished requests",
                   [f"mtp_generation_tokens_total {self.completion_tokens}"])
            metric("mtp_request_latency_seconds", "histogram", "arrival to last token",
                   self.latency.lines("mtp_request_latency_seconds"))
            metric("mtp_time_to_first_token_seconds", "histogram", "arrival to first token",
                   self.ttft.lines("mtp_time_to_first_token_seconds"))
            metric("mtp_queue_wait_seconds", "histogram", "arrival to admission into the batch",
                   self.queue_wait.lines("mtp_queue_wait_seconds"))
            for k, v in self.shadow.items():
                metric(f"mtp_shadow_{k}_total", "counter", f"shadow comparisons: {k}", [f"mtp_shadow_{k}_total {v}"])
            metric("mtp_shadow_latency_ratio", "histogram", "MTP decode time / ntp shadow decode time",
                   self.shadow_ratio.lines("mtp_shadow_latency_ratio"))
        metric("mtp_queue_length", "gauge", "requests waiting for a batch row", [f"mtp_queue_length {sched.queue_length}"])
        metric("mtp_running_requests", "gauge", "requests in the batch", [f"mtp_running_requests {sched.running}"])
        metric("mtp_forward_passes_total", "counter", "forward passes (prefills included)",
               [f"mtp_forward_passes_total {sched.passes}"])
        metric("mtp_prefill_passes_total", "counter", "prompt prefill passes", [f"mtp_prefill_passes_total {sched.prefill_passes}"])
        metric("mtp_row_passes_total", "counter", "forward passes summed over batch rows",
               [f"mtp_row_passes_total {sched.row_passes}"])
        metric("mtp_capped_passes_total", "counter", "passes where the cost model capped K",
               [f"mtp_capped_passes_total {sched.capped_passes}"])
        metric("mtp_k_cap_passes_total", "counter", "passes by the K cap the adaptive policy chose",
               [f'mtp_k_cap_passes_total{{k="{k}"}} {n}' for k, n in sorted(dict(sched.k_caps).items())])
        tpf, acc = [], []
        for strat, dq in sorted(sched.chunks.items()):
            chunks = list(dq)
            tpf.append(f'mtp_tokens_per_forward{{strategy="{strat}"}} {M.tokens_per_forward(chunks):.4f}')
            for i, a in enumerate(M.acceptance_by_position(chunks)):
                acc.append(f'mtp_acceptance_by_position{{strategy="{strat}",position="{i}"}} {a:.4f}')
        metric("mtp_tokens_per_forward", "gauge", "tokens emitted per row pass, recent passes", tpf)
        metric("mtp_acceptance_by_position", "gauge", "fraction of row passes emitting more than `position` tokens", acc)
        return "\n".join(out) + "\n"
