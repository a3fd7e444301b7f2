"""`npu-llm up` from cold, as on a new machine: one-time work is done before it says it is up, so the first request
is as fast as later ones; then SIGTERM stops every process it started.

It starts with an empty torch-extensions cache, so the CPU kernels are built while it starts: before the engine
warmed up at start-up, a newcomer's first reply stalled after one token while the extension compiled.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stop_tree(process: subprocess.Popen) -> None:
    """Stop `npu-llm up` and everything it started, whatever state it is in: SIGTERM (its own shutdown), then
    SIGKILL to the process group of each child left (Triton, the gateway and the UI run in sessions of their own)."""
    family = _descendants(process.pid)  # before the parent goes: its orphans would be reparented out of sight
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
    ours = os.getpgid(0)
    for pid in family:
        try:
            group = os.getpgid(pid)
            if group != ours:  # never the test run's own group
                os.killpg(group, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already


def _logged_at(log: str, marker: str) -> float:
    """When Triton logged the first line holding `marker`, as time.time() (glog stamps lines I1201 04:09:20.542507)."""
    line = next(line for line in log.splitlines() if marker in line)
    return datetime.strptime(f"{datetime.now().year} {line[1:21]}", "%Y %m%d %H:%M:%S.%f").timestamp()


def _wait_up(process: subprocess.Popen, log_path: Path, timeout: float = 600) -> None:
    """Until `npu-llm up` says it is up (failing with its log's end if it exits first)."""
    deadline = time.monotonic() + timeout
    while "npu-llm is up" not in log_path.read_text():
        assert process.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, "the stack did not come up"
        time.sleep(0.5)


def _timed_stream(client, prompt: str) -> tuple[float, float]:
    """(TTFT, median gap between responses) of one streamed greedy request, in seconds."""
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype, triton_type):
        t = grpcclient.InferInput(name, [1], triton_type)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        return t

    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    inputs = [tensor("text_input", prompt.encode(), np.object_, "BYTES"), tensor("stream", True, bool, "BOOL"),
              tensor("sampling_parameters", json.dumps(params).encode(), np.object_, "BYTES")]
    arrivals: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=partial(lambda q, result, error: q.put((time.perf_counter(), result, error)),
                                         arrivals))
    sent = time.perf_counter()
    client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
    times = []
    while True:
        at, result, error = arrivals.get(timeout=120)
        assert error is None, error
        if result.get_response().parameters.get("triton_final_response").bool_param:
            break
        times.append(at)
    client.stop_stream()
    assert len(times) >= 6, "expected one response per token"
    gaps = [b - a for a, b in zip(times, times[1:])]
    return times[0] - sent, statistics.median(gaps)


