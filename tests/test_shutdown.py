"""`npu-llm serve` and `npu-llm gateway` as a user runs them: Triton listens on loopback only, two engines (data
parallel) share the requests, SIGTERM stops a busy stack within a bound and leaves no process behind, and a
tensor-parallel engine whose rank dies takes the model out of service (readiness false, 503) instead of leaving
requests to hang."""
from __future__ import annotations

import ipaddress
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backend import SamplingParams
from backend.config.control_key import ensure_control_key
from backend.models.registry import DEFAULT_MODEL
from backend.triton.launcher import CONTROL_KEY_HEADER, DEFAULT_REPOSITORY
from tests.conftest import GATEWAY_API_KEY, SMALL_KV_CACHE, free_port, make_tiny_model, start_gateway

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL  # the name the gateway serves it under
AUTH = {"Authorization": f"Bearer {GATEWAY_API_KEY}"}
SIGTERM_BOUND_S = 15


class Served:
    """`npu-llm serve` in a subprocess, on free ports."""

    def __init__(self, repository: Path, log_path: Path, *engine_args: str):
        self.http, self.grpc, self.metrics = free_port(), free_port(), free_port()
        argv = [sys.executable, "-m", "backend.entrypoints.cli", "serve", "--model-repository", str(repository),
                "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics)]
        for arg in (SMALL_KV_CACHE, "max_num_seqs=16", *engine_args):
            argv += ["--engine-arg", arg]
        self.log_path = log_path
        # the key Triton's model control answers to (backend/config/control_key.py), shared with `serve`
        self.control = {CONTROL_KEY_HEADER: ensure_control_key()}
        self.process = subprocess.Popen(argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not self.ready():
            assert self.process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)

    def ready(self, model: bool = False) -> bool:
        path = "/v2/models/llm/ready" if model else "/v2/health/ready"
        try:
            return httpx.get(f"http://127.0.0.1:{self.http}{path}", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def per_engine(self, name: str) -> dict[str, float]:
        """A vLLM metric's value on each engine (its engine label), summed over its other labels."""
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{self.metrics}/metrics").text):
            for sample in family.samples:
                if sample.name == name:
                    values[sample.labels["engine"]] = values.get(sample.labels["engine"], 0) + sample.value
        return values

    def wait_per_engine(self, name: str, condition, timeout: float = 30) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while not condition(values := self.per_engine(name)):
            assert time.monotonic() < deadline, f"{name}: {values}"
            time.sleep(0.2)
        return values

    def processes(self) -> list[psutil.Process]:
        """`npu-llm serve` and every process under it: Triton, its Python stubs, their workers."""
        serve = psutil.Process(self.process.pid)
        return [serve, *serve.children(recursive=True)]

    def kill(self) -> None:
        """Whatever is left of it (nothing, when the test passed)."""
        try:
            processes = self.processes()
        except psutil.Error:
            return
        for process in processes:
            try:
                process.kill()
            except psutil.Error:
                pass


def _listening(ports: set[int]) -> dict[int, bool]:
    """port -> whether it listens on loopback only (an IPv4-mapped IPv6 loopback counts as loopback)."""
    listening = {}
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports:
            address = ipaddress.ip_address(c.laddr.ip)
            address = getattr(address, "ipv4_mapped", None) or address
            listening[c.laddr.port] = listening.get(c.laddr.port, True) and address.is_loopback
    return listening


def _stream_forever(gateway: str, errors: list) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write an endless story."}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True, "n": 4, "temperature": 1.0}
    try:
        with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError as e:  # the server went away mid-stream, as it should
        errors.append(e)


def _streamed_text(gateway: str, prompt: str, max_tokens: int = 16, events: int | None = None) -> str:
    """A greedy streamed completion's text; with `events`, the connection is dropped after that many events."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": events is not None}
    text, seen = "", 0
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
                seen += 1
                if seen == events:
                    break
    return text


def test_two_engines_share_the_requests_and_sigterm_stops_the_busy_stack(tmp_path, reference_llm):
    """data_parallel_size=2: two Triton instances, an engine each. Requests land on both (their engine-labelled
    metrics), streamed greedy text equals the engine's, and a dropped stream frees its blocks. Triton listens on
    loopback only, and SIGTERM stops the busy stack within a bound, leaving no process behind."""
    served = Served(DEFAULT_REPOSITORY, tmp_path / "serve.log", "data_parallel_size=2", "dtype=float32")
    gateway_port = free_port()
    gateway = start_gateway(f"127.0.0.1:{served.grpc}", gateway_port, tmp_path / "gateway.log")
    url = f"http://127.0.0.1:{gateway_port}"
    try:
        # Triton has no authentication: its ports must not be reachable from elsewhere by default
        ports = {served.http, served.grpc, served.metrics}
        assert _listening(ports) == {port: True for port in ports}
        log = served.log_path.read_text()
        assert "engine 0 of 2 ready" in log and "engine 1 of 2 ready" in log and "(2 engines x TP 1)" in log

        prompts = [f"Tell me about {topic}." for topic in ("the sea", "bread", "the moon", "cats", "rain", "maps",
                                                           "salt", "music")]
        expected = [o.outputs[0].text for o in reference_llm.generate(prompts, SamplingParams(temperature=0,
                                                                                              max_tokens=16))]
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(lambda p: _streamed_text(url, p), prompts)) == expected
        done = served.wait_per_engine("vllm:request_success_total", lambda v: sum(v.values()) == len(prompts))
        assert set(done) == {"0", "1"} and all(done.values()), done  # both engines answered some

        assert _streamed_text(url, "Count to a thousand:", max_tokens=2000, events=3)
        served.wait_per_engine("vllm:request_success_total", lambda v: sum(v.values()) == len(prompts) + 1)
        assert served.wait_per_engine("vllm:kv_cache_usage_perc", lambda v: not any(v.values())) == {"0": 0, "1": 0}

        errors: list = []
        clients = [threading.Thread(target=_stream_forever, args=(url, errors)) for _ in range(6)]
        for c in clients:
            c.start()
        served.wait_per_engine("vllm:num_requests_running", lambda v: sum(v.values()) >= 16, timeout=120)
        stack = [*served.processes(), psutil.Process(gateway.pid)]
        assert sum("triton_python_backend_stub" in " ".join(p.cmdline()) for p in stack) == 2

        start = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        gateway.send_signal(signal.SIGTERM)
        gone, alive = psutil.wait_procs(stack, timeout=SIGTERM_BOUND_S)
        elapsed = time.monotonic() - start
        assert not alive, f"still running {elapsed:.0f} s after SIGTERM: {[p.cmdline()[:2] for p in alive]}"
        for c in clients:
            c.join(30)
        assert not _listening(ports | {gateway_port})
    finally:
        served.kill()
        gateway.kill()


def _stream_until_killed(http_port: int, kill) -> str:
    """Everything a long greedy stream from Triton's generate_stream sends, with `kill()` run after its first event."""
    body = {"text_input": "Count to a thousand:", "parameters": {"stream": True, "max_tokens": 400,
                                                                 "ignore_eos": True, "temperature": 0}}
    sent, killed = [], False
    with httpx.stream("POST", f"http://127.0.0.1:{http_port}/v2/models/llm/generate_stream", json=body,
                      timeout=60) as r:
        for line in r.iter_lines():
            sent.append(line)
            if line.startswith("data:") and not killed:
                kill()
                killed = True
    return "\n".join(sent)


def _ranks(served: Served) -> list[psutil.Process]:
    """The tensor-parallel workers of the engine `served` runs (spawned by Triton's Python stub)."""
    ranks = []
    for process in served.processes():
        try:
            if "multiprocessing.spawn" in " ".join(process.cmdline()):
                ranks.append(process)
        except psutil.Error:  # gone meanwhile
            pass
    return ranks


def _model_state(served: Served) -> str:
    """The model's state in Triton's repository index (READY, UNAVAILABLE, ...)."""
    index = httpx.post(f"http://127.0.0.1:{served.http}/v2/repository/index", json={}, headers=served.control,
                       timeout=10).json()
    return next((m.get("state", "") for m in index if m["name"] == "llm"), "")


def test_tensor_parallel_behind_triton_fails_recovers_and_unloads_cleanly(tmp_path, default_model_dir):
    """Tensor parallel behind Triton, in a repository as vllm_backend users write it: vLLM's model.json keys with
    the model pointed at a local folder, and its config parameters (metrics off, health check on). When rank 1
    dies mid-stream, the stream ends with an error naming it and the model goes out of service (readiness false,
    503) instead of leaving requests to hang. Loading it again brings it back; unloading it stops its worker while
    Triton stays up; SIGTERM, with a worker running, leaves no process."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(default_model_dir))
    model_dir = make_tiny_model("llama", tmp_path / "llama", vocab_size=vocab)  # 4 heads: it shards in two
    repository = tmp_path / "repository"
    (repository / "llm" / "1").mkdir(parents=True)
    config = (DEFAULT_REPOSITORY / "llm" / "config.pbtxt").read_text()
    (repository / "llm" / "config.pbtxt").write_text(
        config.replace('key: "REPORT_CUSTOM_METRICS"\n  value: { string_value: "true" }',
                       'key: "REPORT_CUSTOM_METRICS"\n  value: { string_value: "false" }'))
    (repository / "llm" / "1" / "model.json").write_text(json.dumps(
        {"model": str(model_dir), "tokenizer": str(default_model_dir), "tensor_parallel_size": 2,
         "disable_log_requests": True, "gpu_memory_utilization": 0.5, "enforce_eager": True}))
    (repository / "llm" / "1" / "model.py").write_text((DEFAULT_REPOSITORY / "llm" / "1" / "model.py").read_text())
    served = Served(repository, tmp_path / "serve.log")
    metrics = httpx.get(f"http://127.0.0.1:{served.metrics}/metrics", timeout=5).text
    assert "vllm:" not in metrics  # REPORT_CUSTOM_METRICS false
    gateway_port = free_port()
    gateway = start_gateway(f"127.0.0.1:{served.grpc}", gateway_port, tmp_path / "gateway.log")
    url = f"http://127.0.0.1:{gateway_port}"
    triton = f"http://127.0.0.1:{served.http}/v2/repository/models/llm"
    try:
        assert served.ready(model=True)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert "(1 engine x TP 2)" in served.log_path.read_text()

        [rank_1] = _ranks(served)
        stream = _stream_until_killed(served.http, rank_1.kill)
        assert "rank 1 exited with code -9" in stream, stream[-2000:]
        start = time.monotonic()
        while served.ready(model=True):
            assert time.monotonic() - start < 10, "the model still reads ready"
            time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        start = time.monotonic()
        after = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                           json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert after.status_code == 503 and time.monotonic() - start < 5, after.text

        start = time.monotonic()  # the dead engine's model unloads itself (asynchronously, as Triton unloads)
        while _model_state(served) != "UNAVAILABLE":
            assert time.monotonic() - start < 15, _model_state(served)
            time.sleep(0.2)
        assert httpx.post(f"{triton}/load", headers=served.control, timeout=120).status_code == 200
        assert served.ready(model=True)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        [rank_1] = _ranks(served)
        assert httpx.post(f"{triton}/unload", headers=served.control, timeout=60).status_code == 200
        rank_1.wait(15)  # unloading the model stops its worker...
        assert httpx.get(f"http://127.0.0.1:{served.http}/v2/health/live").status_code == 200  # ...not Triton

        assert httpx.post(f"{triton}/load", headers=served.control, timeout=120).status_code == 200
        assert served.ready(model=True)
        [rank_1] = _ranks(served)
        stack = served.processes()
        assert rank_1 in stack
        served.process.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(stack, timeout=SIGTERM_BOUND_S)
        assert not alive, f"still running after SIGTERM: {[p.cmdline()[:2] for p in alive]}"
    finally:
        served.process.send_signal(signal.SIGTERM)
        gateway.terminate()
        try:
            served.process.wait(SIGTERM_BOUND_S)
        finally:
            served.kill()
            gateway.kill()
