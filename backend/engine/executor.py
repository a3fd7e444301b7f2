"""Tensor-parallel workers, as vLLM's executors run them: local processes ("mp", backend/engine/local_executor.py),
or Ray actors ("ray", backend/engine/ray_executor.py) so that one engine can span machines; both return the Workers
of backend/engine/workers.py.

Rank 0 is the engine's own process: it keeps the one scheduler, the KV block accounting and the
sampler. Ranks 1..N-1 are workers, each holding its shards of the model and its heads of the KV
cache. Each ModelRunner call that runs the model (ParallelRunner's methods) is broadcast to the
workers before rank 0 makes it, so all ranks enter the same collectives in the same order, and
rank 0 keeps the result (the all-gathered logits). The broadcasts go over a gloo group on the CPU;
the model's own all-reduces go over the device's backend (backend/distributed.py). Collectives time
out, so a dead rank fails the step instead of hanging it.
"""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from backend.config import EngineConfig
from backend.distributed import TensorParallel, wait_until_all_loaded
from backend.engine.runner import ModelRunner, StepOutput
from backend.engine.workers import RankFailedError, Workers


class ParallelRunner:
    """Rank 0's ModelRunner, whose model-running calls are made on every rank. Its state (kv_caches,
    num_blocks, ...) is rank 0's: `runner`."""

    def __init__(self, runner: ModelRunner, workers: Workers):
        self.runner, self.workers = runner, workers
        wait_until_all_loaded()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        return self._on_every_rank("allocate_kv_cache", num_blocks)

    def profile_run(self, num_tokens: int, max_len: int, num_seqs: int) -> torch.Tensor:
        return self._on_every_rank("profile_run", num_tokens, max_len, num_seqs)

    def warm_up(self, num_tokens: int) -> torch.Tensor:
        return self._on_every_rank("warm_up", num_tokens)

    def execute(self, chunks) -> StepOutput:
        return self._on_every_rank("execute", chunks)

    def draft(self, chunks, source: str) -> list[int]:
        return self._on_every_rank("draft", chunks, source)

    @property
    def lora(self):
        """Rank 0's adapters (the other ranks hold the same ones, their shards)."""
        return self.runner.lora

    def add_lora(self, lora) -> None:
        """Rank 0 reads and checks the adapter now; the others read their shards when a step first needs it."""
        self.runner.add_lora(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        return self._on_every_rank("remove_lora", lora_int_id)

    def _on_every_rank(self, name: str, *args):
        try:
            self.workers.broadcast([name, args])
            return getattr(self.runner, name)(*args)
        except Exception as e:
            self.workers.failed = True
            states = ", ".join(f"rank {rank} {state}" for rank, state in enumerate(self.workers.states(1), start=1))
            reason = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            raise RankFailedError(f"tensor-parallel {name} failed ({states}): {reason}") from e


def start_workers(config: EngineConfig, device: torch.device) -> tuple[TensorParallel, Workers]:
    """Start ranks 1..N-1 with config.distributed_executor_backend, and join them as rank 0 (on `device`)."""
    if dist.is_initialized():  # an engine nobody references, but in a reference cycle, leaves it when collected
        gc.collect()
    if dist.is_initialized():  # (checked before any rank starts: none would be left waiting for rank 0)
        raise RuntimeError("this process already has a torch.distributed process group (another tensor-parallel "
                           "engine that is still running?): shut that engine down first (LLM.shutdown())")
    threads_before = torch.get_num_threads()
    if config.distributed_executor_backend == "ray":
        from backend.engine.ray_executor import start_ray_workers

        tp, workers = start_ray_workers(config, device)
    else:
        from backend.engine.local_executor import start_local_workers

        tp, workers = start_local_workers(config, device)
    workers.threads_before = threads_before  # given back when they stop: the next engine shares all of them
    return tp, workers
