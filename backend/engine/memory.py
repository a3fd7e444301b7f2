"""How much of an accelerator's memory the KV cache gets: measured, as vLLM and vllm-ascend measure it.

The KV cache takes what is left of `gpu_memory_utilization` of the device once everything else
is accounted for:
- weights (and the rope table): held from load on;
- activations: the peak of one forward pass over `max_num_batched_tokens` tokens plus the logits
  of `max_num_seqs` rows, the largest step the scheduler can build (vLLM's profile_run);
- decode graphs: measured by capturing them once against the scratch block and dropping them,
  since graphs captured for real must read the KV cache they are sized against;
- everything else on the device (the runtime's context, other processes): what mem_get_info
  reports in use beyond torch's own tensors.
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
    other: int  # in use on the device outside torch's tensors

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


def profile(platform: Platform, utilization: float, largest_step, capture_graphs) -> MemorySplit:
    """The split before the KV cache is allocated (only its scratch block is). largest_step() runs the
    largest step there can be; capture_graphs() captures (and returns) decode graphs against the scratch
    block, or is None in eager mode."""
    memory = device_memory(platform)
    settle(platform)
    weights = memory.memory_allocated(platform.device)  # (and the scratch block: one block of KV)
    memory.reset_peak_memory_stats(platform.device)
    largest_step()
    platform.synchronize()
    activations = memory.max_memory_allocated(platform.device) - weights
    graphs = 0
    if capture_graphs is not None:
        settle(platform)
        before = memory.memory_allocated(platform.device)
        trial = capture_graphs()
        graphs = memory.memory_allocated(platform.device) - before
        del trial  # (its memory goes back before the KV cache is sized)
    settle(platform)
    free, total = memory.mem_get_info(platform.device)
    other = max(0, total - free - memory.memory_allocated(platform.device))
    return MemorySplit(total, int(total * utilization), weights, activations, graphs, other)
