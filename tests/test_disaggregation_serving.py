"""Disaggregated serving through real processes: two prefill Tritons (kv_producer engines), two decode Tritons
(kv_consumer) and the gateway as their proxy (2P2D), the KV moved by Mooncake's transfer engine. Greedy answers in
fp32 are the colocated engine's; every KV block returns to its pool; the failures of either side stay confined.

The tests share the servers and run in order: the last ones kill a producer, then the consumers."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from backend.engine.sampling_params import SamplingParams
from backend.models.registry import DEFAULT_MODEL
from tests.conftest import (GATEWAY_API_KEY, TRITON_ENGINE_ARGS, free_port, generate_through_triton,
                            served_by_triton, start_gateway)

pytestmark = pytest.mark.slow

MODEL = DEFAULT_MODEL
HEADERS = {"Authorization": f"Bearer {GATEWAY_API_KEY}"}
ABORT_TIMEOUT_S = 4  # the producers free unclaimed blocks after this


def transfer_config(role: str, engine_id: str) -> dict:
    return {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": free_port(), "engine_id": engine_id,
            "kv_connector_extra_config": {"abort_timeout_s": ABORT_TIMEOUT_S}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(prefill servers, decode servers, the proxy gateway's URL, a plain gateway on the first decode server that
    lets a client's kv_transfer_params through)."""
    logs = tmp_path_factory.mktemp("disaggregated")
    with contextlib.ExitStack() as stack:
        configs = [transfer_config("kv_producer", f"prefill-{i}") for i in range(2)]
        prefill = [stack.enter_context(served_by_triton({**TRITON_ENGINE_ARGS, "kv_transfer_config": config},
                                                        logs / f"prefill-{i}.log")) for i, config in enumerate(configs)]
        for server, config in zip(prefill, configs):
            server.kv_port = config["kv_port"]  # (its side channel)
        decode = [stack.enter_context(served_by_triton(
            {**TRITON_ENGINE_ARGS, "kv_transfer_config": transfer_config("kv_consumer", f"decode-{i}")},
            logs / f"decode-{i}.log")) for i in range(2)]
        ports = free_port(), free_port()
        gateways = [
            start_gateway(decode[0].grpc_url, ports[0], logs / "proxy.log",
                          extra_args=("--prefill", *(p.grpc_url for p in prefill),
                                      "--decode", *(d.grpc_url for d in decode))),
            start_gateway(decode[0].grpc_url, ports[1], logs / "gateway.log",
                          extra_args=("--allow-kv-transfer-params",)),
        ]
        for process in gateways:
            stack.callback(process.wait, 15)
            stack.callback(process.terminate)
        yield prefill, decode, f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"


def complete(gateway: str, prompt: str, max_tokens: int = 24, **extra) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/completions", headers=HEADERS, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})


def expected(reference_llm, prompt: str, max_tokens: int = 24) -> str:
    [output] = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    return output.outputs[0].text


def all_blocks_free(*servers) -> None:
    for server in servers:
        assert server.wait_metric("npu_llm:kv_transfer_requests", lambda v: v == 0, timeout=ABORT_TIMEOUT_S + 10) == 0
        assert server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=10) == 0


SHARED = "Here is a long and detailed briefing about the history of the northern railway. " * 6
PROMPTS = [
    "The capital of France is",
    "Write a long story about a dragon who learned to read. " * 5,  # several blocks
    SHARED + "Summarize it in one line.",
    SHARED + "Which stations are named in it?",  # (its shared blocks may be in a decode server's cache by then)
    "List three prime numbers:",
    "Translate to French: good morning, my friend.",
]


def pulls(servers) -> float:
    return sum(server.metric("npu_llm:kv_transfer_pulls_total") for server in servers)


