"""`1/model.json` as vllm_backend users write it: vLLM's engine-argument names, mapped onto EngineConfig.

Most names are the same in both (model, tokenizer, dtype, max_model_len, max_num_seqs, block_size,
gpu_memory_utilization, enforce_eager, enable_prefix_caching, ...). The rest: a key we honour differently
is mapped, a key with no effect here is accepted, and a value we cannot honour fails the load, named.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from backend.config import EngineConfig

# vLLM keys that change nothing here: what they switch off is off in npu-llm anyway.
NO_EFFECT = {
    "disable_log_requests": "npu-llm never logs request contents",
    "enable_log_requests": "npu-llm never logs request contents",
    "trust_remote_code": "only npu-llm's built-in architectures run; no code from the checkpoint is executed",
    "swap_space": "preempted requests are recomputed, never swapped",
    "disable_custom_all_reduce": "tensor parallelism all-reduces with torch.distributed's own collectives",
}
# vLLM keys honoured only at one value (the one that is npu-llm's behaviour).
ONLY = {
    "pipeline_parallel_size": 1,
    "kv_cache_dtype": "auto",
    "load_format": "auto",
}


# vLLM's aliases for dtypes that EngineConfig spells out.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16"}


@dataclass
class ModelJson:
    config: EngineConfig
    disable_log_stats: bool = False  # vLLM's switch for the engine's metrics (vllm_backend honours it too)
    # engines, one per Triton model instance, each on its own tensor_parallel_size devices (docs/parallelism.md)
    data_parallel_size: int = 1

    @property
    def layout(self) -> str:
        """What the model runs as, e.g. "2 engines x TP 4" (8 devices)."""
        engines = f"{self.data_parallel_size} engine{'s' if self.data_parallel_size > 1 else ''}"
        return f"{engines} x TP {self.config.tensor_parallel_size}"


def parse_model_json(values: dict) -> ModelJson:
    """EngineConfig from model.json; ValueError naming every key or value that cannot be honoured."""
    ours = {f.name for f in fields(EngineConfig)}
    engine_args, problems = {}, []
    for key, value in values.items():
        if key == "enable_lora" and isinstance(value, str):  # vllm_backend's samples write "true"
            if value.lower() not in ("true", "false"):
                problems.append(f"enable_lora={value!r} (true or false)")
            engine_args[key] = value.lower() == "true"
        elif key in ours:
            engine_args[key] = DTYPE_ALIASES.get(value, value) if key == "dtype" else value
        elif key in ONLY:
            if value != ONLY[key]:
                problems.append(f"{key}={value!r} (npu-llm supports only {ONLY[key]!r})")
        elif key == "disable_log_stats":
            if not isinstance(value, bool):
                problems.append(f"disable_log_stats={value!r} (true or false)")
        elif key == "data_parallel_size":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"data_parallel_size={value!r} (a positive integer)")
        elif key not in NO_EFFECT:
            problems.append(f"{key} (unknown)")
    if problems:
        accepted = sorted(ours | set(ONLY) | set(NO_EFFECT) | {"disable_log_stats", "data_parallel_size"})
        raise ValueError(f"model.json: cannot honour {', '.join(problems)}; accepted keys: {', '.join(accepted)}")
    return ModelJson(EngineConfig.from_dict(engine_args), values.get("disable_log_stats", False),
                     values.get("data_parallel_size", 1))
