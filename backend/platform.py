"""The device the engine runs on: npu | cuda | cpu, chosen once (auto: npu > cuda > cpu)."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass

import torch

from backend.config import DEVICE_CHOICES


# Ascend defaults (vllm-ascend platform.py and its tuning guide), unless the user set them.
NPU_ENV_DEFAULTS = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "TASK_QUEUE_ENABLE": "1"}
DIST_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


@dataclass(frozen=True)
class Platform:
    name: str  # "npu" | "cuda" | "cpu"
    device: torch.device

    @property
    def dist_backend(self) -> str:
        return DIST_BACKENDS[self.name]

    @property
    def graph_api(self):
        """(graph class, capture context manager, memory-pool factory), or None where torch has no device graphs."""
        if self.name == "cuda":
            return torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.graph_pool_handle
        if self.name == "npu":
            return torch.npu.NPUGraph, torch.npu.graph, torch.npu.graph_pool_handle
        return None

    def synchronize(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.name == "npu":
            torch.npu.synchronize(self.device)


def npu_available() -> bool:
    # Importing torch_npu without CANN fails, so only try where it is installed at all.
    if importlib.util.find_spec("torch_npu") is None:
        return False
    for key, value in NPU_ENV_DEFAULTS.items():  # read when torch_npu initialises
        os.environ.setdefault(key, value)
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return False
    return torch.npu.is_available()


# The variable that narrows which of a host's accelerators a process sees (and in what order).
VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def device_type(device: str = "auto") -> str:
    """npu, cuda or cpu: what `device` names, "auto" resolved (npu > cuda > cpu), without opening a device."""
    if device not in DEVICE_CHOICES and not device.split(":")[0] in DEVICE_CHOICES[1:]:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)} (optionally with :N); got {device!r}")
    name = device.split(":")[0]
    if name == "auto":
        return "npu" if npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_platform(device: str = "auto") -> Platform:
    name = device_type(device)
    if device.split(":")[0] == "auto":
        device = name
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda requested but torch sees no CUDA GPU")
    if name == "npu" and not npu_available():
        raise RuntimeError("device npu requested but torch_npu is not installed or sees no Ascend NPU")
    index = int(device.split(":")[1]) if ":" in device else 0
    if name == "npu":
        from backend.npu_host import check_chip, load_atb_ops

        torch.npu.set_device(index)
        check_chip(torch.npu.get_device_name(index))
        load_atb_ops()
        return Platform(name, torch.device("npu", index))
    return Platform(name, torch.device(name, index) if name != "cpu" else torch.device("cpu"))


def tune_host_allocator() -> None:
    """Keep freed activation buffers in glibc's heap instead of returning them to the OS.

    By default glibc serves blocks above 128 KiB-32 MiB with fresh mmaps and trims the heap
    eagerly, so every step page-faults its activations in again: here that costs ~30% of a
    CPU prefill step. (vLLM's CPU build preloads tcmalloc for the same reason.)
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 * 2**20)  # glibc's maximum
    libc.mallopt(m_trim_threshold, 2**30)
