"""Block-pool invariants under random interleavings of add / step / abort / finish."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from backend.engine.kv_cache import KVCacheManager
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import Scheduler
from npu_llm_kernels.metadata import cdiv

BLOCK_SIZE = 4
PARAMS = SamplingParams(max_tokens=64)


def _check_invariants(kv: KVCacheManager, scheduler: Scheduler) -> None:
    holders = Counter(b for r in scheduler.running for b in kv.block_ids(r))
    for r in scheduler.running:
        assert len(set(kv.block_ids(r))) == len(kv.block_ids(r)), "a request holds one block twice"
        assert len(kv.block_ids(r)) * BLOCK_SIZE >= r.num_computed_tokens
    for r in scheduler.waiting:
        assert not kv.block_ids(r), "a waiting request holds blocks"
    assert set(kv.tables) <= {r.request_id for r in scheduler.running}, "a block table outlived its request"
    for block in kv.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == holders[block.block_id], f"block {block.block_id} ref count != its holders"
        if block.ref_count > 1:
            assert block.block_hash is not None, "only prefix-cached blocks may be shared"
        assert (block.ref_count == 0) == (block.block_id in kv.free_queue)
    for block_hash, block_id in kv.cached.items():
        assert kv.blocks[block_id].block_hash == block_hash


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 20)),  # prompt family, length
        st.tuples(st.just("step"), st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.integers(0, 0)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.integers(0, 0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(6, 24), budget=st.integers(1, 16), caching=st.booleans())
def test_blocks_are_never_lost_or_double_owned(ops, num_blocks, budget, caching):
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=caching)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, enable_chunked_prefill=True)
    live: list[Request] = []
    prompt_tokens = computed_tokens = 0  # what the engine's stats must count, preemptions notwithstanding
    for n, (op, a, b) in enumerate(ops):
        if op == "add":
            # prompts of one family share a prefix, so the prefix cache gets hits
            prompt = [a * 100 + i for i in range(b)]
            request = Request(str(n), prompt, PARAMS, max_tokens=8, eos_ids=())
            if cdiv(b + 8, BLOCK_SIZE) <= num_blocks:  # the engine rejects what can never fit
                scheduler.add(request)
                live.append(request)
                prompt_tokens += b
        elif op == "step":
            scheduled = scheduler.schedule()
            sampled = {s.request.request_id: 7 for s in scheduled if s.wants_logits}
            advanced = scheduler.update_from_output(scheduled, sampled)
            scheduler.record_step(scheduled, len(advanced))
            computed_tokens += sum(s.num_new_tokens for s in scheduled)
            for request in advanced:
                if request.finished:
                    live.remove(request)
        elif live:
            request = live.pop(a % len(live))
            scheduler.remove(request)
        _check_invariants(kv, scheduler)
        assert (scheduler.num_prompt_tokens, scheduler.num_computed_tokens) == (prompt_tokens, computed_tokens)
        assert 0 <= scheduler.kv_cache_waste < 1
    for request in live:
        scheduler.remove(request)
    _check_invariants(kv, scheduler)
    assert kv.num_free_blocks == num_blocks
    assert kv.usage == 0


def test_prefix_hit_is_verified_against_token_ids():
    kv = KVCacheManager(8, BLOCK_SIZE)
    first = Request("a", [1, 2, 3, 4, 5], PARAMS, 4, ())
    assert kv.allocate(first, 5)
    first.num_computed_tokens = 5
    kv.cache_full_blocks(first)
    # forge a hash collision: same hash registered, different tokens
    block = kv.blocks[kv.block_ids(first)[0]]
    block.token_ids = (9, 9, 9, 9)
    second = Request("b", [1, 2, 3, 4, 6], PARAMS, 4, ())
    assert kv.find_cached_prefix(second) == []


def test_freed_cached_blocks_are_reused_until_evicted():
    kv = KVCacheManager(3, BLOCK_SIZE)
    first = Request("a", [1, 2, 3, 4, 5], PARAMS, 4, ())
    kv.allocate(first, 5)
    first.num_computed_tokens = 5
    kv.cache_full_blocks(first)
    cached_block = kv.block_ids(first)[0]
    kv.free(first)
    again = Request("b", [1, 2, 3, 4, 9], PARAMS, 4, ())
    assert kv.find_cached_prefix(again) == [cached_block]
    # fill the pool with unrelated blocks: the cached block is evicted last (LRU) but evicted
    other = Request("c", list(range(50, 62)), PARAMS, 4, ())
    assert kv.allocate(other, 12)
    assert kv.find_cached_prefix(again) == []


def test_reset_prefix_cache_forgets_free_blocks_only():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    held, done = Request("held", list(range(8)), PARAMS, 4, ()), Request("done", list(range(100, 108)), PARAMS, 4, ())
    for r in (held, done):
        assert kv.allocate(r, 8)
        r.num_computed_tokens = 8
        kv.cache_full_blocks(r)
    kv.free(done)
    kv.reset_prefix_cache()
    assert kv.find_cached_prefix(Request("again", list(range(100, 108)) + [1], PARAMS, 4, ())) == []
    assert len(kv.find_cached_prefix(Request("same", list(range(8)) + [1], PARAMS, 4, ()))) == 2  # held: still cached
