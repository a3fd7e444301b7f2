"""vLLM's metric names through Triton's custom-metrics API, so vLLM dashboards work on Triton's /metrics.

Updated from one background thread: request records arrive on a queue and engine gauges are
sampled from the AsyncEngine's stats snapshot, so neither the engine nor the request loop waits
on the metrics IPC.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

REFRESH_S = 0.5
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
TPOT_BUCKETS = [0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]


@dataclass
class RequestRecord:
    prompt_tokens: int
    generation_tokens: int
    ttft_s: float | None
    e2e_s: float
    n: int = 1
    max_tokens: int = 0
    finish_reasons: tuple[str, ...] = ()  # one per sequence
    queue_s: float | None = None  # arrival -> first scheduled
    prefill_s: float | None = None  # first scheduled -> first token
    decode_s: float | None = None  # first token -> finished
    inference_s: float | None = None  # first scheduled -> finished
    inter_token_s: list[float] = field(default_factory=list)  # every gap between two tokens of one sequence


class InterTokenTimes:
    """The gaps between consecutive tokens of each sequence of a request, timed when the engine produced them:
    what vLLM's vllm:time_per_output_token_seconds observes (one observation per token after a sequence's
    first). The engine emits every step's output, so each output brings at most one new token per sequence."""

    def __init__(self):
        self.intervals: list[float] = []
        self._last: dict[int, tuple[float, int]] = {}  # sequence index -> (time of its last token, tokens so far)

    def update(self, output) -> None:
        for completion in output.outputs:
            last_time, seen = self._last.get(completion.index, (None, 0))
            if len(completion.token_ids) <= seen or completion.last_token_time is None:
                continue
            if last_time is not None:
                self.intervals.append(completion.last_token_time - last_time)
            self._last[completion.index] = (completion.last_token_time, len(completion.token_ids))


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


FINISH_REASONS = ("stop", "length", "abort")
PARAMS_N_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0]
REQUEST_TIME_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                        480.0, 960.0, 1920.0, 7680.0]


def _advance(counter, seen: dict, key, now: float) -> None:
    """A counter brought up to the engine's running total `now` (seen[key]: the total it was last brought to)."""
    if now > seen.get(key, 0):
        counter.increment(now - seen.get(key, 0))
        seen[key] = now


