"""Tensor-parallel ranks 1..N-1 as rank 0 sees them, whichever executor started them (backend/engine/executor.py):
the Workers every executor returns, the loop each rank runs (run_worker), and how the ranks share the CPU.

Each ModelRunner call that runs the model is broadcast to the ranks before rank 0 makes it (ParallelRunner), so all
ranks enter the same collectives in the same order. The broadcasts go over a gloo group on the CPU; the model's own
all-reduces go over the device's backend (backend/distributed.py).
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from backend.config import EngineConfig
from backend.distributed import init_tensor_parallel, wait_until_all_loaded
from backend.engine.runner import ModelRunner

log = logging.getLogger(__name__)

STOP = "stop"


class RankFailedError(RuntimeError):
    """A step failed on some rank (it died, hung past the timeout, or raised): the ranks are out of step,
    so no further step can run."""


class Workers(ABC):
    """Ranks 1..N-1 as rank 0 sees them: the group the calls are broadcast on, and the ranks' lives."""

    def __init__(self, control):
        self.control = control
        self.failed = False  # a step failed: the ranks are out of step and cannot be told anything
        self.stopped = False
        self.threads_before: int | None = None  # rank 0's torch threads before it shared the CPU with the ranks

    def broadcast(self, message: list) -> None:
        dist.broadcast_object_list(message, src=0, group=self.control)

    def shutdown(self) -> None:
        """Stop the ranks: gracefully, unless a step failed."""
        self.stop(graceful=not self.failed)

    def stop(self, graceful: bool) -> None:
        """Gracefully: told to leave their loop, killed if still running after a grace period. Otherwise
        (the ranks are out of step, or never got in step) killed at once. Only the first call does anything.
        Rank 0 leaves the process group too, so that another engine of this process can start its own."""
        if self.stopped:
            return
        self.stopped = True
        try:
            if graceful:
                try:
                    # (ranks that are gone already, e.g. at interpreter exit, cannot be told anything)
                    if all(state == "running" for state in self.states()):
                        self.broadcast([STOP, ()])
                except Exception as e:  # a rank died since the last step
                    log.warning("could not stop the tensor-parallel workers cleanly: %s", e)
            self._end(grace_s=10 if graceful else 0)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            if self.threads_before is not None:
                torch.set_num_threads(self.threads_before)

    @abstractmethod
    def _end(self, grace_s: float) -> None:
        """Wait up to grace_s for each rank to exit, then kill what is left, and release what they held."""

    @abstractmethod
    def states(self, wait_s: float = 0) -> list[str]:
        """Each rank's state ("running", or how it ended), rank 1 first; waits up to wait_s for ranks that are
        exiting (a peer that closed its connection is on its way out)."""


# What a worker may be asked to run: ParallelRunner's calls.
RUNNER_CALLS = frozenset({"allocate_kv_cache", "profile_run", "warm_up", "execute", "draft", "remove_lora"})


def share_cpu_threads(device_type: str, size: int) -> int:
    """On the CPU the ranks share its cores: each gets its share of torch's threads (rank 0 sets its own now)."""
    threads = max(1, torch.get_num_threads() // size) if device_type == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    return threads


def run_worker(config: EngineConfig, device: str, rank: int, size: int, init_method: str, threads: int) -> None:
    """One rank: its shards of the model on `device`, then every call rank 0 broadcasts, until told to stop."""
    from backend.engine.lora_manager import LoRAManager
    from backend.models.loader import load_model
    from backend.models.registry import resolve_model
    from backend.platform import resolve_platform
    from npu_llm_kernels import ops_for

    torch.manual_seed(config.seed)
    torch.set_num_threads(threads)
    platform = resolve_platform(device)
    tp, control = init_tensor_parallel(platform.name, rank, size, init_method)
    spec = config.speculative
    model, _, _ = load_model(resolve_model(config.model), ops_for(platform.name), platform.device, config.dtype,
                             config.max_model_len, tp, config.enable_expert_parallel,
                             mtp=spec is not None and spec.uses_mtp, quantization=config.quantization,
                             head=(spec.method, spec.model) if spec is not None and spec.uses_eagle else None)
    runner = ModelRunner(model, 0, config.block_size, platform.device, LoRAManager.for_config(model, config))
    wait_until_all_loaded()
    with torch.inference_mode():
        while True:
            message = [None, None]
            dist.broadcast_object_list(message, src=0, group=control)
            name, args = message
            if name == STOP:
                break
            if name not in RUNNER_CALLS:
                raise RuntimeError(f"rank {rank} was asked to run {name!r}, which is not a runner call")
            getattr(runner, name)(*args)
    dist.destroy_process_group()
