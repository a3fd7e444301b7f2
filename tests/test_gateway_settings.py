"""What docs/serving.md promises of the gateway's settings and hardening, against a real gateway process (in front
of the session's tritonserver): the API key from the environment, CORS, body limits, health, its own metrics."""
from __future__ import annotations

import re

import httpx
import pytest

from backend.models.registry import DEFAULT_MODEL
from tests.conftest import free_port, start_gateway

pytestmark = pytest.mark.slow
ENV_KEY = "key-from-the-environment"
ALLOWED = "http://allowed.example"
AUTH = {"Authorization": f"Bearer {ENV_KEY}"}
CHAT = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def url(triton_server, tmp_path_factory):
    port = free_port()
    process = start_gateway(triton_server.grpc_url, port, tmp_path_factory.mktemp("gateway2") / "gateway.log",
                            api_key=None, extra_args=("--cors-origin", ALLOWED), env_api_key=ENV_KEY)
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(15)


def test_the_api_key_comes_from_the_environment(url):
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"] == DEFAULT_MODEL
    health = httpx.get(f"{url}/health", timeout=10)  # the one open route: Triton's model is ready
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_cors_preflight_allows_the_configured_origin_only(url):
    def preflight(origin):
        return httpx.options(f"{url}/v1/chat/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})

    allowed = preflight(ALLOWED)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in allowed.headers["access-control-allow-methods"]
    refused = preflight("http://elsewhere.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


def test_a_chunked_body_over_the_limit_is_refused(url):
    def body():  # no Content-Length: the size is only known by reading
        for _ in range(30):
            yield b"x" * 10_000

    response = httpx.post(f"{url}/v1/chat/completions", content=body(), headers=AUTH, timeout=30)
    assert response.status_code == 413 and "200000" in response.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60).status_code == 200


def _metric(url: str, pattern: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    match = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_the_gateways_metrics_count_what_it_served(url):
    ok = r'npu_llm_gateway_requests_total\{endpoint="chat",status="200"\}'
    bad = r'npu_llm_gateway_requests_total\{endpoint="chat",status="400"\}'
    ttft = r'npu_llm_gateway_time_to_first_token_seconds_count\{endpoint="chat"\}'
    before = [_metric(url, p) for p in (ok, bad, ttft)]
    for _ in range(2):
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60).status_code == 200
    assert httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "n": 0}, headers=AUTH,
                      timeout=60).status_code == 400
    after = [_metric(url, p) for p in (ok, bad, ttft)]
    assert [a - b for a, b in zip(after, before)] == [2, 1, 2]
