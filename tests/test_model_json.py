"""model.json as vllm_backend users write it: vLLM's engine-argument names load; what can't be honoured is named."""
from __future__ import annotations

import pytest

from backend.triton.model_json import parse_model_json


def test_a_vllm_backend_model_json_loads():
    # vllm_backend's sample model.json, with the model pointed at a local folder
    parsed = parse_model_json({"model": "/models/llama", "disable_log_requests": True, "gpu_memory_utilization": 0.5,
                               "enforce_eager": True, "max_model_len": 2048, "max_num_seqs": 8, "block_size": 16,
                               "enable_prefix_caching": False, "tensor_parallel_size": 1, "trust_remote_code": True})
    config = parsed.config
    assert (config.model, config.gpu_memory_utilization, config.enforce_eager) == ("/models/llama", 0.5, True)
    assert (config.max_model_len, config.max_num_seqs, config.block_size) == (2048, 8, 16)
    assert config.enable_prefix_caching is False and parsed.disable_log_stats is False
    assert parse_model_json({"model": "m", "disable_log_stats": True}).disable_log_stats is True
    assert parse_model_json({"model": "m", "dtype": "half"}).config.dtype == "float16"  # vLLM's alias
    assert parse_model_json({"model": "m", "tensor_parallel_size": 3}).config.tensor_parallel_size == 3


def test_what_cannot_be_honoured_fails_the_load_by_name():
    with pytest.raises(ValueError) as error:
        parse_model_json({"model": "m", "pipeline_parallel_size": 2, "kv_cache_dtype": "fp8", "speculative_config": {}})
    message = str(error.value)
    assert "pipeline_parallel_size=2" in message and "kv_cache_dtype='fp8'" in message
    assert "speculative_config (unknown)" in message
    assert "accepted keys:" in message and "pipeline_parallel_size" in message.split("accepted keys:")[1]
    with pytest.raises(ValueError, match="disable_log_stats='false'"):  # a string is not a switch
        parse_model_json({"model": "m", "disable_log_stats": "false"})
    with pytest.raises(ValueError, match="max_num_seqs"):  # our own checks still apply
        parse_model_json({"model": "m", "max_num_seqs": 0})
