"""kv_transfer_config: vLLM's engine argument that connects an engine's KV cache to something outside it: the other
side of prefill/decode disaggregation (MooncakeConnectorV1, docs/disaggregation.md), or a KV pool that keeps blocks
beyond the device's memory, in host memory (OffloadingConnector) or in a Mooncake Store every instance shares
(MooncakeStoreConnector, docs/kv-pool.md). Pydantic only, no torch: the config and the CLI check it without loading
the engine."""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# vLLM's MooncakeStoreConnector, under vllm-ascend's two names for it as well
STORE_CONNECTORS = ("MooncakeStoreConnector", "AscendStoreConnector", "MooncakeConnectorStoreV1")
OFFLOADING_CONNECTOR = "OffloadingConnector"  # vLLM's CPU offload (kv_offloading_size / kv_offloading_backend)
KV_CONNECTORS = ("MooncakeConnectorV1", *STORE_CONNECTORS, OFFLOADING_CONNECTOR)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Where a Mooncake Store pool's engines read Mooncake's settings (vllm-ascend's variables): the JSON file, and the
# master's host:port, which overrides the file's
MOONCAKE_CONFIG_ENV, MOONCAKE_MASTER_ENV = "MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER"
# How long a producer keeps a finished prefill's blocks for a consumer that never pulls them (vLLM's NIXL connector
# waits 480 s; a CPU's KV cache is smaller, so the default here is shorter). kv_connector_extra_config can set it.
DEFAULT_ABORT_TIMEOUT_S = 120.0


class KVTransferConfig(BaseModel):
    """vLLM's keys. kv_port is this engine's side channel (ZMQ), where consumers fetch the KV layout and claim and
    release a prefill's blocks; the transfer engine's own port is chosen free and published there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"  # the address other engines reach this one at (side channel and transfer engine)
    kv_port: int = Field(14579, ge=1, le=65535)
    engine_id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    # abort_timeout_s: see DEFAULT_ABORT_TIMEOUT_S; other keys (vllm-ascend's "prefill"/"decode" sizes) are ignored
    # A KV pool's (OffloadingConnector: cpu_bytes_to_use or num_cpu_blocks; a store: load_async, lookup_timeout_s,
    # transfer_timeout_s, docs/kv-pool.md)
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    # vLLM's: what a KV load that fails does to its request (a pool's blocks gone, the store down): compute the
    # prompt instead, or fail the request
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    # vLLM's keys that this connector does not need; accepted so that vLLM's configs load unchanged
    kv_buffer_device: str | None = None
    kv_buffer_size: float | None = None
    kv_rank: int | None = None
    kv_parallel_size: int | None = None
    kv_connector_module_path: str | None = None

    @field_validator("kv_connector", "kv_role")
    @classmethod
    def _known(cls, value: str, info) -> str:
        known = {"kv_connector": KV_CONNECTORS, "kv_role": KV_ROLES}[info.field_name]
        if value not in known:
            raise ValueError(f"unknown {info.field_name} {value!r}; one of {', '.join(known)}")
        return value

    @field_validator("kv_connector_extra_config")
    @classmethod
    def _timeout(cls, value: dict) -> dict:
        timeout = value.get("abort_timeout_s", DEFAULT_ABORT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"kv_connector_extra_config.abort_timeout_s must be a positive number, got {timeout!r}")
        return value

    @field_validator("kv_connector_extra_config")
    @classmethod
    def _pool_sizes(cls, value: dict) -> dict:
        for key in ("cpu_bytes_to_use", "num_cpu_blocks", "lookup_timeout_s", "transfer_timeout_s"):
            size = value.get(key)
            if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0):
                raise ValueError(f"kv_connector_extra_config.{key} must be a positive number, got {size!r}")
        return value

    @model_validator(mode="after")
    def _offloading_sized(self) -> "KVTransferConfig":
        extra = self.kv_connector_extra_config
        if self.kv_connector == OFFLOADING_CONNECTOR and not ("cpu_bytes_to_use" in extra or "num_cpu_blocks" in extra):
            raise ValueError("OffloadingConnector needs its size: kv_connector_extra_config's cpu_bytes_to_use or "
                             "num_cpu_blocks (or set kv_offloading_size instead)")
        return self

    @property
    def is_pool(self) -> bool:
        """A KV pool (host memory or a shared store) rather than a peer: every request may load from it and save."""
        return self.kv_connector in STORE_CONNECTORS or self.kv_connector == OFFLOADING_CONNECTOR

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def abort_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("abort_timeout_s", DEFAULT_ABORT_TIMEOUT_S))