def test_2p2d_answers_equal_a_colocated_engine(stack, reference_llm):
    prefill, decode, proxy, _ = stack
    pulled = pulls(decode)
    decoded = [d.metric("vllm:e2e_request_latency_seconds_count") for d in decode]
    prefilled = [p.metric("vllm:e2e_request_latency_seconds_count") for p in prefill]  # (requests served)
    for prompt in PROMPTS:
        response = complete(proxy, prompt)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected(reference_llm, prompt), prompt
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 16,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{proxy}/v1/chat/completions", json=chat, headers=HEADERS, timeout=120) as response:
        streamed = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                           for line in response.iter_lines() if line.startswith("data: {"))
    [colocated] = reference_llm.chat(chat["messages"], SamplingParams(temperature=0, max_tokens=16))
    assert streamed == colocated.outputs[0].text
    requests = len(PROMPTS) + 1
    # every prefill on a producer, every decode on a consumer (each server had some: picked by load, in turn), one
    # generated token each on the producers, every decode's prompt pulled
    for server in (*prefill, *decode):
        server.settled()
    for servers, before in ((prefill, prefilled), (decode, decoded)):
        served = [s.metric("vllm:e2e_request_latency_seconds_count") - b for s, b in zip(servers, before)]
        assert sum(served) == requests and all(n > 0 for n in served), served
    for server in prefill:
        assert server.metric("vllm:generation_tokens_total") == server.metric("vllm:e2e_request_latency_seconds_count")
    assert pulls(decode) - pulled == requests
    for server in decode:
        assert server.metric("npu_llm:kv_transfer_bytes_total") > 0
        assert server.metric("npu_llm:kv_transfer_failures_total") == 0
    all_blocks_free(*prefill, *decode)


def test_the_ui_server_panel_shows_both_roles(stack):
    from ui.server_metrics import ServerMetrics

    prefill, decode, _, _ = stack
    panel, _, _ = ServerMetrics([d.metrics_url for d in decode], [p.metrics_url for p in prefill]).refresh()
    assert "**Decode** **KV cache**" in panel and "**Prefill** 2 server(s): **KV cache**" in panel, panel
    pulled = float(panel.split("**KV pulled** ")[1].split(" MiB")[0])
    assert pulled == round(sum(d.metric("npu_llm:kv_transfer_bytes_total") for d in decode) / 2**20, 1) > 0


def test_disconnect_storm_leaves_no_block_held(stack):
    """Clients leaving at every moment: during the prefill, between prefill and decode, mid-stream."""
    prefill, decode, proxy, _ = stack

    def leave_after(chunks: int, timeout: float = 60) -> None:
        """Read `chunks` lines of the stream, or give up after `timeout` s (before the answer starts: during the
        prefill, or between prefill and decode)."""
        body = {"model": MODEL, "prompt": f"Tell story number {chunks} about a river. " * 4, "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{proxy}/v1/completions", json=body, headers=HEADERS,
                              timeout=timeout) as response:
                for seen, _ in enumerate(response.iter_lines()):
                    if seen >= chunks:
                        return
        except httpx.TimeoutException:
            pass

    leaving = [(n, 60) for n in (0, 1, 1, 2, 3, 5, 8, 13, 21)] + [(0, t) for t in (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda args: leave_after(*args), leaving))
    all_blocks_free(*prefill, *decode)
    assert complete(proxy, "Still there?", 4).status_code == 200


def test_client_kv_transfer_params_are_dropped_unless_allowed(stack, reference_llm):
    prefill, decode, proxy, direct = stack
    junk = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": "someone-else",
            "remote_block_ids": [0, 1, 2], "remote_host": "127.0.0.1", "remote_port": 1}
    # the proxy drops a client's params: the answer is the usual one
    response = complete(proxy, "The capital of France is", kv_transfer_params=junk)
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == expected(reference_llm, "The capital of France is")
    # a gateway told to let them through: the engine refuses params no producer of the deployment signed, and what
    # signed ones name wrongly (this test holds the deployment's key), as a 400, and holds nothing
    prompt = "One two three four"
    blocks = len(reference_llm.get_tokenizer().encode(prompt)) // 16 + 1
    for params, message in [
        ({**junk, "remote_block_ids": list(range(blocks)), "remote_port": prefill[0].kv_port},
         "not signed by a producer of this deployment"),
        (_signed({**junk, "remote_block_ids": [0] * (blocks + 1)}), "remote_block_ids has"),
        (_signed({**junk, "remote_block_ids": list(range(blocks)), "remote_port": prefill[0].kv_port}),
         "holds no prefill of request 'someone-else'"),
        (_signed({**junk, "remote_block_ids": list(range(blocks)), "remote_engine_id": "prefill-7",
                  "remote_port": prefill[0].kv_port}), "prefill-7"),
        ({"do_remote_prefill": True}, "need remote_engine_id"),
    ]:
        response = complete(direct, prompt, 4, kv_transfer_params=params)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    all_blocks_free(*prefill, *decode)


