"""KV block pool: reference counts, a free queue, and a prefix cache keyed by a hash chain.

A full block's hash chains its parent's hash with its own token ids, so equal hashes mean
equal prefixes (a hit still compares token ids, to be safe from collisions). The hash is SHA-256 (vLLM's default),
the same in every process and on every host, so that it also keys blocks in a KV pool other engines share
(backend/engine/kv_transfer/kv_pool.py). Freed blocks
keep their hash and stay reusable until the free queue hands them out again (LRU).
The manager owns every request's block table (as vLLM v1's KVCacheManager does).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from backend.engine.request import Request
from npu_llm_kernels.metadata import cdiv


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # set while the block is in the prefix cache


def chain_root(request: Request) -> bytes:
    """Where a request's hash chain starts: nothing for the base model, its adapter's name and path for a LoRA."""
    lora = request.lora_request
    return b"" if lora is None else hashlib.sha256("\0".join(lora.cache_key).encode()).digest()


def chain_hash(parent: bytes, token_ids: list[int], images: bytes = b"") -> bytes:
    """A block's hash: its parent's, then its token ids (as 64-bit integers, so that no two lists share bytes), then
    the hashes of the images its tokens show (32 bytes each)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes() + images).digest()


def block_hash_chain(request: Request, num_blocks: int, block_size: int) -> list[bytes]:
    """Hash chain of the request's first num_blocks full blocks, extended incrementally on the request. The chain
    starts from the request's adapter (vLLM puts the LoRA's name and path in the block hash): the same tokens under two
    adapters, or under one and the base model, have different KV and never share a block. A block covering an image's
    placeholder tokens adds the image's hash (as vLLM's extra keys do), so the same text with another image differs
    from there on."""
    hashes, mm = request.block_hashes, request.mm_inputs
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else chain_root(request)
        start, stop = i * block_size, (i + 1) * block_size
        hashes.append(chain_hash(parent, request.token_ids[start:stop], mm.hashes_in(start, stop) if mm else b""))
    return hashes[:num_blocks]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks={num_blocks}: need at least one KV block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evicted first
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.tables: dict[str, list[int]] = {}  # request id -> its block ids, in token order
        self._registered: dict[str, int] = {}  # request id -> leading blocks already offered to the prefix cache
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    # -- statistics -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table (empty while it holds no blocks)."""
        return self.tables.get(request.request_id, [])

    # -- prefix cache -----------------------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        return block_hash_chain(request, num_blocks, self.block_size)

    def _block_tokens(self, request: Request, i: int) -> tuple[int, ...]:
        return tuple(request.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached run of the request's full blocks.

        The last token is never taken from the cache: it must run to produce logits. Nor is any token of a request
        that asks for prompt logprobs and has not yet been through its prompt: a cached block has no logits.
        """
        if not self.enable_prefix_caching:
            return []
        if request.params.prompt_logprobs is not None and not request.output_token_ids:
            return []
        found = []
        for i, block_hash in enumerate(self.block_hashes(request, (len(request.token_ids) - 1) // self.block_size)):
            block_id = self.cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(request, i):
                break
            found.append(block_id)
        return found

    def record_lookup(self, request: Request, num_cached_tokens: int) -> None:
        """Count an admitted request's prompt against the prefix-cache hit rate."""
        self.prefix_queries += request.num_prompt_tokens
        self.prefix_hits += min(num_cached_tokens, request.num_prompt_tokens)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        hashes = self.block_hashes(request, num_full)
        table = self.block_ids(request)
        registered = self._registered.get(request.request_id, 0)
        for i in range(registered, num_full):
            block_hash = hashes[i]
            block = self.blocks[table[i]]
            # a hit is cached already; an identical block computed meanwhile by another request stays the cached one
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash, block.token_ids = block_hash, self._block_tokens(request, i)
                self.cached[block_hash] = block.block_id
        self._registered[request.request_id] = max(registered, num_full)

    # -- allocation -------------------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Give the request blocks for num_computed + num_new_tokens tokens; False (nothing changed) if they don't fit.

        cached_block_ids (admission only) are prefix-cache hits that become the start of its table.
        """
        total = request.num_computed_tokens + num_new_tokens
        needed = cdiv(total, self.block_size) - len(self.block_ids(request)) - len(cached_block_ids)
        # hits that sit in the free queue stop being free once taken
        reclaimed = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if needed > self.num_free_blocks - reclaimed:
            return False
        table = self.tables.setdefault(request.request_id, [])
        for block_id in cached_block_ids:
            self._take(block_id)
        table.extend(cached_block_ids)
        for _ in range(max(needed, 0)):
            block_id = next(iter(self.free_queue))
            self._evict(block_id)
            self._take(block_id)
            table.append(block_id)
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return the request's blocks beyond its first num_tokens tokens (those speculative drafts took and lost):
        they hold no computed token, so nothing is cached in them, and they are handed out first."""
        table = self.block_ids(request)
        while len(table) > cdiv(num_tokens, self.block_size):
            block = self.blocks[table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
                self.free_queue.move_to_end(block.block_id, last=False)

    def free(self, request: Request) -> None:
        """Return the request's blocks; its tail blocks queue for eviction before its head."""
        for block_id in reversed(self.tables.pop(request.request_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        self._registered.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (vLLM's reset_prefix_cache), e.g. between benchmark runs."""
        for block_id in self.free_queue:
            self._evict(block_id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = block.token_ids = None
