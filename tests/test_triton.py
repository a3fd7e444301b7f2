"""The Triton backend against a real tritonserver, through tritonclient (gRPC) and the HTTP generate API."""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from functools import partial

import numpy as np
import pytest

from backend import SamplingParams

pytestmark = pytest.mark.slow


def _inputs(prompt: str | None, params: dict | str, stream: bool, **flags):
    """The vLLM backend's inputs, as its clients build them."""
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype, triton_type):
        t = grpcclient.InferInput(name, [1], triton_type)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        return t

    inputs = []
    if prompt is not None:
        inputs.append(tensor("text_input", prompt.encode(), np.object_, "BYTES"))
    inputs.append(tensor("stream", stream, bool, "BOOL"))
    raw = params if isinstance(params, str) else json.dumps(params)
    inputs.append(tensor("sampling_parameters", raw.encode(), np.object_, "BYTES"))
    for name, value in flags.items():
        inputs.append(tensor(name, value, bool, "BOOL"))
    return inputs


class StreamResult:
    def __init__(self):
        self.texts, self.errors, self.finish_reason = [], [], None
        self.num_output_tokens, self.num_input_tokens = 0, None
        self.done = threading.Event()


def _collect(state: StreamResult, result, error):
    """tritonclient's stream callback (it passes result= and error= by name)."""
    if error is not None:
        state.errors.append(str(error))
        state.done.set()
        return
    outputs = {o.name for o in result.get_response().outputs}
    if "text_output" in outputs:
        state.texts.append(result.as_numpy("text_output")[0].decode())
    if "num_output_tokens" in outputs:
        state.num_output_tokens += int(result.as_numpy("num_output_tokens")[0])
    if "num_input_tokens" in outputs:
        state.num_input_tokens = int(result.as_numpy("num_input_tokens")[0])
    if "finish_reason" in outputs:
        state.finish_reason = result.as_numpy("finish_reason")[0].decode()
    if result.get_response().parameters.get("triton_final_response").bool_param:
        state.done.set()


def _grpc_generate(server, prompt, params, stream=True, timeout=120, **flags) -> StreamResult:
    import tritonclient.grpc as grpcclient

    result = StreamResult()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(_collect, result))
    client.async_stream_infer("llm", _inputs(prompt, params, stream, **flags), enable_empty_final_response=True)
    assert result.done.wait(timeout), f"no final response: {result.errors}"
    client.stop_stream()
    client.close()
    return result


def test_grpc_stream_equals_non_stream_equals_engine(triton_server, reference_llm):
    prompt = "The three largest cities in Europe are"
    params = {"temperature": "0", "max_tokens": "24"}  # strings, as Triton clients send them
    streamed = _grpc_generate(triton_server, prompt, params, stream=True, return_finish_reason=True)
    whole = _grpc_generate(triton_server, prompt, params, stream=False, exclude_input_in_output=True)
    with_prompt = _grpc_generate(triton_server, prompt, params, stream=False)
    [expected] = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))
    assert not streamed.errors and not whole.errors
    assert len(streamed.texts) > 3  # really streamed, one response per delta
    assert "".join(streamed.texts) == whole.texts[0] == expected.outputs[0].text
    assert with_prompt.texts[0] == prompt + expected.outputs[0].text
    assert streamed.finish_reason == expected.outputs[0].finish_reason


def _http_post(server, path, body) -> bytes:
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


def test_http_generate_and_generate_stream_agree(triton_server):
    body = {"text_input": "Three primary colours are", "parameters": {"temperature": 0, "max_tokens": 16}}
    whole = json.loads(_http_post(triton_server, "/v2/models/llm/generate", body))["text_output"]
    stream_body = {**body, "parameters": {**body["parameters"], "stream": True}}
    events = _http_post(triton_server, "/v2/models/llm/generate_stream", stream_body).decode()
    chunks = [json.loads(line[len("data: "):]) for line in events.splitlines() if line.startswith("data: ")]
    assert len(chunks) > 3
    assert whole == body["text_input"] + "".join(c["text_output"] for c in chunks)


