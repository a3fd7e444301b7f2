"""Tensor parallelism's communication: the one place the model talks to other ranks (torch.distributed).

hccl on the NPU, nccl on CUDA, gloo on the CPU. The model only calls all_reduce and all_gather; a group
of one (SINGLE, the default) does neither, so a model built without tensor parallelism runs exactly
the code it ran before. Collectives time out (timeout()) instead of waiting forever on a dead rank.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from npu_llm_kernels.timing import scope

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
STARTUP_TIMEOUT = timedelta(minutes=10)  # for every rank to load its shards


def timeout() -> timedelta:
    """How long a collective waits for a rank that does not come (hung, or dead) before it fails."""
    return timedelta(seconds=float(os.environ.get("NPU_LLM_DISTRIBUTED_TIMEOUT_S", "60")))


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # the torch.distributed process group of the ranks

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, rows), which must divide evenly."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} must divide {what} ({total})")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (row-parallel layers' partial results)."""
        if self.size > 1:
            with scope("all_reduce"):  # (its time shows in the profiler's step breakdown)
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dimension in rank order (vocab-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with scope("all_gather"):
            dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


def init_tensor_parallel(device_type: str, rank: int, size: int, init_method: str) -> tuple[TensorParallel, object]:
    """Join the ranks (every rank calls this with the same size and init_method): this rank's TensorParallel
    (the model's collectives, on the device's backend) and a gloo group for the steps' broadcasts, both
    timing out after timeout(). The default group is gloo with a start-up timeout: loading a large model's
    shards takes longer than any step may."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=STARTUP_TIMEOUT)
    model_group = dist.new_group(backend=BACKENDS[device_type], timeout=timeout())
    control = dist.new_group(backend="gloo", timeout=timeout())
    return TensorParallel(rank, size, model_group), control


def wait_until_all_loaded() -> None:
    """Every rank calls this once its shards are loaded; it returns when all have (or after STARTUP_TIMEOUT)."""
    dist.barrier()
