"""vLLM's metric names through Triton's custom-metrics API, so vLLM dashboards work on Triton's /metrics.

Updated from one background thread: request records arrive on a queue and engine gauges are
sampled from the AsyncEngine's stats snapshot, so neither the engine nor the request loop waits
on the metrics IPC.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

REFRESH_S = 0.5
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
TPOT_BUCKETS = [0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]


@dataclass
class RequestRecord:
    prompt_tokens: int
    generation_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float


class VllmMetrics:
    def __init__(self, pb_utils, labels: dict[str, str], stats_fn, info: dict[str, str]):
        Family = pb_utils.MetricFamily
        # Keep every family referenced: a collected family invalidates its metrics.
        self.families = []

        def family(name, description, kind, **metric_args):
            fam = Family(name=name, description=description, kind=kind)
            self.families.append(fam)
            return fam.Metric(labels=labels, **metric_args)

        self.prompt_tokens = family("vllm:prompt_tokens_total", "Number of prefill tokens processed.", Family.COUNTER)
        self.generation_tokens = family(
            "vllm:generation_tokens_total", "Number of generation tokens processed.", Family.COUNTER
        )
        self.ttft = family("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           Family.HISTOGRAM, buckets=LATENCY_BUCKETS)
        self.tpot = family("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                           Family.HISTOGRAM, buckets=TPOT_BUCKETS)
        self.e2e = family("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                          Family.HISTOGRAM, buckets=LATENCY_BUCKETS)
        self.running = family("vllm:num_requests_running", "Number of requests currently running.", Family.GAUGE)
        self.waiting = family("vllm:num_requests_waiting", "Number of requests waiting to be processed.", Family.GAUGE)
        self.kv_usage = family("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", Family.GAUGE)
        self.prefix_hit_rate = family(
            "vllm:prefix_cache_hit_rate", "Prefix-cache hit rate over prompt tokens (0 to 1).", Family.GAUGE
        )
        # What runs behind the endpoint (an info metric: the labels carry it, the value is 1).
        info_family = Family(name="npu_llm:engine_info", description="Engine model and device.", kind=Family.GAUGE)
        self.families.append(info_family)
        info_family.Metric(labels={**labels, **info}).set(1)
        self._stats_fn = stats_fn
        self._records: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="npu-llm-metrics", daemon=True)
        self._thread.start()

    def record(self, record: RequestRecord) -> None:
        self._records.put(record)

    def _run(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self._flush()
        self._flush()

    def _flush(self) -> None:
        while True:
            try:
                r = self._records.get_nowait()
            except queue.Empty:
                break
            self.prompt_tokens.increment(r.prompt_tokens)
            self.generation_tokens.increment(r.generation_tokens)
            self.e2e.observe(r.e2e_s)
            if r.ttft_s is not None:
                self.ttft.observe(r.ttft_s)
            if r.tpot_s is not None:
                self.tpot.observe(r.tpot_s)
        stats = self._stats_fn()
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
