"""The KV pool over Mooncake Store (MooncakeStoreConnector; vllm-ascend's AscendStoreConnector): a distributed store
whose master (`mooncake_master`) every instance reaches, each instance lending it global_segment_size bytes of its
memory. A block is one object: its slices of every KV tensor, one after another, staged through host memory over TCP,
put from and got into the KV tensors themselves over Ascend's transport (the *_multi_buffers calls).

Mooncake's settings come as vllm-ascend reads them: the JSON file MOONCAKE_CONFIG_PATH names (local_hostname,
metadata_server, master_server_address, global_segment_size, local_buffer_size, protocol, device_name), with
MOONCAKE_MASTER overriding the master's address; without a file, the master is MOONCAKE_MASTER's, handshakes are
peer to peer, and the sizes are below. The protocol is tcp for host memory (the CPU's KV cache) and ascend on the NPU.
"""
from __future__ import annotations

import json
import logging
import os
import re

import torch

from backend.config import KVTransferConfig
from backend.config.kv_transfer import MOONCAKE_CONFIG_ENV, MOONCAKE_MASTER_ENV
from backend.engine.kv_transfer.kv_pool import BlockStore, PoolError
from backend.engine.kv_transfer.transfer_engine import INSTALL_HINT, READ_TIMEOUT_S, memory_regions, transfer_protocol

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 1 << 30  # what this instance lends the pool, unless global_segment_size says otherwise
DEFAULT_BUFFER_BYTES = 64 << 20
STAGING_BYTES = 64 << 20  # host memory blocks are staged through over TCP (at least one block)
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value, name: str) -> int:
    """Bytes, from a number or a string such as "3.125GB" or "512MB" (as vllm-ascend's config takes them)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    match = _SIZE.fullmatch(str(value))
    if match is None or float(match[1]) <= 0:
        raise ValueError(f"{MOONCAKE_CONFIG_ENV}: {name}={value!r} is not a size (bytes, or e.g. \"512MB\", \"4GB\")")
    return int(float(match[1]) * _UNITS[match[2].upper()])


def mooncake_settings(config: KVTransferConfig, platform: str) -> dict:
    """The store client's setup, from MOONCAKE_CONFIG_PATH and MOONCAKE_MASTER (module docstring)."""
    path = os.environ.get(MOONCAKE_CONFIG_ENV)
    given = {}
    if path:
        try:
            given = json.loads(open(path).read())
        except (OSError, ValueError) as e:
            raise ValueError(f"{MOONCAKE_CONFIG_ENV}={path}: {e}") from None
    master = os.environ.get(MOONCAKE_MASTER_ENV) or given.get("master_server_address")
    if not master:
        raise ValueError(f"{config.kv_connector} needs the store's master: set {MOONCAKE_MASTER_ENV}=host:port, or "
                         f"master_server_address in the JSON file {MOONCAKE_CONFIG_ENV} names (docs/kv-pool.md)")
    sizes = {"global_segment_size": DEFAULT_SEGMENT_BYTES, "local_buffer_size": DEFAULT_BUFFER_BYTES}
    return {
        "local_hostname": given.get("local_hostname", config.kv_ip),
        "metadata_server": given.get("metadata_server", "P2PHANDSHAKE"),
        "master_server_addr": master,
        **{name: parse_size(given.get(name, default), name) for name, default in sizes.items()},
        "protocol": given.get("protocol", transfer_protocol(platform)),
        "rdma_devices": given.get("device_name", ""),
    }


