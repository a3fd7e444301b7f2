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
        # key -> slot, least recently used first. A prompt's blocks go in tail first, so that its head, which every
        # longer prompt needs (a lookup stops at the first miss), is evicted last.
        self.index: OrderedDict[str, int] = OrderedDict()
        self.pinned: dict[str, int] = {}  # key -> loads on their way (not evicted meanwhile)
        self.free_slots: list[int] = []
        self._lock = threading.Lock()  # the index: the scheduler's lookups read it beside the worker's copies

    def register(self, tensors: list[torch.Tensor]) -> None:
        super().register(tensors)
        block_bytes = sum(self.block_bytes)
        num_slots = int(self.extra.get("num_cpu_blocks") or self.extra["cpu_bytes_to_use"] // block_bytes)
        if num_slots < 1:
            raise ValueError(f"kv_offloading_size holds no KV block ({block_bytes} bytes each): make it larger")
        page_locked = tensors[0].device.type != "cpu" and torch.cuda.is_available()  # (faster copies to and from a GPU)
        self.host = [torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=page_locked) for t in tensors]
        self.free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.host[0].shape[0] if self.host else 0

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self.index for key in keys]

    def pin(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self.pinned[key] = self.pinned.get(key, 0) + 1

    def unpin(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                if self.pinned.get(key, 0) > 1:
                    self.pinned[key] -= 1
                else:
                    self.pinned.pop(key, None)

    def touch(self, keys: list[str]) -> None:
        with self._lock:
            for key in reversed(keys):
                if key in self.index:
                    self.index.move_to_end(key)

    def put(self, keys: list[str], block_ids: list[int]) -> int:
        with self._lock:  # the slots are taken first, the keys published once the bytes are there
            if len(self.free_slots) < len(keys):
                evictable = [key for key in self.index if key not in self.pinned][:len(keys) - len(self.free_slots)]
                self.free_slots += [self.index.pop(key) for key in evictable]
            count = min(len(keys), len(self.free_slots))  # (a pool all pinned, or smaller than the prompt: fewer)
            keys, block_ids = keys[:count], block_ids[:count]
            slots = [self.free_slots.pop() for _ in keys]
        if not keys:
            return 0
        try:
            source = torch.tensor(block_ids, device=self.tensors[0].device)
            for host, device in zip(self.host, self.tensors):
                host[slots] = device.index_select(0, source).to("cpu")
        except BaseException:
            with self._lock:
                self.free_slots.extend(slots)
            raise
        with self._lock:
            self.index.update(zip(reversed(keys), reversed(slots)))
        return len(keys)

    def get(self, keys: list[str], block_ids: list[int]) -> None:
        with self._lock:
            missing = [key for key in keys if key not in self.index]
            if missing:
                raise PoolError(f"{len(missing)} of {len(keys)} blocks left host memory since the lookup")
            slots = [self.index[key] for key in keys]
            for key in reversed(keys):
                self.index.move_to_end(key)
        target = torch.tensor(block_ids, device=self.tensors[0].device)
        for host, device in zip(self.host, self.tensors):
            device.index_copy_(0, target, host[slots].to(device.device))
