"""No client can hurt another, on the real stack (tritonserver + gateway): adversarial bodies while greedy
streams run, a storm of disconnects, non-streaming disconnects, token-id prompts, caps, and a 12-second soak."""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend import SamplingParams
from backend.models.registry import DEFAULT_MODEL
from tests.conftest import GATEWAY_API_KEY, SMALL_KV_CACHE, free_port

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL  # the name the gateway serves it under
AUTH = {"Authorization": f"Bearer {GATEWAY_API_KEY}"}
STREAM_PROMPTS = ["Tell me about the sea.", "List three fruits.", "What is rain?", "Describe a cat."]
STREAM_TOKENS = 24


@pytest.fixture(scope="module")
def expected_texts(reference_llm):
    params = SamplingParams(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    return {p: o.outputs[0].text for p, o in zip(STREAM_PROMPTS, reference_llm.chat(
        [[{"role": "user", "content": p}] for p in STREAM_PROMPTS], params))}


def _stream_text(gateway: str, prompt: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    text = []
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += [c["delta"].get("content") or "" for c in event["choices"]]
    return "".join(text)


class GreedyStreams:
    """Four clients sending greedy streams over and over; each must equal what the engine produces alone."""

    def __init__(self, gateway: str, expected: dict[str, str]):
        self.gateway, self.expected = gateway, expected
        self.stop = threading.Event()
        self.completed, self.mismatches = 0, []
        self.threads = [threading.Thread(target=self._client, args=(p,)) for p in STREAM_PROMPTS]

    def _client(self, prompt: str) -> None:
        while not self.stop.is_set():
            try:
                text = _stream_text(self.gateway, prompt)
            except Exception as e:  # noqa: BLE001 - any failure of an innocent stream is the finding
                self.mismatches.append((prompt, repr(e)))
                continue
            if text != self.expected[prompt]:
                self.mismatches.append((prompt, text))
            self.completed += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(180)


# -- the fuzz ----------------------------------------------------------------------------------------

ODD_NUMBERS = st.sampled_from([-1, 0, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 0.5, -0.0, 1e308,
                               1e-320, math.nan, math.inf, -math.inf])
ODD_VALUES = st.recursive(
    st.none() | st.booleans() | ODD_NUMBERS | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "n", "seed", "stop",
                   "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                   "ignore_eos", "include_stop_str_in_output", "skip_special_tokens"]
CHAT_FIELDS = SAMPLING_FIELDS + ["model", "messages", "stream", "stream_options", "top_logprobs",
                                 "max_completion_tokens"]
COMPLETION_FIELDS = SAMPLING_FIELDS + ["model", "prompt", "stream", "echo"]
RESPONSES_FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
                    "tool_choice", "parallel_tool_calls", "stream", "store", "previous_response_id", "seed", "top_k",
                    "structured_outputs", "include", "reasoning"]
# each endpoint's base body, the fields to mutate, and its token limit (kept, so that a valid body stays short)
BASES = {
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                             CHAT_FIELDS, "max_tokens"),
    "/v1/completions": ({"model": MODEL, "prompt": "Hi", "max_tokens": 4}, COMPLETION_FIELDS, "max_tokens"),
    "/v1/responses": ({"model": MODEL, "input": "Hi", "max_output_tokens": 4}, RESPONSES_FIELDS, "max_output_tokens"),
    "/tokenize": ({"model": MODEL, "prompt": "Hi"}, ["model", "prompt", "messages", "add_special_tokens", "tools",
                                                     "return_token_strs"], None),
    "/detokenize": ({"model": MODEL, "tokens": [1, 2]}, ["model", "tokens"], None),
}
DELETE = object()


def _mutated(base: dict, fields: list[str], limit: str | None):
    changes = st.lists(st.tuples(st.sampled_from(fields) | st.text(max_size=8), ODD_VALUES | st.just(DELETE)),
                       min_size=1, max_size=3)

    def apply(edits):
        body = dict(base)
        for key, value in edits:
            if value is DELETE:
                body.pop(key, None)
            else:
                body[key] = value
        if limit is not None and body.get(limit) is None:  # no limit would be valid, and run to max_model_len
            body[limit] = 4
        return body

    return changes.map(apply)


def _body_bytes(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN / Infinity literals, as some clients send them


RAW_BODIES = [
    b"", b"null", b"[]", b'"text"', b"{", b"\xff\xfe\xfa", b'{"model": "\xff"}', b"[" * 50_000 + b"]" * 50_000,
    b'{"a":' * 20_000 + b"1" + b"}" * 20_000, b'{"model": "' + MODEL.encode() + b'", "messages": NaN}',
    b'{"model": "' + b"x" * 300_000 + b'"}',  # over the test gateway's --max-body-bytes: 413
]
gateway_request = st.one_of(
    *(st.tuples(st.just(path), _mutated(*spec).map(_body_bytes)) for path, spec in BASES.items()),
    st.tuples(st.sampled_from(list(BASES)), st.sampled_from(RAW_BODIES) | st.binary(max_size=64)),
)
# text_input stays a string: Triton's own HTTP frontend (not our model) answers 500 to a non-string one.
triton_request = st.tuples(st.text(max_size=20), _mutated({"max_tokens": 4, "temperature": 0}, SAMPLING_FIELDS, "max_tokens"))


def _check_gateway(gateway: str, path: str, data: bytes) -> None:
    """A bad body gets a 4xx, a good one a 200; never a 5xx, never a hang. Streams are cut after the status."""
    headers = {**AUTH, "Content-Type": "application/json"}
    with httpx.stream("POST", f"{gateway}{path}", content=data, headers=headers, timeout=60) as response:
        assert response.status_code < 500, (data[:300], response.read()[:500])
        if response.status_code != 200:
            error = json.loads(response.read())["error"]
            assert error["code"] == response.status_code and error["message"]


def _check_triton(http_url: str, text, parameters: dict) -> None:
    body = {"text_input": text, "parameters": parameters}
    response = httpx.post(f"http://{http_url}/v2/models/llm/generate", content=_body_bytes(body), timeout=60)
    assert response.status_code < 500, (body, response.text[:500])


def test_fuzzed_requests_get_4xx_and_never_disturb_other_streams(gateway, triton_server, expected_texts):
    @settings(max_examples=50, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request=gateway_request)
    def fuzz_gateway(request):
        _check_gateway(gateway, *request)

    @settings(max_examples=30, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request=triton_request)
    def fuzz_triton(request):
        _check_triton(triton_server.http_url, *request)

    with GreedyStreams(gateway, expected_texts) as streams:
        fuzz_gateway()
        fuzz_triton()
        for body in RAW_BODIES:  # every raw body once, whatever hypothesis picked
            _check_gateway(gateway, "/v1/chat/completions", body)
    assert not streams.mismatches, streams.mismatches[:3]
    assert streams.completed >= 4
    _assert_idle(triton_server)
    assert httpx.get(f"{gateway}/health", timeout=10).status_code == 200


def _assert_idle(triton_server, timeout: float = 10.0) -> None:
    assert triton_server.wait_metric("vllm:num_requests_running", lambda v: v == 0, timeout) == 0
    assert triton_server.wait_metric("vllm:num_requests_waiting", lambda v: v == 0, timeout) == 0
    assert triton_server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0, timeout) == 0


# -- specific findings ---------------------------------------------------------------------------------


def test_parameters_beyond_any_tensor_are_400_at_the_gateway_and_in_triton(gateway, triton_server):
    for extra in ({"top_k": 2**63, "top_p": 0.9}, {"seed": 2**63}, {"min_tokens": 2**63}):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **extra}
        response = httpx.post(f"{gateway}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == next(iter(extra))
    vocab = 49152
    for parameters, named in (({"n": 100_000}, "max_num_seqs"), ({"top_k": 2**63, "top_p": 0.9}, "top_k"),
                              ({"stop_token_ids": [vocab], "min_tokens": 2}, "stop_token_ids")):
        response = httpx.post(f"http://{triton_server.http_url}/v2/models/llm/generate", timeout=60,
                              json={"text_input": "Hi", "parameters": {"max_tokens": 4, **parameters}})
        assert response.status_code == 400 and named in response.text, response.text
    _assert_idle(triton_server)


def test_token_id_prompts_reach_the_engine_as_they_are(gateway, reference_llm):
    # ids that do not survive decode + encode: the engine must see exactly these
    ids = [28, 28, 28, 1126, 2344, 1126, 28, 28]
    tokenizer = reference_llm.get_tokenizer()
    assert tokenizer.encode(tokenizer.decode(ids)) != ids
    [expected] = reference_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8))
    body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{gateway}/v1/completions", json=body, headers=AUTH, timeout=60).json()
    assert response["choices"][0]["text"] == expected.outputs[0].text
    assert response["usage"]["prompt_tokens"] == len(ids)
    for bad in ([-1, 5], [49152], [2**63]):
        response = httpx.post(f"{gateway}/v1/completions", json={**body, "prompt": bad}, headers=AUTH, timeout=60)
        assert response.status_code == 400, response.text