class MooncakeBlockStore(BlockStore):
    STAGE_OVER_TCP = True  # (the tests turn it off, to run the direct path over TCP)

    def __init__(self, config: KVTransferConfig, platform: str):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RuntimeError(f"{config.kv_connector} needs Mooncake Store, which does not load ({e}); "
                               f"{INSTALL_HINT}") from None
        settings = mooncake_settings(config, platform)
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(READ_TIMEOUT_S))  # (bounds a put or get that stalls)
        self.store = MooncakeDistributedStore()
        status = self.store.setup(settings)
        if status != 0:
            raise RuntimeError(f"Mooncake Store did not start (status {status}): is its master up at "
                               f"{settings['master_server_addr']}? (`npu-llm up --kv-pool` starts one)")
        self.master = settings["master_server_addr"]
        # Over TCP each buffer of a put or get is a transfer task of its own: a block's slices of every KV tensor (two
        # a layer) are gathered into one row of a staging buffer first, one task a block (8x faster at 30 layers).
        # Over Ascend's transport, straight from and into the KV tensors in device memory, as vllm-ascend moves them.
        self.protocol = settings["protocol"]
        self.staged = self.protocol == "tcp" and self.STAGE_OVER_TCP
        self._registered: list[int] = []
        log.info("KV pool: Mooncake Store, master %s, %s, lending %d MiB", self.master, settings["protocol"],
                 settings["global_segment_size"] >> 20)

    def register(self, tensors: list[torch.Tensor]) -> None:
        """Staged: the staging buffer registered. Direct: each KV tensor's memory, once per storage (as vllm-ascend
        registers its regions)."""
        super().register(tensors)
        if self.staged:
            self.staging = torch.empty(max(1, STAGING_BYTES // sum(self.block_bytes)), sum(self.block_bytes),
                                       dtype=torch.uint8)
            regions = {self.staging.data_ptr(): self.staging.numel()}
        else:
            regions = memory_regions(tensors, self.protocol)
        for address, size in regions.items():
            if self.store.register_buffer(address, size) != 0:
                raise RuntimeError("Mooncake Store could not register the KV cache's memory")
            self._registered.append(address)

    def _batches(self, keys: list[str], block_ids: list[int]):
        """(keys, block ids) in batches the staging buffer holds (all at once when direct)."""
        step = self.staging.shape[0] if self.staged else max(1, len(keys))
        for start in range(0, len(keys), step):
            yield keys[start:start + step], block_ids[start:start + step]

    def _buffers(self, block_ids: list[int]) -> tuple[list, list]:
        """The buffers of a put or get of these blocks: a staging row each, or each block's slices of every KV
        tensor."""
        if self.staged:
            row = self.staging.shape[1]
            return [self.staging.data_ptr() + i * row for i in range(len(block_ids))], [row] * len(block_ids)
        addresses = [[t.data_ptr() + block * size for t, size in zip(self.tensors, self.block_bytes)]
                     for block in block_ids]
        return addresses, [self.block_bytes] * len(block_ids)

    def _staged_slices(self, n: int):
        """Each KV tensor with its bytes in the first n staging rows."""
        offset = 0
        for t, size in zip(self.tensors, self.block_bytes):
            yield t, self.staging[:n, offset:offset + size]
            offset += size

    def contains(self, keys: list[str]) -> list[bool]:
        found = self.store.batch_is_exist(keys)
        if any(code < 0 for code in found):
            raise PoolError(f"the store's master ({self.master}) did not answer (code {min(found)})")
        return [code == 1 for code in found]

    def put(self, keys: list[str], block_ids: list[int]) -> int:
        saved = 0
        for batch, blocks in self._batches(keys, block_ids):
            if self.staged:
                ids = torch.tensor(blocks, device=self.tensors[0].device)
                for t, rows in self._staged_slices(len(blocks)):
                    rows.copy_(t.index_select(0, ids).reshape(len(blocks), -1).view(torch.uint8))
                results = self.store.batch_put_from(batch, *self._buffers(blocks))
            else:
                results = self.store.batch_put_from_multi_buffers(batch, *self._buffers(blocks))
            if any(code != 0 for code in results):  # (a full store, or the master gone: those blocks stay out)
                log.info("KV pool: %d of %d blocks not saved (code %d)", sum(c != 0 for c in results), len(batch),
                         min(results))
            saved += sum(code == 0 for code in results)
        return saved

    def get(self, keys: list[str], block_ids: list[int]) -> None:
        expected = sum(self.block_bytes)
        for batch, blocks in self._batches(keys, block_ids):
            get = self.store.batch_get_into if self.staged else self.store.batch_get_into_multi_buffers
            results = get(batch, *self._buffers(blocks))
            wrong = [(key, got) for key, got in zip(batch, results) if got != expected]
            if wrong:
                key, got = wrong[0]
                # (a value gone, or of another size than a block's, gives a negative code: Mooncake's ErrorCode)
                why = f"holds {got} bytes, not {expected}" if got >= 0 else f"gave Mooncake error {got}"
                raise PoolError(f"{len(wrong)} of {len(keys)} blocks did not load: {key} {why}")
            if self.staged:
                ids = torch.tensor(blocks, device=self.tensors[0].device)
                for t, rows in self._staged_slices(len(blocks)):
                    t.index_copy_(0, ids, rows.view(t.dtype).reshape(len(blocks), *t.shape[1:]).to(t.device))

    def close(self) -> None:
        for address in self._registered:
            self.store.unregister_buffer(address)
        self._registered = []
        self.store.close()