class VllmMetrics:
    def __init__(self, pb_utils, labels: dict[str, str], stats_fn, info: dict[str, str], max_model_len: int,
                 cache_info: dict[str, str], take_iteration_tokens):
        Family = pb_utils.MetricFamily
        # Keep every family referenced: a collected family invalidates its metrics.
        self.families = []

        def new_family(name, description, kind):
            fam = Family(name=name, description=description, kind=kind)
            self.families.append(fam)
            return fam

        self._new_family = lambda name, description, kind: new_family(name, description, getattr(Family, kind))

        def family(name, description, kind, **metric_args):
            return new_family(name, description, kind).Metric(labels=labels, **metric_args)

        def histogram(name, description, buckets):
            return family(name, description, Family.HISTOGRAM, buckets=buckets)

        token_buckets = buckets_1_2_5(max_model_len)
        self.prompt_tokens = family("vllm:prompt_tokens_total", "Number of prefill tokens processed.", Family.COUNTER)
        self.generation_tokens = family(
            "vllm:generation_tokens_total", "Number of generation tokens processed.", Family.COUNTER
        )
        self.preemptions = family("vllm:num_preemptions_total", "Cumulative number of preemptions from the engine.",
                                  Family.COUNTER)
        success = new_family("vllm:request_success_total", "Count of successfully processed requests.", Family.COUNTER)
        self.success = {r: success.Metric(labels={**labels, "finished_reason": r}) for r in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              TPOT_BUCKETS)
        # vLLM's current name for the same gaps (vllm_backend's dashboards read the one above, vLLM's the other)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                                           8192.0, 16384.0])
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_TIME_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", REQUEST_TIME_BUCKETS)
        self.running = family("vllm:num_requests_running", "Number of requests currently running.", Family.GAUGE)
        self.waiting = family("vllm:num_requests_waiting", "Number of requests waiting to be processed.", Family.GAUGE)
        self.kv_usage = family("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", Family.GAUGE)
        self.prefix_hit_rate = family(
            "vllm:prefix_cache_hit_rate", "Prefix-cache hit rate over prompt tokens (0 to 1).", Family.GAUGE
        )
        # vLLM's current prefix-cache counters (dashboards divide their rates for the hit rate), in tokens
        self.prefix_queries = family("vllm:prefix_cache_queries_total",
                                     "Prefix cache queries, in terms of number of queried tokens.", Family.COUNTER)
        self.prefix_hits = family("vllm:prefix_cache_hits_total",
                                  "Prefix cache hits, in terms of number of cached tokens.", Family.COUNTER)
        self._prefix_seen: dict[str, int] = {}
        # Info metrics: the labels carry the facts, the value is 1.
        new_family("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.", Family.GAUGE).Metric(
            labels={**labels, **cache_info}).set(1)
        new_family("npu_llm:engine_info", "Engine model and device.", Family.GAUGE).Metric(
            labels={**labels, **info}).set(1)
        # MoE models: (token, expert) pairs each rank served, so that an uneven expert parallel split shows
        self._expert_pairs = new_family("npu_llm:moe_expert_pairs_total",
                                        "Cumulative (token, expert) pairs served per rank (MoE models).", Family.COUNTER)
        self._expert_pairs_by_rank: dict[int, object] = {}
        self._expert_pairs_seen: list[int] = []
        # speculative decoding (vLLM's spec-decode counters), made once the engine reports drafting
        self._spec_families = {
            "num_drafts": "Number of spec decoding drafts.",
            "num_draft_tokens": "Number of draft tokens.",
            "num_accepted_tokens": "Number of accepted tokens.",
            "num_accepted_tokens_per_pos": "Accepted tokens per draft's position.",
        }
        self._spec: dict[str, object] = {}
        self._spec_seen: dict[str, int] = {}
        # A KV connector's (disaggregated prefill, a KV pool), made once the engine reports one: metric ->
        # (TransferStats field, description). vLLM's own transfer metrics are its connectors' (vllm:nixl_*), so these
        # carry npu-llm's prefix; a pool's lookups count in vLLM's external prefix-cache counters.
        self._transfer_families = {
            "npu_llm:kv_transfer_bytes_total": ("bytes", "Bytes of KV pulled from prefill engines or a KV pool."),
            "npu_llm:kv_transfer_blocks_total": ("blocks", "KV blocks pulled from prefill engines or a KV pool."),
            "npu_llm:kv_transfer_seconds_total": ("seconds", "Seconds spent pulling KV, summed over pulls."),
            "npu_llm:kv_transfer_pulls_total": ("pulls", "Requests whose prompt KV was pulled from a prefill engine "
                                                         "or a KV pool."),
            "npu_llm:kv_transfer_failures_total": ("failures", "KV pulls that failed (the prompt recomputed here, or "
                                                               "the request failed)."),
            "npu_llm:kv_transfer_expired_total": ("expired", "Finished prefills whose blocks were freed by the "
                                                             "timeout, no consumer having pulled them."),
            "npu_llm:kv_transfer_saved_bytes_total": ("saved_bytes", "Bytes of KV saved to a KV pool."),
            "npu_llm:kv_transfer_saved_blocks_total": ("saved_blocks", "KV blocks saved to a KV pool."),
            "vllm:external_prefix_cache_queries_total": (
                "external_queries", "External prefix cache queries from KV connector cross-instance cache sharing, "
                                    "in terms of number of queried tokens."),
            "vllm:external_prefix_cache_hits_total": (
                "external_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in "
                                 "terms of number of cached tokens."),
        }
        self._transfer: dict[str, object] = {}
        self._transfer_seen: dict[str, float] = {}
        self._transferring = None
        self._lora_requests = None  # vllm:lora_requests_info, with enable_lora
        self._lora_series: dict[tuple, object] = {}
        self._labels = labels
        self._stats_fn = stats_fn
        self._take_iteration_tokens = take_iteration_tokens
        self._preemptions_seen = 0
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
            self._observe(r)
        for tokens in self._take_iteration_tokens():
            self.iteration_tokens.observe(tokens)
        stats = self._stats_fn()
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        _advance(self.prefix_queries, self._prefix_seen, "queries", stats.prefix_cache_queries)
        _advance(self.prefix_hits, self._prefix_seen, "hits", stats.prefix_cache_hits)
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.increment(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
        self._count_expert_pairs(stats.expert_load)
        if stats.spec_decode is not None:
            self._count_spec_decode(stats.spec_decode)
        if stats.kv_transfer is not None:
            self._count_kv_transfer(stats.kv_transfer, stats.num_transferring)
        if stats.max_loras is not None:
            self._lora_info(stats)

    def _lora_info(self, stats) -> None:
        """vLLM's vllm:lora_requests_info: a series per (max_lora, running, waiting) adapter names, comma-joined, set
        to the time it was last seen (a dashboard reads the newest)."""
        if self._lora_requests is None:
            self._lora_requests = self._new_family("vllm:lora_requests_info", "Running stats on lora requests.",
                                                   "GAUGE")
        labels = {**self._labels, "max_lora": str(stats.max_loras),
                  "waiting_lora_adapters": ",".join(stats.waiting_lora_adapters),
                  "running_lora_adapters": ",".join(stats.running_lora_adapters)}
        key = tuple(labels.values())
        if key not in self._lora_series:
            self._lora_series[key] = self._lora_requests.Metric(labels=labels)
        self._lora_series[key].set(time.time())

    def _count_kv_transfer(self, transfer, num_transferring: int) -> None:
        if not self._transfer:
            for name, (_, description) in self._transfer_families.items():
                family = self._new_family(name, description, "COUNTER")
                self._transfer[name] = family.Metric(labels=self._labels)
            self._transferring = self._new_family(
                "npu_llm:kv_transfer_requests", "Requests whose KV blocks a transfer holds (pulled here, or kept "
                "for a decode engine).", "GAUGE").Metric(labels=self._labels)
        for name, metric in self._transfer.items():
            _advance(metric, self._transfer_seen, name, getattr(transfer, self._transfer_families[name][0]))
        self._transferring.set(num_transferring)

    def _count_spec_decode(self, spec) -> None:
        if not self._spec:
            for name, description in self._spec_families.items():
                family = self._new_family(f"vllm:spec_decode_{name}_total", description, "COUNTER")
                if name == "num_accepted_tokens_per_pos":
                    for pos in range(len(spec.num_accepted_tokens_per_pos)):
                        self._spec[f"{name}:{pos}"] = family.Metric(labels={**self._labels, "position": str(pos)})
                else:
                    self._spec[name] = family.Metric(labels=self._labels)
        counts = {name: getattr(spec, name) for name in self._spec_families if name != "num_accepted_tokens_per_pos"}
        counts.update({f"num_accepted_tokens_per_pos:{pos}": n for pos, n in enumerate(spec.num_accepted_tokens_per_pos)})
        for key, now in counts.items():
            _advance(self._spec[key], self._spec_seen, key, now)

    def _count_expert_pairs(self, load: list[int]) -> None:
        seen = self._expert_pairs_seen + [0] * (len(load) - len(self._expert_pairs_seen))
        for rank, (now, before) in enumerate(zip(load, seen)):
            if rank not in self._expert_pairs_by_rank:
                self._expert_pairs_by_rank[rank] = self._expert_pairs.Metric(labels={**self._labels, "rank": str(rank)})
            if now > before:
                self._expert_pairs_by_rank[rank].increment(now - before)
        self._expert_pairs_seen = list(load)

    def _observe(self, r: RequestRecord) -> None:
        self.prompt_tokens.increment(r.prompt_tokens)
        self.generation_tokens.increment(r.generation_tokens)
        self.request_prompt_tokens.observe(r.prompt_tokens)
        self.request_generation_tokens.observe(r.generation_tokens)
        self.params_n.observe(r.n)
        self.params_max_tokens.observe(r.max_tokens)
        self.e2e.observe(r.e2e_s)
        for reason in r.finish_reasons:
            if reason in self.success:
                self.success[reason].increment(1)
        for gap in r.inter_token_s:
            self.tpot.observe(gap)
            self.itl.observe(gap)
        for histogram, value in ((self.ttft, r.ttft_s), (self.queue_time, r.queue_s),
                                 (self.prefill_time, r.prefill_s), (self.decode_time, r.decode_s),
                                 (self.inference_time, r.inference_s)):
            if value is not None:
                histogram.observe(value)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
