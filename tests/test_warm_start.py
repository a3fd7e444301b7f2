"""All one-time work happens before Triton reports ready: the first request is as fast as the tenth.

The server starts with an empty torch-extensions cache, so the CPU kernels must be built while it
starts; before the engine warmed up at start-up, a newcomer's first reply stalled after one token
while the extension compiled.
"""
from __future__ import annotations

import json
import queue
import shutil
import statistics
import time
from functools import partial

import numpy as np
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow


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


def test_first_request_after_ready_is_as_fast_as_the_tenth(tmp_path, monkeypatch):
    import tritonclient.grpc as grpcclient

    from backend.serve import start_server, stop_process_group, wait_ready
    from backend.triton.launcher import DEFAULT_REPOSITORY

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))  # nothing prebuilt
    ports = free_port(), free_port(), free_port()
    log_path = tmp_path / "tritonserver.log"
    with open(log_path, "w") as log:
        process, work_dir = start_server(DEFAULT_REPOSITORY, {"kv_cache_memory_gb": 0.5}, *ports, log_file=log,
                                         new_session=True)
    try:
        wait_ready(ports[0], process, timeout=600)
        assert any((tmp_path / "torch_extensions").rglob("*.so")), "the kernels were not built before ready"
        client = grpcclient.InferenceServerClient(f"localhost:{ports[1]}")
        runs = [_timed_stream(client, f"Request {i}: name a colour and a number.") for i in range(10)]
        client.close()
    finally:
        stop_process_group(process, grace_s=20)
        shutil.rmtree(work_dir, ignore_errors=True)
    (first_ttft, first_itl), (tenth_ttft, tenth_itl) = runs[0], runs[9]
    assert first_ttft <= 2 * tenth_ttft, (runs, log_path.read_text()[-3000:])
    assert first_itl <= 2 * tenth_itl, runs
