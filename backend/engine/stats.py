"""What the engine reports of itself, for metrics and the UI: EngineInfo, fixed once it has started (its device, the
KV cache's size), and EngineStats, after each step (vLLM's scheduler stats: the scheduler's counters, the KV
cache's use, the experts' load, the drafter's and the KV connector's counts)."""
from __future__ import annotations

from dataclasses import dataclass, field

from backend.engine.kv_cache import KVCacheManager
from backend.engine.kv_transfer.connector import KVConnector, TransferStats
from backend.engine.scheduler import Scheduler
from backend.engine.spec_decode import Drafter, SpecDecodeStats


@dataclass(frozen=True)
class EngineInfo:
    device: str  # e.g. "cpu", "npu:0"
    platform: str  # "cpu", "cuda" or "npu"
    num_kv_blocks: int
    dtype: str  # the model's and its KV cache's, e.g. "bfloat16"


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests
    prefix_cache_hit_rate: float  # prompt tokens found in the prefix cache / looked up
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_computed_tokens: int  # tokens run through the model
    num_prompt_tokens: int  # prompt tokens of admitted requests
    num_generation_tokens: int
    num_steps: int
    kv_cache_waste: float  # allocated but unused slots / allocated, averaged over steps
    num_kv_blocks: int
    expert_load: list[int] = field(default_factory=list)  # MoE: (token, expert) pairs served per rank
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding: drafts made and accepted
    kv_transfer: TransferStats | None = None  # with a KV connector: what it moved and held
    num_transferring: int = 0  # requests whose blocks a transfer holds: being pulled here, or kept for a consumer
    # with enable_lora: max_loras, and the adapters of the running and of the waiting requests (name -> requests)
    max_loras: int | None = None
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)


def collect_stats(scheduler: Scheduler, kv: KVCacheManager, model, drafter: Drafter | None,
                  kv_connector: KVConnector | None) -> EngineStats:
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + len(scheduler.loading) + len(scheduler.loaded),
        kv_cache_usage=kv.usage,
        prefix_cache_hit_rate=kv.prefix_hit_rate,
        prefix_cache_queries=kv.prefix_queries,
        prefix_cache_hits=kv.prefix_hits,
        num_preemptions=scheduler.num_preemptions,
        num_computed_tokens=scheduler.num_computed_tokens,
        num_prompt_tokens=scheduler.num_prompt_tokens,
        num_generation_tokens=scheduler.num_generation_tokens,
        num_steps=scheduler.num_steps,
        kv_cache_waste=scheduler.kv_cache_waste,
        num_kv_blocks=kv.num_blocks,
        expert_load=model.expert_load(),
        spec_decode=None if drafter is None else drafter.stats.copy(),
        kv_transfer=None if kv_connector is None else kv_connector.stats.copy(),
        num_transferring=len(scheduler.loading) + len(scheduler.sending),
        max_loras=scheduler.max_loras,
        running_lora_adapters=_adapters(scheduler.running),
        waiting_lora_adapters=_adapters(scheduler.waiting),
    )


def _adapters(requests) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in list(requests):
        if request.lora_name is not None:
            counts[request.lora_name] = counts.get(request.lora_name, 0) + 1
    return counts