def test_up_from_cold_serves_the_first_request_as_fast_as_later_ones_and_sigterm_stops_all(tmp_path):
    import tritonclient.grpc as grpcclient

    ports = {name: free_port() for name in ("http", "grpc", "metrics", "gateway", "ui")}
    log_path = tmp_path / "up.log"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}  # nothing prebuilt
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "backend.entrypoints.cli", "up", "--http-port", str(ports["http"]), "--grpc-port",
             str(ports["grpc"]), "--metrics-port", str(ports["metrics"]), "--gateway-port", str(ports["gateway"]),
             "--ui-port", str(ports["ui"]), "--engine-arg", "kv_cache_memory_gb=0.5"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_up(process, log_path)
        assert any((tmp_path / "torch_extensions").rglob("*.so")), "the kernels were not built before it was up"
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['ui']}/", timeout=10) as page:
            assert page.status == 200  # the UI answers too
        client = grpcclient.InferenceServerClient(f"localhost:{ports['grpc']}")
        idle_s = time.time() - _logged_at(log_path.read_text(), "engine 0 of 1 ready")  # since its warm-up
        runs = [_timed_stream(client, f"Request {i}: name a colour and a number.") for i in range(10)]
        # These machines take longer to touch the weights after a pause, by up to ~50 ms per idle second, so the
        # first request's prefill is compared with one after as long a pause; its decode, with the tenth request's.
        time.sleep(idle_s)
        paused_ttft, _ = _timed_stream(client, "Request 10: name a colour and a number.")
        client.close()
        (first_ttft, first_itl), (_, tenth_itl) = runs[0], runs[9]
        assert first_ttft <= 2 * paused_ttft, (runs, paused_ttft, idle_s, log_path.read_text()[-3000:])
        assert first_itl <= 2 * tenth_itl, runs

        family = _descendants(process.pid)
        assert len(family) >= 3, "Triton, the gateway and the UI"
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (any(_port_open(p) for p in ports.values())
                                               or any(Path(f"/proc/{pid}").exists() for pid in family)):
            time.sleep(0.2)
        assert not [name for name, p in ports.items() if _port_open(p)]
        alive = [pid for pid in family if Path(f"/proc/{pid}").exists()
                 and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
        assert not alive
        assert process.returncode == 0
    finally:
        _stop_tree(process)


def _free_strided(servers: int, stride: int | None = None) -> int:
    """A port p with p + k * stride free for each of `servers` servers (by default up's layout of a disaggregated
    stack, PORT_STRIDE apart)."""
    from backend.entrypoints.up import PORT_STRIDE

    while True:
        base = free_port()
        if all(not _port_open(base + k * (stride or PORT_STRIDE)) for k in range(servers)):
            return base


@pytest.mark.parametrize("kv_pool", [False, True], ids=["point-to-point", "kv-pool"])
def test_up_disaggregated_1p1d_serves_through_the_proxy_and_sigterm_stops_all(tmp_path, kv_pool):
    """The KV moves from the prefill server to the decode server: pulled point to point (MooncakeConnectorV1), or,
    with --kv-pool, saved by the prefill server to Mooncake Store and loaded from it by the decode server (the
    tuning guide's pooling architecture)."""
    import httpx
    import psutil

    from backend.config.addresses import is_loopback
    from backend.entrypoints.up import PORT_STRIDE
    from tests.conftest import TritonMetrics
    from ui.server_metrics import ServerMetrics

    ports = {name: _free_strided(2) for name in ("http", "grpc", "metrics", "kv")}
    front = {name: free_port() for name in ("gateway", "ui")}
    pool = ["--kv-pool", "--kv-pool-port", str(front.setdefault("pool", _free_strided(2, stride=1)))] if kv_pool else []
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "backend.entrypoints.cli", "up", "--disaggregate", "1P1D", "--http-port", str(ports["http"]),
             "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
             "--gateway-port", str(front["gateway"]), "--ui-port", str(front["ui"]),
             "--engine-arg", "kv_cache_memory_gb=0.25", "--kv-port", str(ports["kv"]), *pool],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_up(process, log_path)
        ready = log_path.read_text()
        assert "1P1D" in ready and "prefill-0" in ready and "decode-0" in ready, ready[-2000:]
        gateway = f"http://127.0.0.1:{front['gateway']}"
        [model] = [m["id"] for m in httpx.get(f"{gateway}/v1/models", timeout=10).json()["data"]]
        prompt = "The capital of France is Paris, and the capital of Italy is Rome. " * 6  # (full KV blocks)
        response = httpx.post(f"{gateway}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200 and response.json()["choices"][0]["text"], response.text
        decode = TritonMetrics(f"http://127.0.0.1:{ports['metrics'] + PORT_STRIDE}/metrics")
        assert decode.wait_metric("npu_llm:kv_transfer_pulls_total", lambda v: v >= 1) == 1  # prefilled apart
        if kv_pool:
            assert "KV pool      Mooncake master" in ready
            prefill = TritonMetrics(f"http://127.0.0.1:{ports['metrics']}/metrics")
            # (the prefill server counts its save after the put returns, and publishes its metrics apart: the decode
            # server may have loaded the blocks first)
            assert prefill.wait_metric("npu_llm:kv_transfer_saved_blocks_total", lambda v: v >= 4) >= 4
            hits = decode.metric("vllm:external_prefix_cache_hits_total")
            assert hits >= 4 * 16
            rate = round(hits / decode.metric("vllm:external_prefix_cache_queries_total") * 100)
            panel, _, _ = ServerMetrics([decode.metrics_url]).refresh()  # (the UI's server panel)
            assert f"**KV pool hit rate** {rate}%" in panel, panel
        with urllib.request.urlopen(f"http://127.0.0.1:{front['ui']}/", timeout=10) as page:
            assert page.status == 200

        family = _descendants(process.pid)
        # nothing of the stack listens off loopback: not Triton, the gateway or the UI, and not Mooncake's transfer
        # engines, whose KV memory other hosts could otherwise read and write
        listening = [(c.laddr.ip, c.laddr.port, psutil.Process(pid).name()) for pid in [process.pid, *family]
                     for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
        assert len(listening) >= 12 and not [x for x in listening if not is_loopback(x[0].removeprefix("::ffff:"))], \
            listening
        process.send_signal(signal.SIGTERM)
        process.wait(15)
        every_port = [p + k * PORT_STRIDE for p in ports.values() for k in range(2)] + list(front.values()) + \
            ([front["pool"] + 1] if kv_pool else [])  # (the master's admin server)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (any(_port_open(p) for p in every_port)
                                               or any(Path(f"/proc/{pid}").exists() for pid in family)):
            time.sleep(0.2)
        assert not [p for p in every_port if _port_open(p)]
        assert not [pid for pid in family if Path(f"/proc/{pid}").exists()
                    and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
        assert process.returncode == 0
    finally:
        _stop_tree(process)
