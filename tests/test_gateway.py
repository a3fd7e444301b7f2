"""The OpenAI-compatible gateway, in front of a real tritonserver, through the official openai SDK and raw HTTP."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from backend import SamplingParams
from backend.engine.tokenizer import chat_prompt_ids
from backend.models.registry import DEFAULT_MODEL
from tests.conftest import GATEWAY_API_KEY, free_port, start_gateway

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL  # the name the gateway serves it under
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name two planets."}]


@pytest.fixture(scope="module")
def client(gateway):
    from openai import OpenAI

    return OpenAI(base_url=f"{gateway}/v1", api_key=GATEWAY_API_KEY, max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_stream_equals_non_stream_and_engine(client, reference_llm):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [expected] = reference_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24))
    assert streamed == whole.choices[0].message.content == expected.outputs[0].text
    prompt_ids = chat_prompt_ids(reference_llm.get_tokenizer(), MESSAGES)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.choices[0].finish_reason == chunks[-2].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_text_completion_stream_and_echo(client, reference_llm):
    prompt = "The four seasons are"
    whole = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=16, stream=True) if c.choices)
    [expected] = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))
    assert whole.choices[0].text == streamed == expected.outputs[0].text
    echoed = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16, echo=True)
    assert echoed.choices[0].text == prompt + expected.outputs[0].text
    ids = reference_llm.get_tokenizer().encode(prompt)
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=16)
    assert by_ids.choices[0].text == expected.outputs[0].text


def _whole_json(text: str) -> bool:
    if text == "[DONE]":
        return True
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def test_a_reader_that_splits_events_on_blank_lf_lines_gets_every_token_and_the_usage(gateway, reference_llm):
    """vLLM's benchmark client reads a stream as OpenAI's and vLLM's servers frame it: each read stripped, events
    split on "\n\n", a read's last event taken when it is whole JSON. Against our gateway it must see every token
    and the final usage."""
    body = {"model": MODEL, "prompt": "The four seasons are", "temperature": 0, "max_tokens": 32, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events, buffer = [], ""
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {GATEWAY_API_KEY}"}) as response:
        for chunk in response.iter_text():
            buffer += chunk.strip()
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                events.append(event.removeprefix("data: "))
            if buffer.startswith("data: ") and _whole_json(buffer.removeprefix("data: ")):
                events.append(buffer.removeprefix("data: "))
                buffer = ""
    assert buffer == "" and events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    [expected] = reference_llm.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected.outputs[0].text
    assert chunks[-1]["usage"]["completion_tokens"] == 32


def test_n_and_sampling_fields(client):
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, temperature=1.0, seed=7,
                                            max_completion_tokens=12, presence_penalty=0.5, frequency_penalty=0.2,
                                            top_p=0.95, stop=["\n\n"])
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert all(c.message.content for c in result.choices)
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, temperature=1.0, seed=7,
                                           max_completion_tokens=12, presence_penalty=0.5, frequency_penalty=0.2,
                                           top_p=0.95, stop=["\n\n"])
    assert [c.message.content for c in again.choices] == [c.message.content for c in result.choices]


def test_n_streamed_on_both_endpoints_gives_distinct_complete_choices(client):
    texts, finished = {}, {}
    for c in client.completions.create(model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=5,
                                       max_tokens=12, stream=True):
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finished[choice.index] = choice.finish_reason or finished.get(choice.index)
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=5,
                                      max_tokens=12)
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]  # seeded: the same three samples
    assert len(set(texts.values())) == 3 and all(finished[i] in ("stop", "length") for i in range(3))

    roles, contents, reasons = {}, {}, {}
    for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, temperature=1.0, seed=9,
                                            max_tokens=12, stream=True):
        for choice in c.choices:
            roles[choice.index] = choice.delta.role or roles.get(choice.index)
            contents[choice.index] = contents.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert roles == {0: "assistant", 1: "assistant"} and set(reasons.values()) <= {"stop", "length"}
    assert contents[0] and contents[1] and contents[0] != contents[1]


def _engine_logprobs(reference_llm, prompt, k: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Per generated token: its text, its logprob and the top k (text, logprob), from the engine itself."""
    [out] = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=k))
    rows = []
    for position in out.outputs[0].logprobs:
        sampled = next(iter(position.values()))
        top = sorted(position.values(), key=lambda lp: lp.rank)[:k]
        rows.append((sampled.decoded_token, sampled.logprob, [(lp.decoded_token, lp.logprob) for lp in top]))
    return rows


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_equal_the_engines(client, reference_llm, stream):
    expected = _engine_logprobs(reference_llm, {"prompt_token_ids": chat_prompt_ids(reference_llm.get_tokenizer(),
                                                                                       MESSAGES)}, 3)
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    if stream:
        content = [t for c in client.chat.completions.create(stream=True, **kwargs) if c.choices and c.choices[0].logprobs
                   for t in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    got = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in content]
    assert [g[0] for g in got] == [e[0] for e in expected]
    for (_, logprob, top), (_, want, want_top) in zip(got, expected):
        assert logprob == pytest.approx(want, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in want_top]  # the same alternatives, most likely first
        assert [lp for _, lp in top] == pytest.approx([lp for _, lp in want_top], abs=1e-4)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_equal_the_engines(client, reference_llm, stream):
    prompt = "The rivers of Europe include"
    expected = _engine_logprobs(reference_llm, prompt, 2)
    kwargs = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, logprobs=2)
    if stream:
        parts = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)
                 if c.choices and c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        values = [v for p in parts for v in p.token_logprobs]
        tops = [t for p in parts for t in p.top_logprobs]
    else:
        logprobs = client.completions.create(**kwargs).choices[0].logprobs
        tokens, values, tops = logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs
    assert tokens == [e[0] for e in expected]
    assert values == pytest.approx([e[1] for e in expected], abs=1e-4)
    for top, (token, logprob, want_top) in zip(tops, expected):
        assert top == pytest.approx({token: logprob, **dict(want_top)}, abs=1e-4)  # the sampled token and the top 2


