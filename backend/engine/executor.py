"""Tensor-parallel workers, as vLLM's executors run them: local processes ("mp"), or Ray actors ("ray",
backend/engine/ray_executor.py) so that one engine can span machines.

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
import logging
import multiprocessing
import os
import shutil
import tempfile
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from backend.config import EngineConfig
from backend.distributed import TensorParallel, init_tensor_parallel, wait_until_all_loaded
from backend.engine.runner import ModelRunner, StepOutput

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


class LocalWorkers(Workers):
    """Ranks as processes of this machine (multiprocessing, spawned)."""

    def __init__(self, processes: list, control, rendezvous_dir: str):
        super().__init__(control)
        self.processes = processes  # multiprocessing.Process, rank 1 first
        self.rendezvous_dir = rendezvous_dir  # where the ranks met (torch.distributed's file store)

    def _end(self, grace_s: float) -> None:
        for process in self.processes:
            process.join(grace_s)
            if process.is_alive():
                process.kill()
                process.join(5)
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)

    def states(self, wait_s: float = 0) -> list[str]:
        for process in self.processes:
            process.join(wait_s)
        return ["running" if p.is_alive() else f"exited with code {p.exitcode}" for p in self.processes]


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

    def _on_every_rank(self, name: str, *args):
        try:
            self.workers.broadcast([name, args])
            return getattr(self.runner, name)(*args)
        except Exception as e:
            self.workers.failed = True
            states = ", ".join(f"rank {rank} {state}" for rank, state in enumerate(self.workers.states(1), start=1))
            reason = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            raise RankFailedError(f"tensor-parallel {name} failed ({states}): {reason}") from e


# What a worker may be asked to run: ParallelRunner's calls.
RUNNER_CALLS = frozenset({"allocate_kv_cache", "profile_run", "warm_up", "execute"})


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
        tp, workers = _start_local_workers(config, device)
    workers.threads_before = threads_before  # given back when they stop: the next engine shares all of them
    return tp, workers


def _start_local_workers(config: EngineConfig, device: torch.device) -> tuple[TensorParallel, Workers]:
    size = config.tensor_parallel_size
    threads = share_cpu_threads(device.type, size)
    rendezvous_dir = tempfile.mkdtemp(prefix="npu-llm-tp-")
    init_method = f"file://{os.path.join(rendezvous_dir, 'store')}"
    first = device.index or 0  # rank r uses the r-th device after rank 0's
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited torch threads or device state
    processes = [context.Process(target=run_worker, name=f"npu-llm-tp{rank}", daemon=True, args=(
        config, "cpu" if device.type == "cpu" else f"{device.type}:{first + rank}", rank, size, init_method, threads))
        for rank in range(1, size)]
    for process in processes:
        process.start()
    tp, control = init_tensor_parallel(device.type, 0, size, init_method)
    return tp, LocalWorkers(processes, control, rendezvous_dir)


def share_cpu_threads(device_type: str, size: int) -> int:
    """On the CPU the ranks share its cores: each gets its share of torch's threads (rank 0 sets its own now)."""
    threads = max(1, torch.get_num_threads() // size) if device_type == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    return threads


def run_worker(config: EngineConfig, device: str, rank: int, size: int, init_method: str, threads: int) -> None:
    """One rank: its shards of the model on `device`, then every call rank 0 broadcasts, until told to stop."""
    from backend.models.loader import load_model
    from backend.models.registry import resolve_model
    from backend.platform import resolve_platform
    from npu_llm_kernels import ops_for

    torch.manual_seed(config.seed)
    torch.set_num_threads(threads)
    platform = resolve_platform(device)
    tp, control = init_tensor_parallel(platform.name, rank, size, init_method)
    model, _, _ = load_model(resolve_model(config.model), ops_for(platform.name), platform.device, config.dtype,
                             config.max_model_len, tp, config.enable_expert_parallel,
                             quantization=config.quantization)
    runner = ModelRunner(model, 0, config.block_size, platform.device)
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
