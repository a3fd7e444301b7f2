"""Conformance with Triton vllm_backend's I/O contract, on the real tritonserver: every combination of the
return_* flags x logprobs in {none, 0, 2} x stream on/off, checked against the engine's own values; the
streaming echo refusal; and vLLM's metric families, checked by value under a known load.

Written from the assertions of vllm_backend's own CI (L0_additional_outputs_vllm, L0_backend_vllm
enabled_stream and metrics_test), not copied from it.
"""
from __future__ import annotations

import itertools
import json
import math
import threading
import time
import urllib.request
from functools import partial

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backend import SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "The three primary colours are"
MAX_TOKENS = 5
RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                "return_num_output_tokens")
FLAG_OUTPUT = {"return_finish_reason": "finish_reason", "return_cumulative_logprob": "cumulative_logprob",
               "return_logprobs": "logprobs", "return_num_input_tokens": "num_input_tokens",
               "return_num_output_tokens": "num_output_tokens"}


@pytest.fixture(scope="module")
def reference(reference_llm):
    """The engine's own greedy run, with 2 alternatives per token."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    [out] = reference_llm.generate(PROMPT, params)
    return out


def _infer(server, flags: dict, params: dict, stream: bool):
    """All responses of one request, each as {output name: numpy value}; and the errors."""
    return _infer_all(server, [(flags, params, stream)])[0]


def _infer_all(server, requests: list[tuple[dict, dict, bool]]) -> list[tuple[list[dict], list[str]]]:
    """Several (flags, sampling parameters, stream) requests sent at once on one gRPC stream (so the engine
    batches them); for each, its responses and errors, in order."""
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype, triton_type):
        t = grpcclient.InferInput(name, [1], triton_type)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        return t

    results = [([], []) for _ in requests]
    pending, lock, done = set(range(len(requests))), threading.Lock(), threading.Event()

    def collect(result, error):
        if error is not None:  # an error carries no id: requests that may fail are sent alone
            index = next(iter(pending))
            results[index][1].append(str(error))
        else:
            response = result.get_response()
            index = int(response.id)
            names = [o.name for o in response.outputs]
            if names:
                results[index][0].append({n: result.as_numpy(n) for n in names})
            if not response.parameters.get("triton_final_response").bool_param:
                return
        with lock:
            pending.discard(index)
            if not pending:
                done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(collect))
    for index, (flags, params, stream) in enumerate(requests):
        inputs = [tensor("text_input", PROMPT.encode(), np.object_, "BYTES"),
                  tensor("stream", stream, bool, "BOOL"),
                  tensor("sampling_parameters", json.dumps(params).encode(), np.object_, "BYTES")]
        inputs += [tensor(name, value, bool, "BOOL") for name, value in flags.items()]
        client.async_stream_infer("llm", inputs, request_id=str(index), enable_empty_final_response=True)
    assert done.wait(120), "no final response"
    client.stop_stream()
    client.close()
    return results


FLAG_SETS = [dict(zip(RETURN_FLAGS, values)) for values in itertools.product([False, True], repeat=len(RETURN_FLAGS))]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("logprobs", [None, 0, 2], ids=["no-logprobs", "logprobs-0", "logprobs-2"])
def test_every_flag_combination_answers_as_vllm_backend_does(triton_server, reference, reference_llm, stream,
                                                              logprobs):
    expected = reference.outputs[0]
    tokenizer = reference_llm.get_tokenizer()
    params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    if logprobs is not None:
        params["logprobs"] = logprobs
    answers = _infer_all(triton_server, [({**flags, "exclude_input_in_output": True}, params, stream)
                                         for flags in FLAG_SETS])
    for flags, (responses, errors) in zip(FLAG_SETS, answers):
        assert not errors, (flags, errors)
        wanted = {"text_output"} | {FLAG_OUTPUT[f] for f, on in flags.items() if on}
        assert all(set(r) == wanted for r in responses), (flags, [set(r) for r in responses])
        assert len(responses) >= (2 if stream else 1) and (stream or len(responses) == 1)
        texts = [r["text_output"][0].decode() for r in responses]
        assert "".join(texts) == expected.text

        if flags["return_finish_reason"]:
            reasons = [r["finish_reason"][0].decode() for r in responses]
            assert reasons[-1] == "length" and all(x == "None" for x in reasons[:-1]), reasons
        if flags["return_num_input_tokens"]:
            assert all(int(r["num_input_tokens"].reshape(-1)[0]) == len(reference.prompt_token_ids) for r in responses)
        counts = [int(r["num_output_tokens"][0]) for r in responses] if flags["return_num_output_tokens"] else None
        if counts is not None:
            assert sum(counts) == MAX_TOKENS and all(c >= 0 for c in counts)
        if flags["return_cumulative_logprob"]:
            cumulative = [float(r["cumulative_logprob"][0]) for r in responses]
            if logprobs is None:  # not asked for: vLLM has none, which a float tensor carries as NaN
                assert all(math.isnan(c) for c in cumulative)
            else:
                assert math.isclose(cumulative[-1], expected.cumulative_logprob, abs_tol=1e-3)
                # raw logprobs: each streamed response's new tokens lower it, greedy or not (vllm_backend's check)
                assert all(later < earlier for earlier, later in zip(cumulative, cumulative[1:]))
        if flags["return_logprobs"]:
            entries = [json.loads(r["logprobs"][0]) for r in responses]
            if logprobs is None:
                assert all(e is None for e in entries)
                continue
            positions = [p for e in entries for p in e]
            assert len(positions) == MAX_TOKENS
            if counts is not None:
                assert [len(e) for e in entries] == counts
            for position, token, reference_position in zip(positions, expected.token_ids, expected.logprobs):
                assert next(iter(position)) == str(token)  # the sampled token first, always present
                assert len(position) == (1 if logprobs == 0 else len(reference_position))
                for token_id, lp in position.items():
                    ref = reference_position[int(token_id)]
                    assert math.isclose(lp["logprob"], ref.logprob, abs_tol=1e-4)
                    assert lp["rank"] == ref.rank >= 1
                    assert lp["decoded_token"] == tokenizer.decode([int(token_id)])
                assert position[str(token)]["rank"] == 1  # greedy: the most likely token
                assert [lp["rank"] for lp in position.values()].count(1) == 1  # and it alone (vllm_backend's check)
            # vllm_backend's: the rank-1 tokens spell the text
            assert "".join(next(lp["decoded_token"] for lp in position.values() if lp["rank"] == 1)
                           for position in positions) == expected.text


def test_streaming_with_the_prompt_echoed_is_refused_as_vllm_backend_refuses_it(triton_server):
    params = {"temperature": 0, "max_tokens": 3}
    _, errors = _infer(triton_server, {"exclude_input_in_output": False}, params, stream=True)
    assert errors and "When streaming, `exclude_input_in_output` = False is not allowed." in errors[0]
    responses, errors = _infer(triton_server, {}, params, stream=True)  # not given: the prompt is simply not echoed
    assert not errors and not "".join(r["text_output"][0].decode() for r in responses).startswith(PROMPT)
    responses, errors = _infer(triton_server, {"exclude_input_in_output": False}, params, stream=False)
    assert not errors and responses[0]["text_output"][0].decode().startswith(PROMPT)


def _samples(server) -> dict[tuple, float]:
    """(name, frozenset of labels without model/version) -> value, for every vllm: sample on /metrics."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("model", "version"))
                values[(s.name, labels)] = s.value
    return values


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_vllm_metric_families_count_a_known_load(triton_server):
    triton_server.settled()
    before = _samples(triton_server)
    load = [({"max_tokens": 4, "n": 1}, 4), ({"max_tokens": 6, "n": 2}, 12), ({"max_tokens": 3, "n": 1}, 3)]
    prompt_tokens = 0
    for params, _ in load:
        responses, errors = _infer(triton_server, {"return_num_input_tokens": True},
                                   {"temperature": 0.7, "seed": 1, "ignore_eos": True, **params}, stream=False)
        assert not errors
        prompt_tokens += int(responses[0]["num_input_tokens"].reshape(-1)[0])
    generated = sum(tokens for _, tokens in load)
    deadline = time.monotonic() + 10
    while _value(_samples(triton_server), "vllm:request_params_n_count") < _value(before, "vllm:request_params_n_count") + 3:
        assert time.monotonic() < deadline, "request records not flushed"
        time.sleep(0.2)
    after = _samples(triton_server)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 4  # one per sequence
    sequences = 4
    assert delta("vllm:time_to_first_token_seconds_count") == delta("vllm:e2e_request_latency_seconds_count") == 3
    # as vLLM: one observation per gap between two tokens of a sequence
    assert delta("vllm:time_per_output_token_seconds_count") == generated - sequences
    assert delta("vllm:inter_token_latency_seconds_count") == generated - sequences  # (vLLM's current name)
    # vLLM's prefix-cache counters, in tokens, as the hit-rate gauge counts them: each admitted sequence looks its
    # prompt up; this prompt is shorter than a block (16 tokens), so no block of it is ever cached and none hits
    assert delta("vllm:prefix_cache_queries_total") == prompt_tokens // 3 * sequences
    assert prompt_tokens // 3 < 16 and delta("vllm:prefix_cache_hits_total") == 0
    assert delta("vllm:request_prompt_tokens_count") == 3 and delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_count") == 3
    assert delta("vllm:request_generation_tokens_sum") == generated
    assert delta("vllm:request_params_n_count") == 3 and delta("vllm:request_params_n_sum") == 4
    assert delta("vllm:request_params_max_tokens_sum") == 13
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 3, phase
        assert delta(f"vllm:request_{phase}_time_seconds_sum") >= 0, phase
    assert delta("vllm:request_inference_time_seconds_sum") >= delta("vllm:request_decode_time_seconds_sum")
    assert delta("vllm:iteration_tokens_total_count") >= max(tokens for _, tokens in load) // 2
    assert delta("vllm:iteration_tokens_total_sum") >= generated
    assert ("vllm:num_preemptions_total", frozenset()) in after
    info = [labels for (name, labels) in after if name == "vllm:cache_config_info"]
    assert info and dict(info[0])["block_size"] == "16" and dict(info[0])["enable_prefix_caching"] == "True"


def test_the_grafana_dashboard_queries_only_metrics_we_export(triton_server):
    """docs/grafana/npu-llm.json: every metric a query names is on Triton's /metrics, with the label it filters on."""
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parents[1] / "docs" / "grafana" / "npu-llm.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries.append(dashboard["templating"]["list"][0]["query"])
    named = {m for q in queries for m in re.findall(r"vllm:[a-z0-9_]+", q)}
    _infer(triton_server, {}, {"temperature": 0, "max_tokens": 2}, stream=False)  # every family has a sample
    exported = {name for name, _ in _samples(triton_server)}
    assert named and named <= exported, sorted(named - exported)
    text = urllib.request.urlopen(triton_server.metrics_url, timeout=5).read().decode()
    assert all('model="llm"' in line for line in text.splitlines() if line.startswith("vllm:"))
