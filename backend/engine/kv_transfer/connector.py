"""The KV connector interface, on vLLM v1's lines: one object, two sides.

The scheduler side decides: how many of a request's tokens another engine already holds
(get_num_new_matched_tokens), what to fetch once blocks are allocated for them (update_state_after_alloc), what the
worker side must do this step (build_connector_meta), and whether a finished request's blocks wait for a consumer
(request_finished). The worker side moves the bytes: it registers the KV tensors (register_kv_caches), starts this
step's loads (start_load_kv), finishes its saves (wait_for_save) and reports which transfers ended (get_finished).

Both sides run in the engine's process (the connector needs tensor_parallel_size=1, checked at start). A pulling
connector such as Mooncake's loads whole requests between steps, so it needs no per-layer hook inside the forward
pass; a layer-wise pushing connector would add wait_for_layer_load / save_kv_layer here and a call in the model.
"""
from __future__ import annotations

import queue
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backend.config import KVTransferConfig
from backend.config.kv_transfer import OFFLOADING_CONNECTOR
from backend.engine.kv_transfer.params import KVTransferParams
from backend.engine.request import Request


@dataclass
class KVLoad:
    """One request's prompt KV to pull from a producer: its remote blocks from `first_block` on, into the local
    blocks allocated for them (the blocks before first_block came from the local prefix cache)."""

    request_id: str
    prompt_token_ids: list[int]
    local_block_ids: list[int]
    remote: KVTransferParams
    first_block: int


@dataclass
class KVConnectorMetadata:
    """What the scheduler side hands the worker side for one step."""

    loads: list[KVLoad] = field(default_factory=list)


@dataclass
class FinishedTransfers:
    """Transfers that ended since the last get_finished: producer requests whose blocks may now be freed, consumer
    requests whose KV has arrived, and consumer requests whose load failed (with why: a ValueError when the
    producer refused the claim, i.e. the request's kv_transfer_params were wrong; anything else is recomputed)."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: dict[str, BaseException] = field(default_factory=dict)


@dataclass
class TransferStats:
    """What a connector moved and held, for the npu_llm:kv_transfer_* metrics (backend/triton/metrics.py)."""

    bytes: int = 0  # (consumer) pulled
    blocks: int = 0
    seconds: float = 0.0  # summed over pulls: claim, read and release
    pulls: int = 0
    failures: int = 0  # pulls that failed (recomputed here, or refused by the producer)
    expired: int = 0  # (producer) held blocks freed by abort_timeout_s, never released by a consumer
    # a KV pool's: prompt tokens looked up past the local prefix cache, and of those found (vLLM's
    # external_prefix_cache_queries / _hits); blocks and bytes it saved (a pool's loads count as pulls above)
    external_queries: int = 0
    external_hits: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0

    def copy(self) -> "TransferStats":
        return TransferStats(**vars(self))


class KVConnector(ABC):
    def __init__(self, config: KVTransferConfig, block_size: int):
        self.config = config
        self.block_size = block_size
        self.stats = TransferStats()  # (updated under the connector's own lock where threads share it)

    # -- scheduler side ---------------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens beyond num_computed_tokens (the local prefix-cache hits) that another engine holds for this
        request; they are loaded asynchronously, while the request waits without taking a step."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's block table now covers its external tokens: remember to load them into those blocks."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """This step's work for the worker side (and forget it here)."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A request ended: (whether its blocks must wait for a consumer before they are freed, the
        kv_transfer_params to return to the client)."""

    @property
    def fail_on_load_error(self) -> bool:
        """Whether a load that fails fails its request (kv_load_failure_policy "fail"), not only a refused claim."""
        return self.config.kv_load_failure_policy == "fail"

    def release_refused(self, params: KVTransferParams, prompt_token_ids: list[int]) -> None:
        """A request with these params was refused before it was queued: free what its producer holds for it."""

    # -- worker side ------------------------------------------------------------------------------

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        """The KV tensors, per layer, once allocated (their first dimension is the block)."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start this step's loads; they finish in the background (get_finished reports them)."""

    def wait_for_save(self) -> None:
        """After the forward pass: finish this step's saves. A pulling connector saves nothing."""

    @abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """The transfers that ended since the last call."""

    def shutdown(self) -> None:
        """Stop background threads and sockets, and release the transfer engine's registrations."""


def drain(finished: queue.SimpleQueue) -> list:
    """What a connector's threads put on this queue since the last call."""
    items = []
    while True:
        try:
            items.append(finished.get_nowait())
        except queue.Empty:
            return items


def create_connector(config: KVTransferConfig, block_size: int, platform: str, model_name: str, model_dir: Path,
                     quantization: str | None) -> KVConnector:
    """The connector kv_transfer_config names (backend/config/kv_transfer.py checked that it is one of KV_CONNECTORS).
    A pool's keys name the model (model_key: its files and quantization), so that two models never share a block."""
    # The one deliberate cycle of the engine: the interface names its implementations. Lazy, so that Mooncake's
    # transfer engine and store load only where a connector is configured.
    if config.is_pool:
        from backend.engine.kv_transfer.kv_pool import KVPoolConnector, model_key

        if config.kv_connector == OFFLOADING_CONNECTOR:
            from backend.engine.kv_transfer.host_pool import HostBlockStore

            store = HostBlockStore(config)
        else:
            from backend.engine.kv_transfer.mooncake_store import MooncakeBlockStore

            store = MooncakeBlockStore(config, platform)
        return KVPoolConnector(config, block_size, store, model_key(model_name, model_dir, quantization))
    from backend.engine.kv_transfer.mooncake import MooncakeConnectorV1

    return MooncakeConnectorV1(config, block_size, platform)
