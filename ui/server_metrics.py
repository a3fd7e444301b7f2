"""The UI's server panel and plots, from Triton's Prometheus /metrics (the metric names of Triton's vLLM backend).

Each refresh samples the counters and gauges; the plots are the last HISTORY_S seconds of those samples, as
dataframes with typed columns: Gradio's plots pick each axis's scale from its column's dtype, and an untyped
(object) column, which an empty frame has, is drawn as categories (raw floats as ticks, in the order they came).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import NamedTuple

import pandas as pd

from backend.triton.scrape import Scrape

HISTORY_S = 300
REFRESH_S = 3.0


class Sample(NamedTuple):
    time: float
    generation_tokens: float  # vllm:generation_tokens_total, summed over the engines
    kv_cache_usage: float  # vllm:kv_cache_usage_perc (0..1), averaged over the engines


class ServerMetrics:
    """The servers that answer the chat (several: decode servers of a disaggregated deployment, summed), and, where
    prefill runs apart, the prefill servers, shown as a role of their own."""

    def __init__(self, metrics_urls: list[str], prefill_metrics_urls: list[str] = ()):
        self.metrics_urls = list(metrics_urls)
        self.prefill_metrics_urls = list(prefill_metrics_urls)
        self.samples: deque[Sample] = deque()
        self._lock = threading.Lock()  # (each page's timer refreshes from a worker thread of its own)

    def refresh(self) -> tuple[str, pd.DataFrame, pd.DataFrame]:
        """The panel's markdown, the throughput frame and the KV-cache frame, sampled now."""
        try:
            served = Scrape(self.metrics_urls)
            prefill = Scrape(self.prefill_metrics_urls) if self.prefill_metrics_urls else None
        except OSError as e:
            reason = getattr(e, "reason", e)  # (a URLError's own, without its wrapping)
            panel = f"**Server** unreachable: no metrics at {getattr(e, 'url', '?')} ({reason})"
            return panel, self.throughput(), self.kv_cache()

        engines = served.samples.get("npu_llm:engine_info", [])
        labels = engines[0].labels if engines else {}
        devices = ", ".join(engine.labels.get("device", "?") for engine in engines) or "?"
        now = time.time()
        with self._lock:
            # Every open page refreshes on its own timer: samples closer than half a period would be rates of noise.
            if not self.samples or now - self.samples[-1].time >= REFRESH_S / 2:
                # (the parser strips _total from counters)
                self.samples.append(Sample(now, served.total("vllm:generation_tokens"),
                                           served.mean("vllm:kv_cache_usage_perc")))
            while self.samples and self.samples[0].time < now - HISTORY_S:
                self.samples.popleft()
        panel = (
            f"**Model** {labels.get('engine_model', '?')} · **Layout** {labels.get('layout', '?')} on {devices} · "
            + ("**Decode** " if prefill else "") + _load(served)
            + f" · **Prefix-cache hit rate** {served.mean('vllm:prefix_cache_hit_rate') * 100:.0f}%" + _pool(served)
            + _drafts(served)
        )
        if prefill:  # (disaggregated: the prefill servers, and the KV pulled from them)
            panel += (f"  \n**Prefill** {len(self.prefill_metrics_urls)} server(s): {_load(prefill)} · "
                      f"**KV pulled** {served.total('npu_llm:kv_transfer_bytes') / 2**20:.1f} MiB")
        return panel, self.throughput(), self.kv_cache()

    def throughput(self) -> pd.DataFrame:
        """Generation tokens/s between successive samples, at clock time (none across a restarted server's reset
        counter)."""
        points = self._points()
        pairs = [(b.time, (b.generation_tokens - a.generation_tokens) / (b.time - a.time))
                 for a, b in zip(points, points[1:]) if b.time > a.time and b.generation_tokens >= a.generation_tokens]
        return _frame([t for t, _ in pairs], "tokens/s", [rate for _, rate in pairs])

    def kv_cache(self) -> pd.DataFrame:
        """KV-cache usage in percent, at clock time."""
        points = self._points()
        return _frame([s.time for s in points], "KV cache %", [s.kv_cache_usage * 100 for s in points])

    def _points(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)


def _load(scrape: Scrape) -> str:
    """KV cache, running and waiting of some servers, as the panel shows them."""
    return (f"**KV cache** {scrape.mean('vllm:kv_cache_usage_perc') * 100:.1f}% · "
            f"**Running** {scrape.total('vllm:num_requests_running'):.0f} · "
            f"**Waiting** {scrape.total('vllm:num_requests_waiting'):.0f}")


def _pool(scrape: Scrape) -> str:
    """With a KV pool (CPU offload, Mooncake Store): the share of the prompt tokens looked up there that it held."""
    if "vllm:external_prefix_cache_queries" not in scrape.samples:
        return ""
    queries = scrape.total("vllm:external_prefix_cache_queries")
    if not queries:
        return " · **KV pool** no lookups yet"
    return f" · **KV pool hit rate** {scrape.total('vllm:external_prefix_cache_hits') / queries * 100:.0f}%"


def _drafts(scrape: Scrape) -> str:
    """With speculative decoding: the share of draft tokens kept, and vLLM's mean acceptance length (the tokens a
    verification yields: its kept drafts and the token after them)."""
    drafts = scrape.total("vllm:spec_decode_num_draft_tokens")
    if "vllm:spec_decode_num_draft_tokens" not in scrape.samples:
        return ""
    accepted, verifications = scrape.total("vllm:spec_decode_num_accepted_tokens"), scrape.total("vllm:spec_decode_num_drafts")
    if not verifications:
        return " · **Drafts** none yet"
    return (f" · **Drafts kept** {accepted / drafts * 100:.0f}% "
            f"({1 + accepted / verifications:.2f} tokens a verification)")


def _frame(times: list[float], name: str, values: list[float]) -> pd.DataFrame:
    """A time series as Gradio's plots read one: datetime64 (naive UTC) against float64, even when empty."""
    return pd.DataFrame({"time": pd.to_datetime(times, unit="s", utc=True).tz_convert(None),
                         name: pd.Series(values, dtype="float64")})