def test_eight_concurrent_streams(triton_server, reference_llm):
    cases = [
        ("Tell me a fact about the moon.", {"temperature": 0, "max_tokens": 20}),
        ("Write a haiku about rain.", {"temperature": 0.8, "seed": 11, "max_tokens": 24}),
        ("List three animals:", {"temperature": 0, "max_tokens": 12, "stop": ["\n\n"]}),
        ("What is 12 * 12?", {"temperature": 0.7, "top_p": 0.9, "seed": 3, "max_tokens": 16}),
        ("Name a programming language.", {"temperature": 0, "max_tokens": 8, "ignore_eos": True}),
        ("Describe a forest.", {"temperature": 1.0, "top_k": 20, "seed": 5, "max_tokens": 30}),
        ("The opposite of hot is", {"temperature": 0, "max_tokens": 6, "repetition_penalty": 1.2}),
        ("Count: one, two,", {"temperature": 0.5, "min_p": 0.1, "seed": 9, "max_tokens": 10}),
    ]
    results = [None] * len(cases)

    def run(i):
        results[i] = _grpc_generate(triton_server, cases[i][0], cases[i][1], stream=True,
                                    return_num_output_tokens=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    # seeds make sampled outputs independent of the batch, so the offline engine must agree on every one
    expected = reference_llm.generate([p for p, _ in cases], [SamplingParams(**params) for _, params in cases])
    for result, reference in zip(results, expected):
        assert not result.errors
        assert "".join(result.texts) == reference.outputs[0].text
        assert result.num_output_tokens == len(reference.outputs[0].token_ids)


def test_cancelled_stream_is_aborted_and_frees_kv(triton_server):
    import tritonclient.grpc as grpcclient

    result = StreamResult()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=partial(_collect, result))
    params = {"max_tokens": 2000, "ignore_eos": True}
    client.async_stream_infer("llm", _inputs("Write an endless story.", params, True))
    deadline = time.monotonic() + 60
    while len(result.texts) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(result.texts) >= 5
    assert triton_server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v > 0) > 0
    client.stop_stream(cancel_requests=True)
    client.close()
    assert triton_server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0) == 0
    assert triton_server.wait_metric("vllm:num_requests_running", lambda v: v == 0) == 0
    deadline = time.monotonic() + 10
    while "cancelled" not in triton_server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "cancelled" in triton_server.log()
    assert len(result.texts) < 2000
    after = _grpc_generate(triton_server, "Still there?", {"temperature": 0, "max_tokens": 4})
    assert not after.errors and after.texts


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("Hello", "{not json", "not valid JSON"),
        ("Hello", '["a list"]', "must be a JSON object"),
        ("Hello", {"temperature": -1}, "temperature"),
        ("Hello", {"top_p": 2}, "top_p"),
        ("Hello", {"best_of_beams": 4}, "best_of_beams"),
        ("Hello", {"max_tokens": 0}, "max_tokens"),
        (None, {"max_tokens": 4}, "text_input"),
        ("word " * 9000, {"max_tokens": 4}, "max_model_len"),
    ],
    ids=["malformed-json", "not-an-object", "negative-temperature", "top-p", "unknown-param", "max-tokens",
         "missing-text-input", "prompt-too-long"],
)
def test_bad_input_fails_only_its_request(triton_server, prompt, params, message):
    good = {}
    thread = threading.Thread(target=lambda: good.update(r=_grpc_generate(
        triton_server, "A good request:", {"temperature": 0, "max_tokens": 16})))
    thread.start()
    bad = _grpc_generate(triton_server, prompt, params)
    thread.join(120)
    assert bad.errors and message in bad.errors[0], bad.errors
    assert not good["r"].errors and good["r"].texts
    with urllib.request.urlopen(f"http://{triton_server.http_url}/v2/models/llm/ready", timeout=5) as r:
        assert r.status == 200


def test_metrics_count_what_was_sent_and_received(triton_server):
    names = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count",
             "vllm:time_to_first_token_seconds_count"]
    triton_server.settled()
    before = {n: triton_server.metric(n) for n in names}
    before_tpot = triton_server.metric("vllm:time_per_output_token_seconds_count")
    sent_prompt = received = 0
    for i, prompt in enumerate(["Metrics test one", "Metrics test two, a little longer", "Three"]):
        r = _grpc_generate(triton_server, prompt, {"temperature": 0, "max_tokens": 5 + i}, stream=i % 2 == 0,
                           return_num_input_tokens=True, return_num_output_tokens=True)
        sent_prompt += r.num_input_tokens
        received += r.num_output_tokens
    after = {n: triton_server.wait_metric(n, lambda v, n=n: v >= before[n] + 3) for n in names}
    after["vllm:prompt_tokens_total"] = triton_server.wait_metric(
        "vllm:prompt_tokens_total", lambda v: v == before["vllm:prompt_tokens_total"] + sent_prompt)
    after["vllm:generation_tokens_total"] = triton_server.wait_metric(
        "vllm:generation_tokens_total", lambda v: v == before["vllm:generation_tokens_total"] + received)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == sent_prompt
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == received
    assert after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] == 3
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 3
    # TPOT is observed once per gap between two tokens of a sequence (vLLM's rule)
    tpot = triton_server.wait_metric("vllm:time_per_output_token_seconds_count",
                                     lambda v: v >= before_tpot + received - 3)
    assert tpot - before_tpot == received - 3
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert triton_server.metric(gauge) == 0, gauge  # all done: nothing running, waiting or holding blocks
    metrics = urllib.request.urlopen(triton_server.metrics_url, timeout=10).read().decode()
    assert 'vllm:num_requests_running{model="llm",version="1"}' in metrics  # labelled as vllm_backend labels


