"""Tensor-parallel workers as local processes, as vLLM's multiproc executor runs them.

Rank 0 is the engine's own process: it keeps the one scheduler, the KV block accounting and the
sampler. Ranks 1..N-1 are worker processes, each holding its shards of the model and its heads of
the KV cache. Every ModelRunner call that runs the model is broadcast to the workers before rank 0
makes it, so all ranks enter the same collectives in the same order, and rank 0 keeps the result
(the all-gathered logits). The broadcasts go over a gloo group on the CPU; the model's own
all-reduces go over the device's backend (backend/distributed.py). Collectives time out, so a dead
rank fails the step instead of hanging it.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend.config import EngineConfig
from backend.distributed import TensorParallel, init_tensor_parallel, wait_until_all_loaded
from backend.engine.runner import ModelRunner

log = logging.getLogger(__name__)

# The ModelRunner methods that run the model (or size what it runs on): every rank makes each of them.
COLLECTIVE = frozenset({"allocate_kv_cache", "profile_run", "warm_up", "execute"})
STOP = "stop"


class RankFailedError(RuntimeError):
    """A step failed on some rank (it died, hung past the timeout, or raised): the ranks are out of step,
    so no further step can run."""


@dataclass
class Workers:
    """Ranks 1..N-1 as rank 0 sees them."""

    processes: list  # multiprocessing.Process, rank 1 first
    control: object  # the process group the calls are broadcast on
    rendezvous_dir: str  # where the ranks met (torch.distributed's file store)

    def stop(self, graceful: bool) -> None:
        """Gracefully: told to leave their loop, killed if still running after a grace period. Otherwise
        (the ranks are out of step, or never got in step) killed at once."""
        if graceful:
            try:
                _broadcast([STOP, (), {}], self.control)
            except Exception as e:  # a rank died since the last step
                log.warning("could not stop the tensor-parallel workers cleanly: %s", e)
        for process in self.processes:
            process.join(10 if graceful else 0)
            if process.is_alive():
                process.kill()
                process.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)


class ParallelRunner:
    """Rank 0's ModelRunner, whose model-running calls are made on every rank."""

    def __init__(self, runner: ModelRunner, workers: Workers):
        self.runner, self.workers = runner, workers
        self._failed = False  # a step failed: the ranks are out of step and cannot be told anything
        wait_until_all_loaded()

    def __getattr__(self, name: str):
        value = getattr(self.runner, name)
        if name not in COLLECTIVE:
            return value  # state (kv_caches, num_blocks, ...) is rank 0's

        def on_every_rank(*args, **kwargs):
            try:
                _broadcast([name, args, kwargs], self.workers.control)
                return value(*args, **kwargs)
            except Exception as e:
                self._failed = True
                for worker in self.workers.processes:  # a peer that closed its connection is exiting: see it go
                    worker.join(1)
                reason = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
                raise RankFailedError(f"tensor-parallel {name} failed ({self._describe_workers()}): {reason}") from e

        return on_every_rank

    def _describe_workers(self) -> str:
        states = [f"rank {rank} " + ("running" if w.is_alive() else f"exited with code {w.exitcode}")
                  for rank, w in enumerate(self.workers.processes, start=1)]
        return ", ".join(states)

    def shutdown(self) -> None:
        self.workers.stop(graceful=not self._failed)


def start_workers(config: EngineConfig, device_type: str) -> tuple[TensorParallel, Workers]:
    """Spawn ranks 1..N-1 and join them as rank 0."""
    size = config.tensor_parallel_size
    threads = _share_cpu_threads(device_type, size)
    rendezvous_dir = tempfile.mkdtemp(prefix="npu-llm-tp-")
    init_method = f"file://{os.path.join(rendezvous_dir, 'store')}"
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited torch threads or device state
    processes = [context.Process(target=_worker, args=(config, device_type, rank, size, init_method, threads),
                                 name=f"npu-llm-tp{rank}", daemon=True) for rank in range(1, size)]
    for process in processes:
        process.start()
    tp, control = init_tensor_parallel(device_type, 0, size, init_method)
    return tp, Workers(processes, control, rendezvous_dir)


def _share_cpu_threads(device_type: str, size: int) -> int:
    """On the CPU the ranks share its cores: each gets its share of torch's threads (rank 0 sets its own now)."""
    threads = max(1, torch.get_num_threads() // size) if device_type == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    return threads


def _broadcast(message: list, control) -> list:
    dist.broadcast_object_list(message, src=0, group=control)
    return message


def _worker(config: EngineConfig, device_type: str, rank: int, size: int, init_method: str, threads: int) -> None:
    """One rank: its shards of the model, then every call rank 0 broadcasts, until told to stop."""
    from backend.models.loader import load_model
    from backend.models.registry import resolve_model
    from backend.platform import resolve_platform
    from kernels import ops_for

    torch.manual_seed(config.seed)
    torch.set_num_threads(threads)
    platform = resolve_platform(device_type if device_type == "cpu" else f"{device_type}:{rank}")
    tp, control = init_tensor_parallel(device_type, rank, size, init_method)
    model, _, _ = load_model(resolve_model(config.model), ops_for(platform.name), platform.device, config.dtype,
                             config.max_model_len, tp)
    runner = ModelRunner(model, 0, config.block_size, platform.device)
    wait_until_all_loaded()
    with torch.inference_mode():
        while True:
            name, args, kwargs = _broadcast([None, None, None], control)
            if name == STOP:
                break
            getattr(runner, name)(*args, **kwargs)
    dist.destroy_process_group()
