"""Tensor-parallel ranks as processes of this machine (distributed_executor_backend="mp", the default): spawned
interpreters that meet rank 0 at a file store in a temporary folder."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile

import torch

from backend.config import EngineConfig
from backend.distributed import TensorParallel, init_tensor_parallel
from backend.engine.workers import Workers, run_worker, share_cpu_threads


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


def start_local_workers(config: EngineConfig, device: torch.device) -> tuple[TensorParallel, Workers]:
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
