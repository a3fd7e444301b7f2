"""A KV pool: KV blocks kept beyond the device's KV cache, keyed by their prefix-cache hash, for any later request (on
this engine, or on another engine sharing the store) whose prompt starts with the same tokens. Two kinds of pool sit
behind one connector (docs/kv-pool.md): host memory (OffloadingConnector, `kv_offloading_size`; host_pool.py) and a
Mooncake Store every instance shares (MooncakeStoreConnector; mooncake_store.py).

- Lookup (scheduler side, at admission): the longest run of the prompt's full blocks, past its local prefix-cache
  hits, that the pool holds. The request is admitted with blocks for its whole prompt and waits, taking no step,
  while those blocks load (as a remote prefill does); then it computes the rest of its prompt.
- Load and save (worker side, one thread, in order): a load copies the pool's bytes into the request's blocks; when a
  request ends, its full blocks of computed tokens that the pool lacks are saved, its blocks held until then (so that
  no other request writes into them meanwhile) and freed after. A save is write-through, as vLLM's
  OffloadingConnector saves, so an eviction from the device's cache never waits for a copy. It runs beside the next
  steps, except on a kv_producer (a prefill server of a disaggregated deployment), whose step ends once its saves
  have, so that the decode server the answer goes to finds them (wait_for_save).
- Keys (pool_key): the model, the KV layout (dtype, block size, every tensor's bytes per block), the rank, and the
  block's SHA-256 hash chain (backend/engine/kv_cache.py): the same on every host, with no PYTHONHASHSEED to agree on;
  another model's or another layout's blocks never match.
- A pool that fails (the store down, a lookup past its deadline, a block evicted between lookup and load, a value of
  the wrong size) costs a recompute, never a request: unless kv_load_failure_policy is "fail", the prompt is computed
  here instead, and the scheduler does not look the request up again. After a failed lookup, lookups pause for
  POOL_RETRY_S, so that a dead store does not cost every admission its deadline. A load or save is never abandoned
  while it may still touch the request's blocks: the store's own transfer timeout bounds it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.config import KVTransferConfig
from backend.engine.kv_cache import block_hash_chain
from backend.engine.kv_transfer.connector import FinishedTransfers, KVConnector, KVConnectorMetadata, drain
from backend.engine.kv_transfer.transfer_engine import bind_to
from backend.engine.request import Request

log = logging.getLogger(__name__)

TENSOR_SAMPLE_BYTES = 256  # of each weight tensor's start, for model_key
LOOKUP_TIMEOUT_S = 0.5  # a lookup runs inside the scheduler's step: past this, the prompt is computed instead
POOL_RETRY_S = 10.0  # after a failed lookup or save, the pool is not asked again for this long
SAVE_WAIT_S = 5.0  # how long a kv_producer's step waits for its saves (kv_connector_extra_config's transfer_timeout_s)
# Finished requests hold at most this share of the KV cache for their saves: beyond it a request is not saved (a
# store that is slow, or a burst of long requests, must not pin the cache), as MooncakeConnectorV1 caps what it holds.
# (One save is always let through, however long its request.)
MAX_HELD_SHARE = 0.5


class PoolError(RuntimeError):
    """The pool could not serve a load (a block gone, a value of the wrong size, the store unreachable)."""


class BlockStore(ABC):
    """Where a pool keeps blocks: put copies blocks of the registered KV tensors out under their keys, get copies
    them back into blocks, contains says which keys are there. Calls come from one thread at a time, except
    contains (the scheduler's lookups), which a store must allow beside a put or get."""

    def register(self, tensors: list[torch.Tensor]) -> None:
        """The KV tensors, once allocated (first dimension: the block)."""
        self.tensors = tensors
        self.block_bytes = [t[0].numel() * t.element_size() for t in tensors]  # each tensor's bytes a block

    @abstractmethod
    def contains(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def put(self, keys: list[str], block_ids: list[int]) -> int:
        """Save these blocks under these keys; how many were saved (a full store may take fewer)."""

    @abstractmethod
    def get(self, keys: list[str], block_ids: list[int]) -> None:
        """Load these keys into these blocks, or raise PoolError."""

    def pin(self, keys: list[str]) -> None:
        """Keep these keys from eviction until unpin (a load of them is on its way). A store that evicts on its own
        terms (Mooncake's leases) need not."""

    def unpin(self, keys: list[str]) -> None: ...

    def touch(self, keys: list[str]) -> None:
        """These keys were just used again (a save found them present): evict them last."""

    def close(self) -> None:
        """Release what the store holds (registrations, its client)."""


@dataclass
class PoolTransfer:
    """A load into a request's blocks, or a save of them: its keys and block ids, in the same order."""

    request_id: str
    keys: list[str]
    block_ids: list[int]


class KVPoolConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, block_size: int, store: BlockStore, model_key: str, rank: int = 0,
                 tp_size: int = 1):
        super().__init__(config, block_size)
        self.store = store
        self.model_key, self.rank, self.tp_size = model_key, rank, tp_size
        self.key_prefix = ""  # set once the KV layout is known (register_kv_caches)
        self.block_bytes = 0  # bytes of one block across every KV tensor
        extra = config.kv_connector_extra_config
        self.lookup_timeout_s = float(extra.get("lookup_timeout_s", LOOKUP_TIMEOUT_S))
        self.transfer_timeout_s = float(extra.get("transfer_timeout_s", SAVE_WAIT_S))
        self.num_blocks = 0  # the KV cache's (register_kv_caches)
        self._held = 0  # blocks that finished requests hold until their saves have read them
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kv-pool-lookup")
        self._worker: ThreadPoolExecutor | None = None  # loads and saves, in order (made with the KV tensors)
        self._lookup_pending = None  # a lookup past its deadline, still running: no other is started meanwhile
        self._paused_until = 0.0
        self._loads: list[PoolTransfer] = []
        self._saving: list = []  # this step's saves (futures), for wait_for_save
        # ("load", request id, None or the error) or ("save", request id, the blocks it held), as they end
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (its computed tokens, the pool's hits past them) at its last lookup: a request that waits for
        # blocks is looked up (and counted) once, not at every step
        self._matched: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()  # stats: the worker thread adds to them

    # -- keys -------------------------------------------------------------------------------------

    def pool_keys(self, request: Request, first: int, last: int) -> list[str]:
        """The keys of the request's full blocks first..last-1."""
        hashes = block_hash_chain(request, last, self.block_size)[first:last]
        return [f"{self.key_prefix}/{h.hex()}" for h in hashes]

    # -- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.config.is_consumer:
            return 0
        if request.params.prompt_logprobs is not None and not request.output_token_ids:
            return 0  # (a loaded block has no logits, as a prefix-cache hit has none)
        first, last = num_computed_tokens // self.block_size, (len(request.token_ids) - 1) // self.block_size
        if last <= first:
            return 0
        matched = self._matched.get(request.request_id)
        if matched is not None and matched[0] == num_computed_tokens:
            return matched[1]
        present = self._lookup(self.pool_keys(request, first, last))
        hits = next((i for i, there in enumerate(present) if not there), len(present)) * self.block_size
        self._matched[request.request_id] = num_computed_tokens, hits
        with self._lock:
            self.stats.external_queries += (last - first) * self.block_size
            self.stats.external_hits += hits
        return hits

    def _lookup(self, keys: list[str]) -> list[bool]:
        """contains(keys) under the lookup deadline; nothing present while the pool is paused or unreachable."""
        if self._paused:
            return [False] * len(keys)
        future = self._lookups.submit(self.store.contains, keys)
        try:
            return future.result(timeout=self.lookup_timeout_s)
        except Exception as e:  # (a timeout included: the call goes on, and lookups wait for it to end)
            self._lookup_pending = future
            self._paused_until = time.monotonic() + POOL_RETRY_S
            log.warning("KV pool: lookup failed (%s); prompts are computed here for the next %.0f s",
                        describe(e, self.lookup_timeout_s), POOL_RETRY_S)
            return [False] * len(keys)

    @property
    def _paused(self) -> bool:
        """After a failed lookup, for POOL_RETRY_S and as long as that lookup runs: neither lookups nor saves."""
        return time.monotonic() < self._paused_until or bool(self._lookup_pending and not self._lookup_pending.done())

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self._matched.pop(request.request_id, None)
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        keys = self.pool_keys(request, first, last)
        self.store.pin(keys)  # (a save before the load must not evict what the lookup found)
        self._loads.append(PoolTransfer(request.request_id, keys, block_ids[first:last]))

    def build_connector_meta(self) -> KVConnectorMetadata:
        metadata, self._loads = KVConnectorMetadata(self._loads), []
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._matched.pop(request.request_id, None)
        num_full = min(request.num_computed_tokens // self.block_size, len(block_ids))
        if not self.config.is_producer or num_full == 0 or self._paused:
            return False, None
        if self._held and self._held + num_full > MAX_HELD_SHARE * self.num_blocks:  # (saves behind: not worth a stall)
            log.info("KV pool: %d blocks wait for saves already; request %s's are not saved", self._held,
                     request.request_id)
            return False, None
        self._held += num_full
        save = PoolTransfer(request.request_id, self.pool_keys(request, 0, num_full), list(block_ids[:num_full]))
        self._saving.append(self._worker.submit(self._save, save))
        return True, None  # (its blocks are freed once the save has read them: get_finished's sending)

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        tensors = list({t.data_ptr(): t for layer in kv_caches for t in layer}.values())  # (one may serve as both)
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("a KV tensor a pool copies must be contiguous blocks")
        self.store.register(tensors)
        self.block_bytes = sum(self.store.block_bytes)
        self.num_blocks = tensors[0].shape[0]
        layout = repr([(str(t.dtype), tuple(t.shape[1:])) for t in tensors])
        fingerprint = hashlib.sha256(f"{layout}|{self.block_size}".encode()).hexdigest()[:16]
        self.key_prefix = f"npu-llm/{self.model_key}/{fingerprint}/tp{self.tp_size}.{self.rank}"
        # (on an accelerator the thread's copies run on the KV cache's device, as vllm-ascend binds its threads)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-pool", initializer=bind_to, initargs=(
            tensors[0].device,))
        log.info("KV pool: %s as %s, keys %s/..., %d bytes a block", self.config.kv_connector, self.config.kv_role,
                 self.key_prefix, self.block_bytes)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for load in metadata.loads:
            self._worker.submit(self._load, load)

    def _load(self, load: PoolTransfer) -> None:
        started = time.perf_counter()
        try:
            self.store.get(load.keys, load.block_ids)
        except Exception as e:  # (reported; the scheduler recomputes or fails the request, per the policy)
            self.store.unpin(load.keys)
            log.warning("KV pool: loading request %s's %d blocks failed: %s", load.request_id, len(load.keys), e)
            with self._lock:
                self.stats.failures += 1
            self._done.put(("load", load.request_id, e))
            return
        with self._lock:
            self.stats.pulls += 1
            self.stats.blocks += len(load.keys)
            self.stats.bytes += len(load.keys) * self.block_bytes
            self.stats.seconds += time.perf_counter() - started
        self.store.unpin(load.keys)
        self._done.put(("load", load.request_id, None))

    def _save(self, save: PoolTransfer) -> None:
        try:
            present = self.store.contains(save.keys)
            kept = [key for key, there in zip(save.keys, present) if there]
            missing = [i for i, there in enumerate(present) if not there]
            self.store.pin(kept)  # (the put must not evict the prompt's head to make room for its tail)
            try:
                saved = self.store.put([save.keys[i] for i in missing], [save.block_ids[i] for i in missing]) \
                    if missing else 0
            finally:
                self.store.unpin(kept)
            self.store.touch(save.keys)
            with self._lock:
                self.stats.saved_blocks += saved
                self.stats.saved_bytes += saved * self.block_bytes
        except Exception as e:  # (a save that fails loses only a future hit; a store that fails is left alone)
            self._paused_until = time.monotonic() + POOL_RETRY_S
            log.warning("KV pool: saving request %s's blocks failed (%s); nothing is saved or looked up for the "
                        "next %.0f s", save.request_id, e, POOL_RETRY_S)
        self._done.put(("save", save.request_id, len(save.block_ids)))

    def wait_for_save(self) -> None:
        """A kv_producer (a prefill server whose decode servers load from the pool) ends the step only once its
        saves have: the request's answer then reaches the decode server after its blocks reached the pool (vLLM's
        wait_for_save). kv_both saves in the background."""
        saving, self._saving = self._saving, []
        if self.config.kv_role == "kv_producer":
            _, late = wait(saving, timeout=self.transfer_timeout_s)
            if late:  # (they go on, their blocks held; the answers go now, and their decode servers recompute)
                log.warning("KV pool: %d saves took longer than %g s; answering without waiting for them", len(late),
                            self.transfer_timeout_s)

    def get_finished(self) -> FinishedTransfers:
        finished = FinishedTransfers()
        for kind, request_id, outcome in drain(self._done):
            if kind == "save":
                finished.sending.add(request_id)
                self._held -= outcome
            elif outcome is None:
                finished.recving.add(request_id)
            else:
                finished.failed[request_id] = outcome
        return finished

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        if self._lookup_pending is not None:  # (a lookup past its deadline still in the store's client)
            try:
                self._lookup_pending.result(timeout=SAVE_WAIT_S)
            except Exception:  # (it failed, or hangs: closing is all that is left)
                pass
        self.store.close()


def model_key(name: str, model_dir: Path, quantization: str | None) -> str:
    """What a pool's keys call a model: its name (the model argument's last part) and a fingerprint of what it
    computes: config.json, the quantization asked for, and the start of every weight tensor (a fine-tune of the same
    name and shapes differs there, whichever tensors it changed). The same wherever the files are, so that instances
    on other hosts share the blocks; a few bytes a tensor, so quick for any size of model."""
    digest = hashlib.sha256(repr(quantization).encode())
    config = Path(model_dir) / "config.json"
    if config.exists():
        digest.update(config.read_bytes())
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_bytes))
            for tensor in sorted(k for k in header if k != "__metadata__"):
                begin, end = header[tensor]["data_offsets"]
                f.seek(8 + header_bytes + begin)
                digest.update(tensor.encode() + f.read(min(end - begin, TENSOR_SAMPLE_BYTES)))
    return f"{name}-{digest.hexdigest()[:16]}"


def describe(error: BaseException, timeout_s: float) -> str:
    return f"no answer within {timeout_s:g} s" if isinstance(error, FutureTimeout) else str(error) or repr(error)
