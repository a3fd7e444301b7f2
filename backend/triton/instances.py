"""Data parallel behind Triton: one engine per model instance, each on its own group of devices.

config.pbtxt's instance_group count is the number of engines (model.json's data_parallel_size, which
must agree; `npu-llm serve` writes the count for you). Triton spreads requests over the instances.
Each instance learns its place from the name Triton gives it, and runs its engine on its own
tensor_parallel_size devices: with device npu:0 and TP 2, engine 0 on npu:0-1, engine 1 on npu:2-3.
"""
from __future__ import annotations

import dataclasses
import re

from backend.config import EngineConfig

_INSTANCE_GROUP = re.compile(r"instance_group\s*\[(?:[^\[\]]|\[[^\]]*\])*\]")


def instance_place(instance_name: str, model_name: str, instance_groups: list[dict]) -> tuple[int, int]:
    """(this instance's index, the model's instance count). Triton names instance k of a group "<group>_<k>",
    a group's name defaulting to "<model>_<group index>"."""
    total = sum(int(group.get("count", 1)) for group in instance_groups) or 1
    first = 0
    for g, group in enumerate(instance_groups):
        prefix = f"{group.get('name') or f'{model_name}_{g}'}_"
        suffix = instance_name[len(prefix):]
        count = int(group.get("count", 1))
        if instance_name.startswith(prefix) and suffix.isdigit() and int(suffix) < count:
            return first + int(suffix), total
        first += count
    if total == 1:
        return 0, 1
    raise ValueError(f"instance {instance_name!r} is not one of model {model_name!r}'s instance groups")


def engine_config(config: EngineConfig, index: int, device_type: str) -> EngineConfig:
    """Engine `index`'s config: its own tensor_parallel_size devices after the first one config.device names.
    On the CPU every engine runs on the cpu (sharing its cores). With kv_transfer_config, each engine is a transfer
    endpoint of its own: side channel on kv_port + index, engine_id suffixed "-index" (as vllm-ascend offsets its
    ports by data-parallel rank). A KV pool's instances share it, as they are."""
    if config.kv_transfer_config is not None and not config.kv_transfer.is_pool and index > 0:
        transfer = config.kv_transfer_config
        config = dataclasses.replace(config, kv_transfer_config={
            **transfer, "kv_port": transfer["kv_port"] + index, "engine_id": f"{transfer['engine_id']}-{index}"})
    if device_type == "cpu":
        return config
    _, _, first = config.device.partition(":")
    return dataclasses.replace(config, device=f"{device_type}:{int(first or 0) + index * config.tensor_parallel_size}")


def with_instance_count(config_pbtxt: str, count: int) -> str:
    """config.pbtxt with `count` instances (one instance group, on the CPU: each engine owns its devices)."""
    group = f"instance_group [\n  {{ count: {count}, kind: KIND_CPU }}\n]"
    if _INSTANCE_GROUP.search(config_pbtxt):
        return _INSTANCE_GROUP.sub(group, config_pbtxt, count=1)
    return f"{config_pbtxt.rstrip()}\n\n{group}\n"
