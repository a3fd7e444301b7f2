"""MooncakeConnectorV1: prefill on one engine, decode on another, the prompt's KV pulled between them by Mooncake's
transfer engine, as vllm-ascend's connector of that name does it.

- The producer (kv_producer) registers its KV tensors with the transfer engine and serves a side channel on kv_port.
  When a request sent with {"do_remote_decode": true} finishes, its prompt blocks stay held, and its output carries
  the kv_transfer_params a consumer needs: the producer's engine id, address, request id and block ids.
- The consumer (kv_consumer) admits a request sent with those params as soon as blocks are free for its prompt
  (after its own prefix-cache hits), and pulls the remote blocks into them on a thread while other requests step:
  it fetches the producer's layout once, claims the request's blocks (the producer checks that it holds exactly those
  blocks for exactly that prompt), reads them with batch_transfer_sync_read, one transfer per run of contiguous
  blocks per tensor, then releases them. The last prompt token then runs locally, giving the first token's logits
  (as vLLM's consumer does). A producer that does not hear back within abort_timeout_s frees the blocks anyway.
- Both ends must serve the same model, dtype and block size, on one rank each (tensor_parallel_size=1).

A claim the producer refuses fails the request with a ValueError (its kv_transfer_params were wrong: HTTP 400).
A transfer that cannot happen (the producer gone, a timeout) is not the client's fault: the request's prompt is
computed locally instead (vLLM's "recompute" policy).
"""
from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from backend.config.addresses import is_loopback
from backend.config import KVTransferConfig
from backend.config.control_key import control_key
from backend.engine.kv_transfer.connector import FinishedTransfers, KVConnector, KVConnectorMetadata, KVLoad, drain
from backend.engine.kv_transfer.loopback import listeners_are_local
from backend.engine.kv_transfer.params import KVTransferParams
from backend.engine.kv_transfer.side_channel import SideChannelServer, Unavailable, call
from backend.engine.kv_transfer.transfer_engine import bind_to, memory_regions, start_transfer_engine, transfer_protocol
from backend.engine.request import Request
from npu_llm_kernels.metadata import cdiv

log = logging.getLogger(__name__)

SIDE_CHANNEL_TIMEOUT_S = 5.0
PULLS_PER_PEER = 2  # pulls in flight at once from one producer (each is one batch transfer), on threads of its own
MAX_PEERS = 64  # producers whose layout and pull threads are kept; the least recently used goes beyond
# A producer holds finished prefills' blocks for consumers in at most this share of its KV cache: beyond it, a
# prefill is answered without kv_transfer_params (its decode server computes the prompt) and its blocks are freed, so
# that prefills nobody claims cannot pin the whole cache until they time out.
MAX_HELD_SHARE = 0.5


class TransferFailed(RuntimeError):
    """The KV could not be moved (the producer unreachable, a transfer error): the prompt is computed locally."""


@dataclass
class _Held:
    """A finished prefill's blocks, kept for the consumer that claims them."""

    block_ids: list[int]
    prompt_token_ids: list[int]
    deadline: float  # time.monotonic(); a claim sets a new one, for its read
    token: str | None = None  # set by the claim: only its holder may release the blocks then


@dataclass
class _Peer:
    """A producer's KV layout, as its side channel describes it."""

    engine_id: str
    session: str  # the transfer engine's "host:rpc_port"
    tensors: list[tuple[int, int]]  # (base address, bytes per block) of each registered tensor, in layer order
    block_size: int


