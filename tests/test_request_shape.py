"""One request shape on the wire: the gateway builds the engine's SamplingParams, kv_transfer_params included, and
sends them as the one sampling_parameters input; Triton decodes that JSON once and the engine decodes nothing.
(The disaggregation serving tests drive such requests through a real gateway and real Tritons.)"""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend.gateway.protocol import ChatCompletionRequest
from backend.gateway.serving import Serving
from backend.triton import contract

TRANSFER = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": "r-1",
            "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 14579}


def _inputs(sampling_parameters: str) -> dict:
    return {"text_input": np.array([b"Hi"], dtype=np.object_),
            "sampling_parameters": np.array([sampling_parameters.encode()], dtype=np.object_)}


def test_the_gateway_s_params_reach_the_engine_as_built_with_one_json_decode(monkeypatch):
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.3, "max_tokens": 7,
        "stop": ["\n"], "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"},
        "kv_transfer_params": TRANSFER})
    params = Serving(tokenizer=None, allow_kv_transfer_params=True).sampling_params(request.engine_parameters(
        request.constraint()))
    assert params.kv_transfer_params.remote_block_ids == [3, 4] and params.max_tokens == 7
    wire = contract.sampling_parameters_json(params)

    decodes = []
    real_loads = json.loads
    monkeypatch.setattr(contract.json, "loads", lambda text, **kw: decodes.append(text) or real_loads(text, **kw))
    parsed = contract.parse_request(_inputs(wire), contract.request_parameters(None))
    assert parsed.params == params  # every field as the gateway built it
    assert decodes == ["{}", wire]  # Triton's request parameters, then the one input: nothing inside it again


def test_a_client_s_kv_transfer_params_are_dropped_unless_the_gateway_passes_them_on():
    parameters = {"max_tokens": 3, "kv_transfer_params": {"do_remote_prefill": True}}  # (malformed, too)
    assert Serving(tokenizer=None).sampling_params(parameters).kv_transfer_params is None


def test_kv_transfer_params_beside_the_input_are_refused_not_merged():
    with pytest.raises(ValueError, match="belong inside the sampling_parameters input"):
        contract.parse_request(_inputs('{"max_tokens": 2}'), {"kv_transfer_params": json.dumps(TRANSFER)})
    # Triton's HTTP generate endpoint: no input, the parameters are the sampling parameters (kv as JSON text)
    parsed = contract.parse_request({"text_input": np.array([b"Hi"], dtype=np.object_)},
                                    {"max_tokens": 2, "kv_transfer_params": json.dumps(TRANSFER)})
    assert parsed.params.kv_transfer_params.remote_engine_id == "prefill-0"