def _cancellations(triton_server) -> int:
    return len(re.findall(r"\[npu-llm\] request \S+ cancelled", triton_server.log()))


def test_disconnect_mid_stream_frees_the_request(gateway, triton_server):
    """A client that leaves mid-stream: the request was running, then is cancelled in Triton and the engine, and its
    KV blocks are back in the pool; the tokens it did generate are counted."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 1500, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {GATEWAY_API_KEY}"}
    cancelled_before = _cancellations(triton_server)
    generated_before = triton_server.metric("vllm:generation_tokens_total")
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        # running when the client leaves (the gauges refresh every half second)
                        assert triton_server.wait_metric("vllm:num_requests_running", lambda v: v == 1) == 1
                        assert triton_server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v > 0) > 0
                        break  # leaving the lines closes the connection
    assert triton_server.wait_metric("vllm:num_requests_running", lambda v: v == 0, timeout=15) == 0
    assert triton_server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=15) == 0
    deadline = time.monotonic() + 10
    while _cancellations(triton_server) == cancelled_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _cancellations(triton_server) == cancelled_before + 1  # the engine was told, not left to finish
    generated = triton_server.metric("vllm:generation_tokens_total") - generated_before
    assert 2 <= generated < 1500  # it generated, and stopped long before max_tokens
    ok = httpx.post(f"{gateway}/v1/completions", headers=headers, timeout=60,
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD_REQUESTS = [
    ("bad-json", "/v1/chat/completions", b"{not json", {}, 400, None),
    ("body-not-object", "/v1/chat/completions", b"[1, 2]", {}, 400, None),
    ("temperature-negative", "/v1/chat/completions", {**GOOD_CHAT, "temperature": -1}, {}, 400, "temperature"),
    ("temperature-type", "/v1/chat/completions", {**GOOD_CHAT, "temperature": "hot"}, {}, 400, "temperature"),
    ("top-p-zero", "/v1/chat/completions", {**GOOD_CHAT, "top_p": 0}, {}, 400, "top_p"),
    ("max-tokens-zero", "/v1/chat/completions", {**GOOD_CHAT, "max_tokens": 0}, {}, 400, "max_tokens"),
    ("n-zero", "/v1/chat/completions", {**GOOD_CHAT, "n": 0}, {}, 400, "n"),
    ("empty-messages", "/v1/chat/completions", {**GOOD_CHAT, "messages": []}, {}, 400, "messages"),
    ("unknown-role", "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, {}, 400,
     "messages.0.role"),
    ("messages-type", "/v1/chat/completions", {**GOOD_CHAT, "messages": "hello"}, {}, 400, "messages"),
    ("missing-model", "/v1/chat/completions", {"messages": GOOD_CHAT["messages"]}, {}, 400, "model"),
    ("unknown-model", "/v1/chat/completions", {**GOOD_CHAT, "model": "gpt-9"}, {}, 404, "model"),
    ("stop-type", "/v1/chat/completions", {**GOOD_CHAT, "stop": 5}, {}, 400, "stop"),
    ("prompt-over-max-model-len", "/v1/completions", {"model": MODEL, "prompt": "word " * 9000, "max_tokens": 2}, {},
     400, None),
    ("empty-prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, {}, 400, "prompt"),
    ("echo-type", "/v1/completions", {"model": MODEL, "prompt": "x", "echo": "loud"}, {}, 400, "echo"),
    ("wrong-api-key", "/v1/chat/completions", GOOD_CHAT, {"Authorization": "Bearer nope"}, 401, None),
    ("no-api-key", "/v1/chat/completions", GOOD_CHAT, {"Authorization": None}, 401, None),
    ("oversize-body", "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": "x" * 300000}]},
     {}, 413, None),
]


@pytest.mark.parametrize("path, body, headers, status, param", [b[1:] for b in BAD_REQUESTS],
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(gateway, path, body, headers, status, param):
    all_headers = {"Authorization": f"Bearer {GATEWAY_API_KEY}", "Content-Type": "application/json", **headers}
    all_headers = {k: v for k, v in all_headers.items() if v is not None}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{gateway}{path}", content=data, headers=all_headers, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == ("model_not_found" if status == 404 and param == "model" else status)  # (OpenAI's)
    if param is not None:
        assert error["param"] == param and param.split(".")[0] in error["message"]
    good = httpx.post(f"{gateway}/v1/chat/completions", json=GOOD_CHAT, timeout=60,
                      headers={"Authorization": f"Bearer {GATEWAY_API_KEY}"})
    assert good.status_code == 200


def test_profile_routes_capture_a_served_run(gateway, client):
    auth = {"Authorization": f"Bearer {GATEWAY_API_KEY}"}
    assert httpx.post(f"{gateway}/start_profile", timeout=30).status_code == 401  # admin routes need the key
    early = httpx.post(f"{gateway}/stop_profile", headers=auth, timeout=30)
    assert early.status_code == 400 and "no profile capture" in early.json()["error"]["message"]
    assert httpx.post(f"{gateway}/start_profile", headers=auth, timeout=30).json() == {"profiling": True}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
    stopped = httpx.post(f"{gateway}/stop_profile", headers=auth, timeout=120).json()
    assert stopped["profiling"] is False and stopped["num_steps"] >= 8
    assert Path(stopped["trace_path"]).is_file() and "decode attention" in stopped["table"]
    assert stopped["breakdown"]["decode-only"]["steps"]["count"] >= 7
    assert httpx.post(f"{gateway}/start_profile", headers=auth, timeout=30).status_code == 200  # and again
    assert httpx.post(f"{gateway}/stop_profile", headers=auth, timeout=120).status_code == 200


def test_gateway_metrics(gateway):
    assert httpx.get(f"{gateway}/metrics").status_code == 401  # behind the API key, like every route but /health
    text = httpx.get(f"{gateway}/metrics", headers={"Authorization": f"Bearer {GATEWAY_API_KEY}"}).text
    assert 'npu_llm_gateway_requests_total{endpoint="chat",status="200"}' in text
    assert "npu_llm_gateway_request_duration_seconds_bucket" in text


def test_triton_down_gives_503_quickly(tmp_path):
    port = free_port()
    dead = f"localhost:{free_port()}"  # nothing listens there
    process = start_gateway(dead, port, tmp_path / "gateway.log", api_key=None)
    try:
        start = time.monotonic()
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        completion = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                                json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        elapsed = time.monotonic() - start
        assert health.status_code == 503 and completion.status_code == 503
        assert completion.json()["error"]["code"] == 503
        assert elapsed < 10
        assert dead not in health.text and dead in (tmp_path / "gateway.log").read_text()  # the open route names no address
    finally:
        process.terminate()
        process.wait(15)
