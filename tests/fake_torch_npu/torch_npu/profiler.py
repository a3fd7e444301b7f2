"""torch_npu.profiler as npu-llm uses it (vllm-ascend's worker does the same): profile(activities=
[ProfilerActivity.CPU, ProfilerActivity.NPU], on_trace_ready=tensorboard_trace_handler(dir)) with
start() / stop().

The real handler writes DIR/{worker_name}_{timestamp}_ascend_pt/, worker_name defaulting to
{hostname}_{pid}, and its parsed output ASCEND_PROFILER_OUTPUT/trace_view.json is a Chrome trace
(Ascend PyTorch Profiler docs, tensorboard_trace_handler). Here torch.profiler records the CPU side
and writes that file in that place.
"""
from __future__ import annotations

import enum
import os
import socket
import time
from pathlib import Path

import torch


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


def tensorboard_trace_handler(dir_name: str | None = None, worker_name: str | None = None, analyse_flag: bool = True):
    worker = worker_name or f"{socket.gethostname()}_{os.getpid()}"

    def handler(prof: "profile") -> None:
        stamp = time.strftime("%Y%m%d%H%M%S") + f"{int(time.time() * 1000) % 1000:03d}"
        out = Path(dir_name or ".") / f"{worker}_{stamp}_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
        out.mkdir(parents=True, exist_ok=True)
        prof._torch.export_chrome_trace(str(out / "trace_view.json"))

    return handler


class profile:
    def __init__(self, activities=None, on_trace_ready=None, **_options):
        activities = list(activities or [ProfilerActivity.CPU, ProfilerActivity.NPU])
        if not all(isinstance(a, ProfilerActivity) for a in activities):
            raise TypeError("torch_npu.profiler.profile: activities must be torch_npu.profiler.ProfilerActivity members")
        self.activities = activities
        self.on_trace_ready = on_trace_ready
        self._torch = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.started = False

    def start(self) -> None:
        self._torch.start()
        self.started = True

    def stop(self) -> None:
        if not self.started:
            raise RuntimeError("torch_npu.profiler.profile: stop() before start()")
        self._torch.stop()
        self.started = False
        if self.on_trace_ready is not None:
            self.on_trace_ready(self)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False