def test_waiting_and_prefix_cache_gauges_follow_a_known_load(triton_server):
    """20 streams on an engine of 16 sequences: 4 wait. A long prompt sent again is served from the prefix cache,
    so the hit rate (over every lookup so far) rises."""
    triton_server.wait_metric("vllm:num_requests_running", lambda v: v == 0)
    threads = [threading.Thread(target=_grpc_generate, args=(triton_server, f"Story {i}:",
                                                             {"temperature": 0, "max_tokens": 48, "ignore_eos": True}))
               for i in range(20)]
    for t in threads:
        t.start()
    assert triton_server.wait_metric("vllm:num_requests_waiting", lambda v: v == 4) == 4
    assert triton_server.metric("vllm:num_requests_running") == 16
    for t in threads:
        t.join(300)
    assert triton_server.wait_metric("vllm:num_requests_waiting", lambda v: v == 0) == 0

    long_prompt = " ".join(f"item{i}" for i in range(120))  # many full KV blocks
    assert not _grpc_generate(triton_server, long_prompt, {"temperature": 0, "max_tokens": 2}).errors
    triton_server.settled()
    before = triton_server.metric("vllm:prefix_cache_hit_rate")
    hits, queries = (triton_server.metric(f"vllm:prefix_cache_{name}_total") for name in ("hits", "queries"))
    assert not _grpc_generate(triton_server, long_prompt, {"temperature": 0, "max_tokens": 2}).errors
    assert triton_server.wait_metric("vllm:prefix_cache_hit_rate", lambda v: v > before) > before  # the repeat hit
    # vLLM's counters of the same, in tokens: the repeat's whole blocks hit, all but its last token's
    hit = triton_server.metric("vllm:prefix_cache_hits_total") - hits
    looked_up = triton_server.metric("vllm:prefix_cache_queries_total") - queries
    assert hit > 0 and hit % 16 == 0 and looked_up - 16 <= hit < looked_up, (hit, looked_up)


def _post(url: str, headers: dict | None = None, body: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_model_control_needs_the_control_key_and_the_model_stays_up(triton_server):
    """Triton's model-control API refuses a client without the control key, on HTTP and gRPC; with it, it answers."""
    import os

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from backend.triton.contract import CONTROL_KEY_ENV
    from backend.triton.launcher import CONTROL_KEY_HEADER

    base = f"http://{triton_server.http_url}/v2"
    for path in ("/repository/models/llm/unload", "/repository/models/llm/load", "/repository/index",
                 "/systemsharedmemory/region/x/register", "/trace/setting", "/logging"):
        status, text = _post(base + path)
        assert status == 403, (path, status, text)
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    for call in (lambda: client.unload_model("llm"), lambda: client.get_model_repository_index(),
                 lambda: client.update_log_settings({"log_file": "/tmp/npu-llm-owned.log"})):
        with pytest.raises(InferenceServerException, match="(?i)restricted|permission|unavailable|denied"):
            call()
    assert client.is_model_ready("llm")
    assert urllib.request.urlopen(f"{base}/models/llm/ready", timeout=10).status == 200

    status, text = _post(base + "/repository/index", {CONTROL_KEY_HEADER: os.environ[CONTROL_KEY_ENV]})
    assert status == 200 and {"name": "llm", "version": "1", "state": "READY"} in json.loads(text)


def test_profile_actions_need_the_control_key_and_engine_info_does_not(triton_server):
    """A client reaching Triton cannot start a profile (a capture writes files and slows every request) without
    the key the gateway sends; the read-only engine_info stays open."""
    import os

    from backend.triton.contract import ADMIN_PARAMETER, CONTROL_KEY_ENV, CONTROL_KEY_PARAMETER

    generate = f"http://{triton_server.http_url}/v2/models/llm/generate"
    for given in ({}, {CONTROL_KEY_PARAMETER: "a-guess"}):
        status, text = _post(generate, body={"text_input": "", "parameters": {ADMIN_PARAMETER: "start_profile",
                                                                              **given}})
        assert status == 400 and "control key" in text, (status, text)
    status, text = _post(generate, body={"text_input": "", "parameters": {ADMIN_PARAMETER: "engine_info"}})
    assert status == 200 and json.loads(json.loads(text)["text_output"])["max_model_len"] > 0

    key = {CONTROL_KEY_PARAMETER: os.environ[CONTROL_KEY_ENV]}
    for action, profiling in (("start_profile", True), ("stop_profile", False)):
        status, text = _post(generate, body={"text_input": "", "parameters": {ADMIN_PARAMETER: action, **key}})
        assert status == 200 and json.loads(json.loads(text)["text_output"])["profiling"] is profiling, text
