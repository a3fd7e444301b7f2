"""The host-memory pool behind CPU offload (OffloadingConnector, `kv_offloading_size`): tensors in host memory shaped
like the KV cache, num_cpu_blocks deep, and an LRU index from a block's pool key to its slot (vLLM's CPU offload keeps
its blocks the same way). Sized by kv_connector_extra_config's cpu_bytes_to_use (what kv_offloading_size GiB
becomes) or num_cpu_blocks."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from backend.config import KVTransferConfig
from backend.engine.kv_transfer.kv_pool import BlockStore, PoolError


class HostBlockStore(BlockStore):
    def __init__(self, config: KVTransferConfig):
        self.extra = config.kv_connector_extra_config
        self.host: list[torch.Tensor] = []
        self.index: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recently used first
        self.free_slots: list[int] = []
        self._lock = threading.Lock()  # the index: the scheduler's lookups read it beside the worker's copies

    def register(self, tensors: list[torch.Tensor]) -> None:
        super().register(tensors)
        block_bytes = sum(t[0].numel() * t.element_size() for t in tensors)
        num_slots = int(self.extra.get("num_cpu_blocks") or self.extra["cpu_bytes_to_use"] // block_bytes)
        if num_slots < 1:
            raise ValueError(f"kv_offloading_size holds no KV block ({block_bytes} bytes each): make it larger")
        pin = tensors[0].device.type != "cpu" and torch.cuda.is_available()  # (pinned copies to and from a GPU)
        self.host = [torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in tensors]
        self.free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.host[0].shape[0] if self.host else 0

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self.index for key in keys]

    def put(self, keys: list[str], block_ids: list[int]) -> int:
        keys, block_ids = keys[: self.num_slots], block_ids[: self.num_slots]
        with self._lock:  # the slots are taken first, the keys published once the bytes are there
            while len(self.free_slots) < len(keys):
                self.free_slots.append(self.index.popitem(last=False)[1])
            slots = [self.free_slots.pop() for _ in keys]
        source = torch.tensor(block_ids, device=self.tensors[0].device)
        for host, device in zip(self.host, self.tensors):
            host[slots] = device.index_select(0, source).to("cpu")
        with self._lock:
            self.index.update(zip(keys, slots))
        return len(keys)

    def get(self, keys: list[str], block_ids: list[int]) -> None:
        with self._lock:
            missing = [key for key in keys if key not in self.index]
            if missing:
                raise PoolError(f"{len(missing)} of {len(keys)} blocks left host memory since the lookup")
            slots = [self.index[key] for key in keys]
            for key in keys:
                self.index.move_to_end(key)
        target = torch.tensor(block_ids, device=self.tensors[0].device)
        for host, device in zip(self.host, self.tensors):
            device.index_copy_(0, target, host[slots].to(device.device))
