"""model.json as vllm_backend users write it: vLLM's engine-argument names load; what can't be honoured is named."""
from __future__ import annotations

import json

import pytest

from backend.triton.instances import engine_config, instance_place, with_instance_count
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
    # vllm_backend reads its enable_lora switch as a string too (its samples write "true")
    for value, enabled in ((True, True), ("true", True), ("True", True), ("false", False), (False, False)):
        assert parse_model_json({"model": "m", "enable_lora": value}).config.enable_lora is enabled
    with pytest.raises(ValueError, match="enable_lora='yes'"):
        parse_model_json({"model": "m", "enable_lora": "yes"})


def test_what_cannot_be_honoured_fails_the_load_by_name():
    with pytest.raises(ValueError) as error:
        parse_model_json({"model": "m", "pipeline_parallel_size": 2, "kv_cache_dtype": "fp8", "enable_sleep_mode": True})
    message = str(error.value)
    assert "pipeline_parallel_size=2" in message and "kv_cache_dtype='fp8'" in message
    assert "enable_sleep_mode (unknown)" in message
    assert "accepted keys:" in message and "pipeline_parallel_size" in message.split("accepted keys:")[1]
    with pytest.raises(ValueError, match="disable_log_stats='false'"):  # a string is not a switch
        parse_model_json({"model": "m", "disable_log_stats": "false"})
    with pytest.raises(ValueError, match="max_num_seqs"):  # our own checks still apply
        parse_model_json({"model": "m", "max_num_seqs": 0})
    with pytest.raises(ValueError, match="speculative_config.*method 'suffix': must be one of ngram, draft_model"):
        parse_model_json({"model": "m", "speculative_config": {"method": "suffix", "num_speculative_tokens": 3}})


def test_data_parallel_engines_and_their_instances():
    """data_parallel_size engines, one per Triton instance, each on its own tensor_parallel_size devices."""
    parsed = parse_model_json({"model": "m", "data_parallel_size": 2, "tensor_parallel_size": 4, "device": "npu:0"})
    assert parsed.data_parallel_size == 2 and parsed.layout == "2 engines x TP 4"
    for bad in (0, "2", True):
        with pytest.raises(ValueError, match=f"data_parallel_size={bad!r}"):
            parse_model_json({"model": "m", "data_parallel_size": bad})
    # Triton's instance names: "<group>_<k>", a group named "<model>_<group index>" unless it has a name
    groups = [{"count": 2, "kind": "KIND_CPU"}, {"name": "spare", "count": 1}]
    assert [instance_place(n, "llm", groups) for n in ("llm_0_0", "llm_0_1", "spare_0")] == [(0, 3), (1, 3), (2, 3)]
    with pytest.raises(ValueError, match="llm_0_2"):
        instance_place("llm_0_2", "llm", groups)
    assert [engine_config(parsed.config, i, "npu").device for i in (0, 1)] == ["npu:0", "npu:4"]
    assert engine_config(parsed.config, 1, "cpu").device == "npu:0"  # (cpu: every engine on the cpu)
    # `npu-llm serve` writes the count into config.pbtxt's instance group
    config = 'name: "llm"\ninstance_group [\n  { count: 1, kind: KIND_GPU, gpus: [0] }\n]\nparameters: {}\n'
    assert with_instance_count(config, 3) == ('name: "llm"\ninstance_group [\n  { count: 3, kind: KIND_CPU }\n]\n'
                                              'parameters: {}\n')
    assert "count: 2" in with_instance_count('name: "llm"\n', 2)


def test_serve_writes_the_engine_count_into_its_copy_of_the_repository(tmp_path):
    from backend.triton.launcher import run_copy

    repository = tmp_path / "repository"
    (repository / "llm" / "1").mkdir(parents=True)
    (repository / "README.md").write_text("a file beside the models")
    (repository / "llm" / "config.pbtxt").write_text('name: "llm"\ninstance_group [ { count: 1, kind: KIND_CPU } ]\n')
    (repository / "llm" / "1" / "model.json").write_text('{"model": "m"}')
    copy = run_copy(repository, tmp_path / "work", {"data_parallel_size": 2})
    assert "count: 2" in (copy / "llm" / "config.pbtxt").read_text()
    assert json.loads((copy / "llm" / "1" / "model.json").read_text()) == {"model": "m", "data_parallel_size": 2}
    assert (copy / "README.md").read_text() == "a file beside the models"
    assert "count: 1" in (repository / "llm" / "config.pbtxt").read_text()  # the user's files are untouched
