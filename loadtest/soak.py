"""Soak checks for `npu-llm loadtest --soak`: while the load runs, every stack process's memory and the KV
cache are sampled; afterwards the run fails on any request error, on memory that keeps growing after
warm-up, or on KV blocks still held once the users have stopped.

The processes are found by the ports they listen on (gateway, Triton HTTP / gRPC / metrics) plus their
children (Triton's python stub, where the engine lives), so a stack started elsewhere is watched too.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from backend.triton.scrape import Scrape

MiB = 2**20


@dataclass
class SoakLimits:
    warm_up_s: float = 20.0  # memory is compared from the first sample after this
    rss_growth: float = 0.25  # fail when a process grows by more than this fraction after warm-up...
    rss_growth_floor_mib: float = 64.0  # ...and by more than this much (small processes jitter)
    drain_s: float = 10.0  # time for running requests and KV usage to reach 0 once the users stop


@dataclass
class SoakMonitor:
    ports: list[int]
    metrics_url: str
    interval_s: float = 2.0
    samples: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-monitor", daemon=True)
        self.processes = stack_processes(self.ports)

    def start(self) -> "SoakMonitor":
        if not self.processes:
            raise RuntimeError(f"no process listens on ports {self.ports}: is the stack up?")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            sample = {"t": round(time.monotonic() - start, 1), "rss": rss_by_process(self.processes)}
            try:
                sample.update(engine_gauges(self.metrics_url))
            except OSError as e:  # a busy server may miss one scrape; the verdict counts them
                sample["error"] = repr(e)
            self.samples.append(sample)
            self._stop.wait(self.interval_s)

    def drained(self, timeout: float) -> dict:
        """Waits until no request runs and no KV block is held (or timeout); returns the last gauges."""
        deadline = time.monotonic() + timeout
        while True:
            gauges = engine_gauges(self.metrics_url)
            if (gauges["running"] == 0 and gauges["kv_usage"] == 0) or time.monotonic() > deadline:
                return gauges
            time.sleep(0.25)


def stack_processes(ports: list[int]) -> dict[str, psutil.Process]:
    """'name pid' -> process, for every process listening on one of the ports, and its descendants."""
    found: dict[int, psutil.Process] = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port in ports and conn.pid:
            parent = psutil.Process(conn.pid)
            for process in [parent, *parent.children(recursive=True)]:
                found[process.pid] = process
    return {f"{_name(p)} {pid}": p for pid, p in sorted(found.items())}


def _name(process: psutil.Process) -> str:
    cmdline = " ".join(process.cmdline())
    for marker, name in (("triton_python_backend_stub", "engine (python stub)"), ("tritonserver", "tritonserver"),
                         ("gateway", "gateway"), ("backend.entrypoints.cli ui", "ui")):
        if marker in cmdline:
            return name
    return process.name()


def rss_by_process(processes: dict[str, psutil.Process]) -> dict[str, int]:
    rss = {}
    for name, process in processes.items():
        try:
            rss[name] = process.memory_info().rss
        except psutil.Error:  # it exited: the verdict reports the missing samples
            pass
    return rss


def engine_gauges(metrics_url: str) -> dict:
    """Requests running and waiting over all engines (data parallel: one per Triton instance), and the fullest
    engine's KV-cache usage."""
    scrape = Scrape([metrics_url], timeout=5)
    nan = [float("nan")]
    return {"running": sum(scrape.values("vllm:num_requests_running") or nan),
            "waiting": sum(scrape.values("vllm:num_requests_waiting") or nan),
            "kv_usage": max(scrape.values("vllm:kv_cache_usage_perc") or nan)}


def verdict(monitor: SoakMonitor, summary: dict, after: dict, limits: SoakLimits) -> dict:
    """The soak's figures and its failures (an empty list: it passed)."""
    failures = []
    if summary["errors"]:
        failures.append(f"{summary['errors']} of {summary['requests']} requests failed")
    if not summary["requests"]:
        failures.append("no request completed")
    settled = [s for s in monitor.samples if s["t"] >= limits.warm_up_s] or monitor.samples[-1:]
    memory = {}
    for name in monitor.processes:
        series = [s["rss"][name] for s in settled if name in s["rss"]]
        if not series:
            failures.append(f"{name} exited during the soak")
            continue
        first, last = series[0], series[-1]
        memory[name] = {"rss_start_mib": round(first / MiB, 1), "rss_mid_mib": round(series[len(series) // 2] / MiB, 1),
                        "rss_end_mib": round(last / MiB, 1), "rss_max_mib": round(max(series) / MiB, 1)}
        if last - first > max(limits.rss_growth * first, limits.rss_growth_floor_mib * MiB):
            failures.append(f"{name} grew from {first / MiB:.0f} MiB to {last / MiB:.0f} MiB after warm-up")
    if after["running"] != 0 or after["kv_usage"] != 0:
        failures.append(f"after the users stopped: {after['running']:.0f} requests running, "
                        f"KV cache {after['kv_usage']:.1%} used")
    missed = sum(1 for s in monitor.samples if "error" in s)
    if missed > len(monitor.samples) // 4:
        failures.append(f"{missed} of {len(monitor.samples)} metrics scrapes failed")
    return {"requests": summary["requests"], "errors": summary["errors"],
            "ttft_p50_ms": summary["latency_ms"]["TTFT"]["p50"], "ttft_p99_ms": summary["latency_ms"]["TTFT"]["p99"],
            "output_tokens_per_s": summary["output_tokens_per_s"], "memory": memory,
            "after_stop": after, "samples": len(monitor.samples), "failures": failures,
            "series": [{"t": s["t"], "kv_usage": s.get("kv_usage"),
                        "rss_mib": {n: round(v / MiB, 1) for n, v in s["rss"].items()}} for s in monitor.samples]}


def write_verdict(out: Path, result: dict) -> None:
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    print(f"npu-llm soak: {result['requests']} requests, {result['errors']} errors, "
          f"TTFT p50 {result['ttft_p50_ms']} ms / p99 {result['ttft_p99_ms']} ms", flush=True)
    for name, m in result["memory"].items():
        print(f"  {name}: RSS {m['rss_start_mib']} -> {m['rss_mid_mib']} -> {m['rss_end_mib']} MiB "
              f"(max {m['rss_max_mib']})", flush=True)
    for failure in result["failures"]:
        print(f"  FAIL: {failure}", flush=True)
    if not result["failures"]:
        print("  soak passed", flush=True)