def test_a_request_the_decode_server_refuses_frees_its_prefill_at_once(stack):
    """The proxy prefills with max_tokens 1; the decode server then refuses prompt + max_tokens beyond max_model_len
    and releases the prefill it would have pulled: the producers hold nothing a second later, not at their timeout."""
    prefill, decode, proxy, _ = stack
    for _ in range(3):
        response = complete(proxy, "Count from one to ten: one, two,", max_tokens=10**6)
        assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"], response.text
    assert sum(p.wait_metric("npu_llm:kv_transfer_requests", lambda v: v == 0, timeout=1.5) for p in prefill) == 0
    all_blocks_free(*prefill, *decode)


def _signed(params: dict) -> dict:
    """params as a producer of the stack signs them (the servers were started with this process's control key)."""
    from backend.config.control_key import control_key
    from backend.engine.kv_transfer.params import KVTransferParams

    return KVTransferParams.model_validate(params).signed_with(control_key()).model_dump()


def _kill(server) -> None:
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


def test_a_killed_producer_costs_no_request(stack, reference_llm):
    prefill, (decode, *_), proxy, direct = stack  # (direct: a gateway on the first decode server)
    prompt = "Write a long story about a dragon who learned to read. " * 3
    # a prefill on producer 1 that the consumer has not pulled when producer 1 dies
    # (Triton's generate endpoint takes scalar parameters: the params as JSON text)
    held = generate_through_triton(prefill[1], {"text_input": prompt, "max_tokens": 1,
                                                "kv_transfer_params": json.dumps({"do_remote_decode": True})})
    params = json.loads(held["kv_transfer_params"])
    decode.settled()
    failures = decode.metric("npu_llm:kv_transfer_failures_total")
    _kill(prefill[1])
    # its pull fails: the decode server computes the prompt itself
    response = complete(direct, prompt, kv_transfer_params=params)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected(reference_llm, prompt)
    assert decode.wait_metric("npu_llm:kv_transfer_failures_total", lambda v: v > failures) == failures + 1
    # new requests go to the producer left
    for prompt in PROMPTS[:3]:
        response = complete(proxy, prompt)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected(reference_llm, prompt)
    all_blocks_free(prefill[0], *stack[1])


def test_killed_consumers_mean_the_next_one_then_503_and_the_producer_frees_its_blocks(stack, reference_llm):
    prefill, decode, proxy, _ = stack
    _kill(decode[1])
    # every request is answered, the ones picked for the dead server by the one left (which prefills them itself)
    for prompt in PROMPTS[:4]:
        response = complete(proxy, prompt)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected(reference_llm, prompt)
    prefill[0].settled()
    expired = prefill[0].metric("npu_llm:kv_transfer_expired_total")
    _kill(decode[0])
    response = complete(proxy, "The capital of France is")
    assert response.status_code == 503, response.text
    assert httpx.get(f"{proxy}/health", timeout=30).status_code == 503
    # the prefill it made for that request is freed by the timeout
    assert prefill[0].wait_metric("npu_llm:kv_transfer_expired_total", lambda v: v > expired,
                                  timeout=ABORT_TIMEOUT_S + 10) >= expired + 1
    all_blocks_free(prefill[0])