def _wait_running(triton_server, at_least: int, timeout: float = 60.0) -> None:
    assert triton_server.wait_metric("vllm:num_requests_running", lambda v: v >= at_least, timeout) >= at_least


def _cut_after_first_byte(url: str, body: dict) -> socket.socket:
    """A raw HTTP request that is left hanging (to be closed by the caller mid-generation)."""
    host, port = url.removeprefix("http://").split(":")
    path = body.pop("_path")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {GATEWAY_API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_a_non_streaming_request_is_cancelled_when_its_client_leaves(gateway, triton_server):
    _assert_idle(triton_server)
    body = {"_path": "/v1/completions", "model": MODEL, "prompt": "Write an endless story.", "max_tokens": 3000,
            "ignore_eos": True}
    sock = _cut_after_first_byte(gateway, body)
    _wait_running(triton_server, 1)
    sock.close()
    _assert_idle(triton_server)


def test_a_storm_of_disconnects_leaves_nothing_behind(gateway, triton_server):
    _assert_idle(triton_server)
    story = {"model": MODEL, "messages": [{"role": "user", "content": "Write an endless story."}], "max_tokens": 3000,
             "ignore_eos": True}
    sockets = [_cut_after_first_byte(gateway, {"_path": "/v1/chat/completions", **story, "stream": True})
               for _ in range(50)]
    sockets += [_cut_after_first_byte(gateway, {"_path": "/v1/chat/completions", **story}) for _ in range(10)]
    _wait_running(triton_server, 16)  # the test server runs 16 at a time; the rest wait
    for sock in sockets:
        sock.close()
    _assert_idle(triton_server)
    ok = httpx.post(f"{gateway}/v1/completions", headers=AUTH, timeout=60,
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_soak_of_twelve_seconds_on_a_stack_it_starts(tmp_path):
    """`npu-llm loadtest --start-stack --soak`: it starts Triton and the gateway, loads them for 12 s while watching
    their memory and the KV cache, and stops them: no error, no memory creep, no KV block held, no port left open."""
    ports = {name: free_port() for name in ("gateway", "http", "grpc", "metrics")}
    warm_up_s = 6
    run = subprocess.run(
        [sys.executable, "-m", "backend.entrypoints.cli", "loadtest", "--start-stack", "--soak", "--soak-warm-up", str(warm_up_s),
         "--target", "gateway", *(a for name, port in ports.items() for a in (f"--{name}-port", str(port))),
         "--engine-arg", "max_num_seqs=8", "--engine-arg", SMALL_KV_CACHE,
         "--users", "4", "--spawn-rate", "4", "--run-time", "12s",
         "--prompt-len", "32:96", "--max-tokens", "8:32", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    soak = json.loads((tmp_path / "soak.json").read_text())
    assert soak["failures"] == [] and soak["errors"] == 0 and soak["requests"] > 10
    assert any(name.startswith("engine") for name in soak["memory"]), soak["memory"]
    assert any(name.startswith("gateway") for name in soak["memory"]), soak["memory"]
    assert soak["after_stop"]["kv_usage"] == 0
    assert sum(sample["t"] >= warm_up_s for sample in soak["series"]) >= 3  # the creep check compares these
    assert "soak passed" in run.stdout
    for name, port in ports.items():  # the stack it started is gone
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, name