class MooncakeConnectorV1(KVConnector):
    def __init__(self, config: KVTransferConfig, block_size: int, platform: str):
        super().__init__(config, block_size)
        if is_loopback(config.kv_ip) and not listeners_are_local():
            log.warning("Mooncake's transfer engine listens on every interface, though kv_ip is %s: other hosts can "
                        "reach this engine's KV cache. `npu-llm serve` and `up` keep it on loopback "
                        "(backend/engine/kv_transfer/loopback.py)", config.kv_ip)
        self._engine = start_transfer_engine(config.kv_ip, platform)
        self.protocol = transfer_protocol(platform)
        self._tensors: list[tuple[int, int]] = []  # ours, as in _Peer.tensors
        self._regions: list[int] = []  # the addresses of the memory registered with the transfer engine
        self._device = torch.device("cpu")  # the KV cache's, which the pull threads bind to
        self._num_blocks = 0
        self._lock = threading.Lock()  # _held, _released and stats: the side channel's thread shares them
        self._held: dict[str, _Held] = {}
        # request id -> when its held prefill timed out: a late claim is told so (and recomputes), not refused,
        # for another abort_timeout_s
        self._expired: dict[str, float] = {}
        self._released: set[str] = set()
        self._loads: list[KVLoad] = []  # decided this step, for build_connector_meta
        self._loaded: queue.SimpleQueue = queue.SimpleQueue()  # (request id, None or the error) of ended pulls
        self._peers: dict[tuple[str, int], _Peer] = {}
        # per producer, so that a slow or stalled one holds up only its own pulls (and releases)
        self._pools: OrderedDict[tuple[str, int], ThreadPoolExecutor] = OrderedDict()
        self._retired: list[ThreadPoolExecutor] = []  # evicted pools, for shutdown() to wait on
        self._server: SideChannelServer | None = None

    # -- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        if params is None or not params.do_remote_prefill:
            return 0
        return request.num_prompt_tokens - num_computed_tokens

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens:
            first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
            self._loads.append(KVLoad(request.request_id, list(request.prompt_token_ids), list(block_ids),
                                      request.kv_transfer_params, first))

    def build_connector_meta(self) -> KVConnectorMetadata:
        metadata, self._loads = KVConnectorMetadata(self._loads), []
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        if params is not None and params.do_remote_prefill:  # ended before its pull began: the producer may free
            self._pool_of(params).submit(self._release_unpulled, params, list(request.prompt_token_ids))
            return False, None
        if params is None or not params.do_remote_decode or request.finish_reason == "abort":
            return False, None
        blocks = list(block_ids[:cdiv(request.num_prompt_tokens, self.block_size)])
        with self._lock:
            held = sum(len(h.block_ids) for h in self._held.values())
            if held + len(blocks) > MAX_HELD_SHARE * self._num_blocks:
                log.warning("holding %d blocks for consumers already: request %s's prefill is not kept (its decode "
                            "server computes the prompt)", held, request.request_id)
                return False, None
            self._held[request.request_id] = _Held(blocks, list(request.prompt_token_ids),
                                                   time.monotonic() + self.config.abort_timeout_s)
        pull = KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.config.engine_id, remote_request_id=request.request_id,
            remote_block_ids=blocks, remote_host=self.config.kv_ip, remote_port=self.config.kv_port, remote_tp_size=1)
        key = control_key()
        return True, (pull.signed_with(key) if key else pull).model_dump()

    def release_refused(self, params: KVTransferParams, prompt_token_ids: list[int]) -> None:
        self._pool_of(params).submit(self._release_unpulled, params, list(prompt_token_ids))

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
        tensors = list({t.data_ptr(): t for layer in kv_caches for t in layer}.values())  # (one may serve as both)
        for t in tensors:
            if t.stride(0) * t.shape[0] != t.numel():
                raise ValueError("a KV tensor to transfer must be contiguous blocks")
        for address, size in memory_regions(tensors, self.protocol).items():
            status = self._engine.register_memory(address, size)
            if status != 0:
                raise RuntimeError(f"Mooncake could not register the KV cache (status {status})")
            self._regions.append(address)
        self._tensors = [(t.data_ptr(), t.stride(0) * t.element_size()) for t in tensors]
        self._device = tensors[0].device if tensors else torch.device("cpu")
        self._num_blocks = tensors[0].shape[0] if tensors else 0
        if self.config.is_producer:
            self._server = SideChannelServer(self.config.kv_ip, self.config.kv_port, self._answer)
        log.info("KV transfer: %s as %s, engine %s, side channel %s:%d, transfer engine %s:%d over %s",
                 self.config.kv_connector, self.config.kv_role, self.config.engine_id, self.config.kv_ip,
                 self.config.kv_port, self.config.kv_ip, self._engine.get_rpc_port(), self.protocol)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for load in metadata.loads:
            self._pool_of(load.remote).submit(self._load, load)

    def _pool_of(self, remote: KVTransferParams) -> ThreadPoolExecutor:
        """The pull threads of the producer these params name (made on first use; beyond MAX_PEERS producers, the
        least recently used one's go, once their work is done, with its layout)."""
        address = (remote.remote_host, remote.remote_port)
        with self._lock:
            # (bound to the KV cache's device, as vllm-ascend binds its pull threads: the device is per thread)
            pool = self._pools.pop(address, None) or ThreadPoolExecutor(
                PULLS_PER_PEER, thread_name_prefix=f"npu-llm-kv-load-{remote.remote_port}", initializer=bind_to,
                initargs=(self._device,))
            self._pools[address] = pool
            while len(self._pools) > MAX_PEERS:
                gone, old = self._pools.popitem(last=False)
                old.shutdown(wait=False)  # (its running pulls end on their own; shutdown() waits for them)
                self._retired.append(old)
                self._peers.pop(gone, None)
        return pool

    def get_finished(self) -> FinishedTransfers:
        finished = FinishedTransfers()
        with self._lock:
            now = time.monotonic()
            for request_id in [r for r, held in self._held.items() if held.deadline < now]:
                log.warning("KV transfer: no consumer released request %s within %.0f s; freeing its blocks",
                            request_id, self.config.abort_timeout_s)
                del self._held[request_id]
                self._released.add(request_id)
                self._expired[request_id] = now
                self.stats.expired += 1
            for request_id in [r for r, when in self._expired.items() if when < now - self.config.abort_timeout_s]:
                del self._expired[request_id]
            finished.sending, self._released = self._released, set()
        for request_id, error in drain(self._loaded):
            if error is None:
                finished.recving.add(request_id)
            else:
                finished.failed[request_id] = error
        return finished

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
        for pool in [*self._pools.values(), *self._retired]:
            pool.shutdown(wait=True, cancel_futures=True)
        for address in self._regions:
            self._engine.unregister_memory(address)
        self._tensors, self._regions = [], []

    # -- the producer's side channel --------------------------------------------------------------

    def _answer(self, request: dict) -> dict:
        _check_types(request)
        op = request.get("op")
        if op == "layout":
            return {"engine_id": self.config.engine_id, "session": f"{self.config.kv_ip}:{self._engine.get_rpc_port()}",
                    "tensors": self._tensors, "block_size": self.block_size}
        if op == "claim":
            return {"token": self._claim(request)}
        if op == "release":
            self._release(request)
            return {"ok": True}
        raise ValueError(f"unknown side-channel op {op!r}")

    def _claim(self, request: dict) -> str:
        """A consumer asks for a request's blocks: only the very blocks held for that very prompt, once. Returns the
        token that releases them."""
        with self._lock:
            held = self._matching(request)
            if held.token is not None:
                raise ValueError(f"the prefill of request {request.get('request_id')!r} is already being pulled")
            if held.deadline < time.monotonic():  # (expired, not yet freed: not the asker's fault)
                raise Unavailable(f"the prefill of request {request.get('request_id')!r} timed out")
            held.token = secrets.token_hex(16)
            held.deadline = time.monotonic() + self.config.abort_timeout_s
            return held.token

    def _release(self, request: dict) -> None:
        """Free a prefill's blocks: for the claim's token, or, never claimed, for whoever names the very prefill (a
        consumer whose request ended before its pull)."""
        request_id = request.get("request_id")
        with self._lock:
            if request.get("token") is not None:
                held = self._held.get(request_id)
                if held is None or held.token != request["token"]:  # its read outlasted abort_timeout_s
                    raise Unavailable(f"the prefill of request {request_id!r} was freed before its release: its "
                                      "blocks may have been reused")
            elif self._matching(request).token is not None:
                raise ValueError(f"the prefill of request {request_id!r} is being pulled")
            del self._held[request_id]
            self._released.add(request_id)

    def _matching(self, request: dict) -> _Held:
        """The prefill a side-channel request names, if this engine holds exactly that one (under the lock)."""
        me, request_id = self.config.engine_id, request.get("request_id")
        if request.get("engine_id") != me:
            raise ValueError(f"kv_transfer_params name engine {request.get('engine_id')!r}, but this is engine {me!r}")
        held = self._held.get(request_id)
        if held is None and request_id in self._expired:
            raise Unavailable(f"the prefill of request {request_id!r} timed out")
        if held is None:
            raise ValueError(f"engine {me!r} holds no prefill of request {request_id!r} (unknown, or already "
                             "pulled)")
        if request.get("block_ids") != held.block_ids:
            raise ValueError(f"remote_block_ids are not the blocks engine {me!r} holds for request {request_id!r}")
        if request.get("prompt_token_ids") != held.prompt_token_ids:
            raise ValueError(f"the prompt is not the one engine {me!r} prefilled as request {request_id!r}")
        return held

    # -- the consumer's pull ----------------------------------------------------------------------

    def _load(self, load: KVLoad) -> None:
        """Claim, read and release one request's blocks (on a pool thread); the outcome goes to get_finished."""
        begin = time.perf_counter()
        remote = load.remote
        try:
            peer = self._peer(remote.remote_host, remote.remote_port, remote.remote_engine_id)
            token = self._call(remote.remote_host, remote.remote_port,
                               {"op": "claim", **_naming(remote, load.prompt_token_ids)})["token"]
            try:
                num_blocks, num_bytes = self._read(peer, load)
            finally:
                self._call(remote.remote_host, remote.remote_port,
                           {"op": "release", "request_id": remote.remote_request_id, "token": token})
        except Exception as e:
            log.warning("KV transfer of request %s failed: %s", load.request_id, e)
            if isinstance(e, TransferFailed):  # (a producer restarted at that address: ask for its layout again)
                self._peers.pop((remote.remote_host, remote.remote_port), None)
            with self._lock:
                self.stats.failures += 1
            self._loaded.put((load.request_id, e))
            return
        with self._lock:
            self.stats.pulls += 1
            self.stats.blocks += num_blocks
            self.stats.bytes += num_bytes
            self.stats.seconds += time.perf_counter() - begin
        self._loaded.put((load.request_id, None))

    def _release_unpulled(self, remote, prompt_token_ids: list[int]) -> None:
        try:
            self._call(remote.remote_host, remote.remote_port, {"op": "release", **_naming(remote, prompt_token_ids)})
        except Exception as e:  # (the producer's abort_timeout_s frees them anyway)
            log.warning("could not release remote request %s's blocks: %s", remote.remote_request_id, e)

    def _call(self, host: str, port: int, request: dict) -> dict:
        """A side-channel call: a refusal raises ValueError (the request's params were wrong), anything else that
        keeps it from an answer raises TransferFailed."""
        try:
            answer = call(host, port, request, SIDE_CHANNEL_TIMEOUT_S)
        except (TimeoutError, ConnectionError) as e:
            raise TransferFailed(str(e)) from None
        if "error" in answer:
            raise (ValueError if answer.get("refused") else TransferFailed)(answer["error"])
        return answer

    def _peer(self, host: str, port: int, engine_id: str) -> _Peer:
        """The producer's layout (asked once per address, and again if the engine there is not the one named: it
        may have restarted), checked against ours."""
        peer = self._peers.get((host, port))
        if peer is None or peer.engine_id != engine_id:
            answer = self._call(host, port, {"op": "layout"})
            peer = _Peer(answer["engine_id"], answer["session"], [tuple(t) for t in answer["tensors"]],
                         answer["block_size"])
            mine = [size for _, size in self._tensors]
            if peer.block_size != self.block_size or [size for _, size in peer.tensors] != mine:
                raise RuntimeError(
                    f"the KV producer at {host}:{port} lays its cache out differently ({len(peer.tensors)} tensors, "
                    f"block_size {peer.block_size}) from this engine ({len(mine)} tensors, block_size "
                    f"{self.block_size}): both sides must serve the same model with the same dtype and block_size")
            with self._lock:
                if (host, port) in self._pools:  # (not a producer evicted meanwhile: _peers stays bounded)
                    self._peers[(host, port)] = peer
        if peer.engine_id != engine_id:
            raise ValueError(f"kv_transfer_params name engine {engine_id!r}, but the engine at {host}:{port} is "
                             f"{peer.engine_id!r}")
        return peer

    def _read(self, peer: _Peer, load: KVLoad) -> tuple[int, int]:
        """Pull the remote blocks into ours: one transfer per run of blocks contiguous on both sides, per tensor.
        Returns (blocks, bytes) moved."""
        pairs = list(zip(load.local_block_ids, load.remote.remote_block_ids))[load.first_block:]
        locals_, remotes, lengths = [], [], []
        for local, remote, count in _runs(pairs):
            for (local_base, size), (remote_base, _) in zip(self._tensors, peer.tensors):
                locals_.append(local_base + local * size)
                remotes.append(remote_base + remote * size)
                lengths.append(count * size)
        if locals_:
            status = self._engine.batch_transfer_sync_read(peer.session, locals_, remotes, lengths)
            if status != 0:
                raise TransferFailed(f"reading {len(pairs)} blocks from {peer.session} failed (status {status})")
        return len(pairs), sum(lengths)


