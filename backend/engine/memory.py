"""How much of an accelerator's memory the KV cache gets: measured, as vLLM and vllm-ascend measure it.

The KV cache takes what is left of `gpu_memory_utilization` of the device once everything else
is accounted for:
- weights (and the rope table): held from load on;
- activations: the peak of the largest steps the scheduler can build (vLLM's profile_run): a prefill
  of `max_num_batched_tokens` tokens, then `max_num_seqs` decodes at `max_model_len` with their
  logits and sampling (ModelRunner.profile_run);
- decode graphs: measured by capturing them once against the scratch block and dropping them,
  since graphs captured for real must read the KV cache they are sized against;
- everything else on the device (the runtime's context, other engines, other processes): what
  mem_get_info reports in use beyond the model's weights.
The caching allocator is emptied before every reading, so freed blocks it keeps do not count as used.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from backend.platform import Platform

log = logging.getLogger(__name__)
GiB = 2**30


@dataclass
class MemorySplit:
    total: int  # the device's memory
    budget: int  # gpu_memory_utilization of it
    weights: int
    activations: int
    graphs: int
    other: int  # in use on the device beyond this model's weights: the runtime's context, other engines, processes

    @property
    def kv_cache(self) -> int:
        return self.budget - self.weights - self.activations - self.graphs - self.other

    def describe(self, num_blocks: int) -> str:
        parts = [f"{name} {value / GiB:.2f}" for name, value in (
            ("weights", self.weights), ("activations", self.activations), ("graphs", self.graphs),
            ("other", self.other), ("KV cache", self.kv_cache))]
        return (f"device memory {self.total / GiB:.2f} GiB, budget {self.budget / GiB:.2f} GiB: "
                f"{', '.join(parts)} GiB ({num_blocks} blocks)")


def device_memory(platform: Platform):
    """torch.cuda or torch.npu: the same memory API on both."""
    return getattr(torch, platform.name)


def settle(platform: Platform) -> None:
    """Free what Python and the caching allocator still hold, so readings show live tensors only."""
    gc.collect()
    device_memory(platform).empty_cache()


def allocated(platform: Platform) -> int:
    """Bytes of live torch tensors on the device (0 on the CPU, where the KV cache has a budget of its own)."""
    return 0 if platform.name == "cpu" else device_memory(platform).memory_allocated(platform.device)


def profile(platform: Platform, utilization: float, weights: int, largest_step, capture_graphs) -> MemorySplit:
    """The split before the KV cache is allocated, for a model of `weights` bytes. largest_step() runs the
    largest step there can be; capture_graphs() captures (and returns) decode graphs against the scratch
    block, or is None in eager mode."""
    memory = device_memory(platform)
    settle(platform)
    baseline = memory.memory_allocated(platform.device)
    memory.reset_peak_memory_stats(platform.device)
    largest_step()
    platform.synchronize()
    activations = memory.max_memory_allocated(platform.device) - baseline
    graphs = 0
    if capture_graphs is not None:
        # What the capture takes from the device: its graphs' pool keeps the memory their temporaries used
        # (reserved, no longer allocated), so free memory is read, with no empty_cache in between.
        settle(platform)
        free_before = memory.mem_get_info(platform.device)[0]
        log.info("capturing the decode graphs once to measure their memory")
        trial = capture_graphs()
        platform.synchronize()
        graphs = free_before - memory.mem_get_info(platform.device)[0]
        del trial  # (its memory goes back before the KV cache is sized)
    settle(platform)
    free, total = memory.mem_get_info(platform.device)
    other = max(0, total - free - weights)  # the runtime's context, and anything not this model's
    return MemorySplit(total, int(total * utilization), weights, activations, graphs, other)
