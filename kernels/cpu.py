"""CPU kernels: torch_ref, with decode attention, the KV cache writes, RMSNorm (with its residual add),
rotary and the MLP's activation done by a small C++ extension (csrc/) when it builds, and bf16 matmuls
from oneDNN-packed weights (computed in fp32 on CPUs without bf16 hardware).

Decode attention is where the portable version spends its time on a CPU: it gathers every
sequence's K/V into a padded copy before attending. The C++ kernel reads K/V in place through
the block table. It is compiled once per machine with torch's cpp_extension (cached under
TORCH_EXTENSIONS_DIR); without a compiler, or with NPU_LLM_CPU_KERNELS=0, torch_ref is used.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import torch_ref
from kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))


@functools.cache
def compiled():
    """The built extension module, or None where it cannot be built."""
    if not _enabled():
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="npu_llm_cpu_kernels",
            sources=[str(path) for path in SOURCES],
            extra_include_paths=[str(CSRC)],
            # -fopenmp: at::parallel_for is an OpenMP region in torch's CPU builds. GCC vectorizes for AVX-512
            # CPUs with 256-bit vectors unless told otherwise: 512 made the norms and rotary 15% faster.
            extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno",
                          "-fno-trapping-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, unsupported platform
        log.warning("CPU attention kernel unavailable (%s); using the portable PyTorch path", e)
        return None


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


# Below this many rows a matmul is bound by streaming its weights, not by arithmetic (a decode step
# of one or two sequences): there the bf16 copy, half the bytes, is faster than fp32 (measured 1.2-2.4x).
FEW_ROWS = 4


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weights in oneDNN's blocked layout. Other dtypes stay as they are.

    Where the CPU multiplies bf16 in hardware, the weights stay bf16: 2-3.5x faster matmuls than
    F.linear at decode batch sizes, a little faster at prefill sizes, bit-identical results. Elsewhere
    oneDNN emulates bf16 at about a quarter of its fp32 speed, so the weights are packed as fp32 and
    `linear` runs in fp32: like a bf16 GEMM it accumulates in fp32 and rounds the output to bf16 once,
    so results agree with F.linear to bf16 rounding (summation order aside). That packed tensor carries
    the bf16 packing too, as `few_rows`, for calls of fewer than FEW_ROWS rows: three times the bf16
    weights' memory in all.
    """
    if weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available() or not _enabled():
        return weight
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    if native_bf16():
        return packed
    fp32 = torch.ops.mkldnn._reorder_linear_weight(weight.float().contiguous(), None)
    fp32.few_rows = packed
    return fp32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    if weight.dtype != x.dtype and x.numel() < FEW_ROWS * x.shape[-1]:
        weight = weight.few_rows
    if weight.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")
    # fp32-packed weights of a bf16 model (see pack_linear_weight)
    bias = None if bias is None else bias.float()
    return torch.ops.mkldnn._linear_pointwise(x.float(), weight, bias, "none", [None], "").to(x.dtype)


def _extension():
    """The extension for this call, or None for torch_ref (NPU_LLM_CPU_KERNELS=0 is read at each call)."""
    return compiled() if _enabled() else None


def _enabled() -> bool:
    return os.environ.get("NPU_LLM_CPU_KERNELS", "1") != "0"


def decode_attention(query, key_cache, value_cache, metadata: AttentionMetadata, scale: float):
    ext = _extension()
    if ext is None:
        return torch_ref.decode_attention(query, key_cache, value_cache, metadata, scale)
    n = query.shape[0]
    return ext.paged_decode_attention(
        query, key_cache, value_cache, metadata.block_tables[:n], metadata.context_lens_tensor[:n], scale
    )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping: torch.Tensor) -> None:
    ext = _extension()
    if ext is None:
        return torch_ref.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    ext.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale: float):
    return torch_ref.attend(query, key, value, key_cache, value_cache, metadata, scale, decode_attention)


# Fused elementwise ops (csrc/fused_ops_cpu.cpp, silu_and_mul_cpu.cpp): one pass over memory each instead of
# torch_ref's two to eight.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = _extension()
    return torch_ref.rms_norm(x, weight, eps) if ext is None else ext.rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    ext = _extension()
    if ext is None:
        return torch_ref.add_rms_norm(x, residual, weight, eps)
    normed, summed = ext.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)
    return normed, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    ext = _extension()
    return torch_ref.silu_and_mul(x) if ext is None else ext.silu_and_mul(x.contiguous())


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor):
    ext = _extension()
    if ext is None:
        return torch_ref.rotary_embedding(positions, query, key, cos_sin_cache)
    q, k = ext.rotary_embedding(positions, query, key, cos_sin_cache)
    return q, k
