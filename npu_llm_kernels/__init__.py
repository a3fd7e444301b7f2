"""Attention and cache ops with the same signatures on every platform (see torch_ref for the semantics)."""
from __future__ import annotations

from types import ModuleType

from npu_llm_kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "ops_for"]


def ops_for(platform: str) -> ModuleType:
    """The kernel module for a platform name: "cpu", "cuda" or "npu"."""
    if platform == "cpu":
        from npu_llm_kernels import cpu

        return cpu
    if platform == "cuda":
        from npu_llm_kernels import cuda

        return cuda
    if platform == "npu":
        from npu_llm_kernels import npu

        return npu
    raise ValueError(f"unknown platform {platform!r}: expected cpu, cuda or npu")
