"""The fake's torch.distributed backend "hccl": collectives between NPU ranks, run by gloo on the host memory
underneath the device tensors.

As HCCL, it takes device tensors only (a host tensor is refused, as the real backend refuses one), and it
supports what npu-llm's tensor parallelism calls: all_reduce (sum) and all_gather, plus barrier. Each call
is counted in torch_npu.calls ("hccl.allreduce", "hccl.allgather").
"""
from __future__ import annotations

import fake_npu_device
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo


class FakeHccl(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return "hccl"

    def allreduce(self, tensors, opts=None):
        _on_npu("allreduce", tensors)
        if opts is not None and getattr(opts, "reduceOp", dist.ReduceOp.SUM) != dist.ReduceOp.SUM:
            raise RuntimeError("fake hccl: only SUM all-reduces are implemented")
        return self._gloo.allreduce([fake_npu_device.inner(t) for t in tensors])

    def allgather(self, output_lists, inputs, opts=None):
        _on_npu("allgather", inputs + [t for outputs in output_lists for t in outputs])
        return self._gloo.allgather([[fake_npu_device.inner(t) for t in outputs] for outputs in output_lists],
                                    [fake_npu_device.inner(t) for t in inputs])

    def barrier(self, opts=None):
        return self._gloo.barrier()


def _on_npu(op: str, tensors) -> None:
    from torch_npu import _count, _require

    _count(f"hccl.{op}")
    for t in tensors:
        _require(isinstance(t, fake_npu_device.NpuTensor),
                 f"hccl {op}: tensors must be on the NPU, got one on {t.device}")


def _create(store, rank: int, size: int, timeout) -> FakeHccl:
    return FakeHccl(store, rank, size, timeout)


def register() -> None:
    """Once per process (torch keeps a backend's registration for good, while tests import this package anew)."""
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _create, devices=["npu"])