# The side channel's fields, each of one type (absent is allowed: each op says what it needs), so that a peer's
# request cannot reach the producer's bookkeeping with a value it cannot hash or compare.
FIELD_TYPES = {"op": str, "engine_id": str, "request_id": str, "token": str, "block_ids": int,
               "prompt_token_ids": int}
LIST_FIELDS = ("block_ids", "prompt_token_ids")


def _check_types(request: dict) -> None:
    for name, value in request.items():
        if name not in FIELD_TYPES:
            raise ValueError(f"unknown side-channel field {name!r}")
        kind = FIELD_TYPES[name]
        if name in LIST_FIELDS:
            if not (isinstance(value, list) and all(type(v) is kind for v in value)):
                raise ValueError(f"side-channel field {name!r} must be a list of {kind.__name__}")
        elif type(value) is not kind:
            raise ValueError(f"side-channel field {name!r} must be a {kind.__name__}")


def _naming(remote, prompt_token_ids: list[int]) -> dict:
    """What names one prefill to its producer: the engine, the request, its blocks and its prompt."""
    return {"engine_id": remote.remote_engine_id, "request_id": remote.remote_request_id,
            "block_ids": remote.remote_block_ids, "prompt_token_ids": prompt_token_ids}


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(local, remote) block pairs as runs (first local, first remote, count) contiguous on both sides."""
    runs = []
    for local, remote in pairs:
        if runs and runs[-1][0] + runs[-1][2] == local and runs[-1][1] + runs[-1][2] == remote:
            runs[-1][2] += 1
        else:
            runs.append([local, remote, 1])
    return [tuple(run) for run in runs]
