"""CPU kernels: torch_ref, with decode attention, the KV cache writes, RMSNorm (with its residual add),
rotary and the MLP's activation done by a small C++ extension (csrc/) when it builds, and bf16 matmuls
from oneDNN-packed weights (computed in fp32 on CPUs without bf16 hardware).

Decode attention is where the portable version spends its time on a CPU: it gathers every
sequence's K/V into a padded copy before attending. The C++ kernel reads K/V in place through
the block table. What runs is chosen by the CPU's level (npu_llm_kernels/cpu_features.py): the extension is
compiled once per level with torch's cpp_extension (cached under TORCH_EXTENSIONS_DIR, one build per
level); without a compiler, or with NPU_LLM_CPU_KERNELS=0, torch_ref is used.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from npu_llm_kernels import torch_ref
from npu_llm_kernels.timing import scope
from npu_llm_kernels.torch_ref import pack_w8a16_weight  # noqa: F401  (W8A16's int8 weights stay [N, K])
from npu_llm_kernels.torch_ref import SKIPS_PAD_SLOTS  # noqa: F401  (csrc's cache write checks every slot)
from npu_llm_kernels.torch_ref import require_ops  # noqa: F401  (csrc is built here, for this CPU)
from npu_llm_kernels.torch_ref import select_experts  # noqa: F401  (the MoE router; the experts are below)
from npu_llm_kernels.torch_ref import vision_attention, vision_rotary  # noqa: F401  (vision towers: torch's SDPA)
from npu_llm_kernels.cpu_features import BUILDS, cpu_features
from npu_llm_kernels.metadata import AttentionMetadata
from npu_llm_kernels.mla import PortableMLA as MLA  # noqa: F401  (latent attention, composed of the ops below)

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
# -fopenmp: at::parallel_for is an OpenMP region in torch's CPU builds.
COMMON_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


class Build(NamedTuple):
    module: object | None  # the extension, or None
    reason: str | None  # why there is no module (None where there is)


@functools.cache
def load_build(name: str) -> Build:
    """The extension built for one of cpu_features.BUILDS, built first where the cache has none.

    Each build is its own module, npu_llm_cpu_kernels_<name>, in its own build directory: a cache shared by
    machines of different levels never hands one of them another's binary. The module says which ISA it was
    compiled for, and one that says otherwise is not used.
    """
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name=f"npu_llm_cpu_kernels_{name}",
            sources=[str(path) for path in SOURCES],
            extra_include_paths=[str(CSRC)],
            extra_cflags=[*COMMON_CFLAGS, *BUILDS[name]],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, unsupported platform
        return _unavailable(f"the {name} build failed: {type(e).__name__}: {str(e).strip()[-300:]}")
    if module.compiled_isa() != name:
        return _unavailable(f"{module.__file__} was compiled for {module.compiled_isa()}, not {name}")
    return Build(module, None)


def _unavailable(reason: str) -> Build:
    log.warning("CPU kernels unavailable (%s); using the portable PyTorch path", reason)
    return Build(None, reason)


def compiled():
    """The extension built for this process's CPU level, or None where it cannot be built or is turned off
    (NPU_LLM_CPU_KERNELS=0, read at each call: each op asks here, and takes torch_ref where the answer is None)."""
    if not _enabled():
        return None
    return load_build(cpu_features().build).module


def unavailable_reason() -> str | None:
    """Why the extension is not in use, or None where it is."""
    if not _enabled():
        return "NPU_LLM_CPU_KERNELS=0"
    return load_build(cpu_features().build).reason


# Below so many rows a matmul is bound by streaming its weights, not by arithmetic (a decode step of one or
# a few sequences): there bf16 weights, half the bytes, beat fp32 ones. Measured on SmolLM2's matmuls, with
# ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA holding torch and oneDNN to AVX2 or to AVX-512 without bf16: the
# AVX2 kernel csrc/linear_bf16_avx2.cpp on bf16 weights was 1.1-2x faster than fp32-packed weights at 1 to 4
# rows, and 1-6x faster than oneDNN's emulated bf16 (decode of 2 and 4 sequences: 1.35-1.7x end to end). Where
# that kernel is not built, oneDNN's bf16 packing takes up to 3 rows with AVX-512 (measured 1.2-2.4x faster than
# fp32 on a Xeon without bf16 hardware), and torch's own bf16 F.linear 1 row without (1.25-1.6x faster than
# fp32-packed weights there, level at 2 rows and slower above). From 5 rows the AVX2 kernel takes the rows 4 at a
# time on each stripe of weights (a speculative verification's k + 1 positions): at level avx2, on a Zen 3, it was
# 1.3-1.45x faster than fp32-packed weights at 5 to 8 rows, level at 12 to 16 and slower from 20. At level avx512
# (oneDNN's fp32 GEMM in AVX-512) those calls were not measured, and keep the fp32-packed weights from 5 rows.
FEW_ROWS_AVX2_KERNEL = 9
FEW_ROWS_AVX2_KERNEL_AVX512 = 5
FEW_ROWS = 4
FEW_ROWS_TORCH_BF16 = 2


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weights in the layout of the CPU level's fastest matmul. Other dtypes stay as they are.

    With AVX512-BF16 (level avx512_bf16), in stripes for csrc/linear_bf16_avx512.cpp (see _in_linear_stripes):
    1.2-1.6x faster than oneDNN's matmul at decode sizes on weights streamed from memory, level at prefill sizes;
    fp32 sums rounded to bf16 once, as oneDNN's, in their own order (an MLP's [gate | up] also with the activation
    in the same pass: linear_silu_and_mul). With AMX, in oneDNN's blocked layout, for its
    AMX tiles (the stripes were not measured there): 2-3.5x faster matmuls than F.linear at decode batch sizes, a
    little faster at prefill sizes, bit-identical results. Elsewhere
    the weights are packed as fp32 and `linear` runs in fp32: like a bf16 GEMM it accumulates in fp32 and
    rounds the output to bf16 once, so results agree with F.linear to bf16 rounding (summation order aside).
    That packed tensor carries bf16 weights too, as `few_rows`, for calls of fewer than `few_rows_below` rows
    (see FEW_ROWS_AVX2_KERNEL): the weights as they are, for the AVX2 kernel (or torch's F.linear where it is
    not built); without that kernel but with AVX-512, oneDNN's bf16 packing. Below AVX-512 oneDNN refuses bf16
    (its reorder raises), so no oneDNN bf16 packing is made there. Three times the bf16 weights' memory in all.
    On aarch64 the weights stay as they are, for F.linear.
    """
    features = cpu_features()
    if (weight.dtype != torch.bfloat16 or not features.x86 or not torch.backends.mkldnn.is_available()
            or not _enabled()):
        return weight
    ext = compiled()
    if features.level == "avx512_bf16" and ext is not None and ext.has_linear_bf16_stripes():
        return _in_linear_stripes(weight)
    if features.native_bf16:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    fp32 = torch.ops.mkldnn._reorder_linear_weight(weight.float().contiguous(), None)
    if _avx2_linear():
        fp32.few_rows = weight.contiguous()
        fp32.few_rows_below = FEW_ROWS_AVX2_KERNEL if features.level == "avx2" else FEW_ROWS_AVX2_KERNEL_AVX512
    elif features.onednn_bf16:
        fp32.few_rows = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        fp32.few_rows_below = FEW_ROWS
    else:
        fp32.few_rows, fp32.few_rows_below = weight.contiguous(), FEW_ROWS_TORCH_BF16
    return fp32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if hasattr(weight, "unpacked_shape"):  # _in_linear_stripes'
        ext = compiled()
        if ext is None or x.dtype != torch.bfloat16:  # (NPU_LLM_CPU_KERNELS=0 after packing)
            return F.linear(x, _unstriped(weight).to(x.dtype), bias)
        return ext.linear_bf16_stripes(x, weight, bias, *weight.unpacked_shape)
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    if weight.dtype != x.dtype and x.numel() < weight.few_rows_below * x.shape[-1]:
        few_rows = weight.few_rows
        kernel = None if few_rows.is_mkldnn else _avx2_linear()
        return kernel(x, few_rows, bias) if kernel else linear(x, few_rows, bias)
    if weight.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")
    # fp32-packed weights of a bf16 model (see pack_linear_weight)
    bias = None if bias is None else bias.float()
    return torch.ops.mkldnn._linear_pointwise(x.float(), weight, bias, "none", [None], "").to(x.dtype)


# Output columns per stripe of csrc/linear_bf16_avx512.cpp's weights (its kStripe).
LINEAR_STRIPE = 64


def _in_linear_stripes(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] as csrc/linear_bf16_avx512.cpp reads it: stripes of 64 output columns with k in pairs, [N / 64,
    K / 2, 64, 2] (stored as [N / 64, K, 64]), N padded with zero rows to a multiple of 64 and K with a zero column
    to even (so K above is the even one). `unpacked_shape` keeps (N, K), the matmul's own."""
    n, k = weight.shape
    padded = F.pad(weight, (0, k % 2, 0, -n % LINEAR_STRIPE))
    packed = _in_stripes(padded[None], LINEAR_STRIPE, pairs=True)[0]
    packed.unpacked_shape = (n, k)
    return packed


def _unstriped(weight: torch.Tensor) -> torch.Tensor:
    """_in_linear_stripes' weights back as [N, K]."""
    n, k = weight.unpacked_shape
    return _whole(weight[None], pairs=True)[0, :n, :k]


# From this many rows, with VNNI, oneDNN's int8 GEMM on prepacked weights (the AMX tiles' where the CPU has AMX-INT8);
# below, the AVX2 kernel, for layers of up to SMALL_INT8_LAYER weights. Measured on a Sapphire Rapids (AMX; bf16
# activations, whole calls): on the default model's layers (K 576-1536, N 576-3072) the kernel took 12-30 us at 1 row
# against oneDNN's 34-47, 26-67 against 39-49 at 4 rows, and from 8 rows oneDNN was faster (at 64 rows 63-153 us
# against 322-941). On a 7B-sized layer (K 4096, N 11008) the two were level at 1 row (939 and 977 us) and oneDNN
# faster from 4. On an AMD Zen 4 (AVX512-VNNI, no AMX) only oneDNN's GEMM on weights it reordered each call was
# measured (torch._int_mm: at 8 rows 102-113 us against the kernel's 68-85), hence 16 there.
ONEDNN_INT8_ROWS_AMX = 4
ONEDNN_INT8_ROWS = 16
# Up to this many weights, a layer keeps its plain int8 weights beside the prepacked ones, for the AVX2 kernel's
# few-row calls (where the fixed cost of oneDNN's three-step call dominates): twice the int8 bytes, as many as bf16,
# on small layers only. Larger layers hold the prepacked weights alone, half of bf16's bytes, and oneDNN takes every
# call.
SMALL_INT8_LAYER = 1 << 22


def pack_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K]: with VNNI, prepacked for oneDNN's int8 GEMM (`onednn.qlinear_prepack`, its blocked
    layout for this CPU, reordered once here instead of at each call), with the zero points of its weights, and for
    small layers the plain weights as `.plain`; elsewhere, or where the extension's ends of that call (which need
    AVX2) or K a multiple of 16 are missing, as they are."""
    ext = compiled()
    if not (cpu_features().vnni and torch.backends.mkldnn.is_available() and ext is not None
            and ext.has_linear_int8_weights() and weight.shape[1] % 16 == 0):
        return weight
    weight = weight.contiguous()
    packed = torch.ops.onednn.qlinear_prepack(weight, None)
    packed.zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    packed.out_features = weight.shape[0]
    if weight.numel() <= SMALL_INT8_LAYER:
        packed.plain = weight
    return packed


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                bias: torch.Tensor | None = None, input_offset: torch.Tensor | None = None) -> torch.Tensor:
    """torch_ref.int8_linear's W8A8 matmul, with the weights int8 in memory and the int8 products summed exactly.

    Weights pack_int8_weight prepacked (VNNI), from ONEDNN_INT8_ROWS rows (from one, for large layers): the
    extension quantizes the rows in one pass (as q + 128 in uint8, the zero point oneDNN's fast kernels take), oneDNN's
    int8 GEMM (`onednn.qlinear_pointwise`, int32 sums times the weight scales, in fp32) multiplies, and the extension
    scales each row and adds the bias in one pass. Other int8 weights (the experts'), with VNNI: oneDNN's int8 GEMM
    through torch._int_mm on activations quantized by torch_ref. Without VNNI oneDNN's int8 GEMM is not used: it
    multiplies through 16-bit intermediates that saturate on full-range int8 weights (measured on an AVX2 EPYC:
    errors of 2.3 on outputs of 14; exact with |w| <= 63). There, and below ONEDNN_INT8_ROWS rows, the extension's
    kernel (csrc/linear_int8_avx2.cpp) quantizes the activations (fp32 or bf16) and multiplies in 16 bits with 32-bit
    sums. Elsewhere (no extension, K not a multiple of 16, fp16): torch_ref.
    """
    features, ext = cpu_features(), compiled()
    kernel = ext is not None and ext.has_linear_int8_weights() and x.shape[-1] % 16 == 0 and \
        x.dtype in (torch.float32, torch.bfloat16)
    few = x.numel() // x.shape[-1] < (ONEDNN_INT8_ROWS_AMX if features.level == "amx" else ONEDNN_INT8_ROWS)
    if hasattr(weight, "out_features"):  # prepacked
        if not (kernel and few and hasattr(weight, "plain")):
            return _onednn_int8_linear(x, weight, weight_scale, input_scale, bias, input_offset,
                                       ext if kernel else None)
        weight = weight.plain
    if features.vnni and _enabled() and not (kernel and few):
        return torch_ref.int8_linear(x, weight, weight_scale, input_scale, bias, input_offset,
                                     int8_matmul=_onednn_int8_matmul)
    if kernel:
        return ext.linear_int8_weights(x, weight, weight_scale, input_scale, bias, input_offset)
    return torch_ref.int8_linear(x, weight, weight_scale, input_scale, bias, input_offset)


def _onednn_int8_linear(x, packed, weight_scale, input_scale, bias, input_offset, ext) -> torch.Tensor:
    """Rows quantized (as q + 128 in uint8: zero point 128), oneDNN's int8 GEMM on the prepacked weights (sums times
    the weight scales, in fp32), then times each row's scale, plus the bias: each end one pass of the extension where
    it applies (`ext`), else torch_ref's arithmetic in torch (fp16 activations; NPU_LLM_CPU_KERNELS=0 after packing)."""
    flat = x.reshape(-1, x.shape[-1])
    if ext is not None:
        q, row_scales = ext.quantize_rows_u8(flat, input_scale, input_offset)
    else:
        q, row_scales = torch_ref.quantize_int8(flat, input_scale, input_offset)
        q, row_scales = (q + 128).to(torch.uint8), row_scales.expand(flat.shape[0], 1).reshape(-1)
    sums = torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, packed, weight_scale.reshape(-1).float(),
                                              packed.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
    if ext is not None:
        y = ext.scale_int8_sums(sums, row_scales, bias, x.dtype == torch.bfloat16)
    else:
        y = sums * row_scales.view(-1, 1)
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], packed.out_features)


def _onednn_int8_matmul(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch._int_mm(q.to(torch.int8), weight.t()).float()


# W8A16 below this many rows: csrc/linear_w8a16.cpp, dequantizing in its inner loop; from it, blocks of weights
# dequantized by the extension and multiplied by torch (oneDNN). Measured in docs/quantization.md.
W8A16_KERNEL_ROWS = 16


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_offset: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch_ref.w8a16_linear with the weights int8 in memory. A few rows: the AVX2 kernel, which widens each weight
    to fp32 in registers as it multiplies. More: torch_ref's blocks, each dequantized in one pass by the extension,
    to bf16 where the CPU multiplies bf16 in hardware (else to fp32, which oneDNN multiplies faster than emulated
    bf16), and multiplied by oneDNN. fp16, K or groups not a multiple of 8, or no extension: torch_ref."""
    ext, k = compiled(), weight.shape[1]
    if ext is None or x.dtype not in (torch.float32, torch.bfloat16) or (k // weight_scale.shape[1]) % 8:
        return torch_ref.w8a16_linear(x, weight, weight_scale, weight_offset, bias)
    if x.numel() < W8A16_KERNEL_ROWS * k and ext.has_linear_w8a16():
        return ext.linear_w8a16(x, weight, weight_scale, weight_offset, bias)
    bf16 = x.dtype == torch.bfloat16 and cpu_features().native_bf16
    compute = torch.bfloat16 if bf16 else torch.float32

    def dequantize(w, scale, offset, _dtype):
        return ext.dequantize_int8(w, scale, offset, bf16)
    y = torch_ref.w8a16_linear(x.to(compute), weight, weight_scale, weight_offset,
                               None if bias is None else bias.to(compute), dequantize=dequantize)
    return y.to(x.dtype)


def _avx2_linear():
    """csrc/linear_bf16_avx2.cpp's few-rows matmul on bf16 weights, where this level's build has it (every x86
    build from avx2 up), else None."""
    ext = compiled()
    return ext.linear_bf16_weights if ext is not None and ext.has_linear_bf16_weights() else None


# The activations csrc/lora_cpu.cpp takes (its weights are fp32 for both).
LORA_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def pack_lora_weights(shrink: torch.Tensor, expand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_ref's layout; in fp32 for the extension's lora_add where it takes the model's dtype (the adapter is a
    few MB)."""
    if compiled() is None or shrink.dtype not in LORA_KERNEL_DTYPES:
        return torch_ref.pack_lora_weights(shrink, expand)
    return torch_ref.pack_lora_weights(shrink.float(), expand.float())


def lora_add(y: torch.Tensor, x: torch.Tensor, segments: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
    """torch_ref.lora_add, every segment in one call of csrc/lora_cpu.cpp where the extension is built."""
    ext = compiled()
    if ext is None or not segments or y.dtype not in LORA_KERNEL_DTYPES or segments[0][2].dtype != torch.float32:
        return torch_ref.lora_add(y, x, segments)
    ext.lora_add(y, x.contiguous(), [b for start, end, _, _ in segments for b in (start, end)],
                 [s[2] for s in segments], [s[3] for s in segments])


def _enabled() -> bool:
    return os.environ.get("NPU_LLM_CPU_KERNELS", "1") != "0"


def decode_attention(query, key_cache, value_cache, metadata: AttentionMetadata, scale: float):
    ext = compiled()
    if ext is None:
        return torch_ref.decode_attention(query, key_cache, value_cache, metadata, scale)
    n = query.shape[0]
    return ext.paged_decode_attention(
        query, key_cache, value_cache, metadata.block_tables[:n], metadata.context_lens_tensor[:n], scale
    )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping: torch.Tensor) -> None:
    ext = compiled()
    if ext is None:
        return torch_ref.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    ext.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale: float):
    return torch_ref.attend(query, key, value, key_cache, value_cache, metadata, scale, decode_attention,
                            prefill_attention)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch_ref.prefill_attention; in bf16 on an AVX512-BF16 build, csrc/prefill_attention_avx512.cpp (5-8x torch's
    CPU flash attention on head dims of 64 and 128 and a few hundred tokens, where its per-block library calls
    dominate)."""
    ext = compiled()
    if (ext is None or not ext.has_prefill_attention() or q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16
            or v.dtype != torch.bfloat16 or q.shape[-1] % 2 or v.shape[-1] % 16 or q.stride(-1) != 1
            or k.stride(-1) != 1 or v.stride(-1) != 1):
        return torch_ref.prefill_attention(q, k, v, scale)
    return ext.prefill_attention(q, k, v, scale)


# Fused elementwise ops (csrc/fused_ops_cpu.cpp, silu_and_mul_cpu.cpp): one pass over memory each instead of
# torch_ref's two to eight.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = compiled()
    return torch_ref.rms_norm(x, weight, eps) if ext is None else ext.rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    ext = compiled()
    if ext is None:
        return torch_ref.add_rms_norm(x, residual, weight, eps)
    normed, summed = ext.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)
    return normed, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    ext = compiled()
    return torch_ref.silu_and_mul(x) if ext is None else ext.silu_and_mul(x.contiguous())


def matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """torch_ref.matmul_dtype: bf16 where the CPU multiplies bf16 natively (AVX512-BF16, AMX: torch's bf16 bmm there
    is 3.6x its fp32 one at MLA's per-head shapes, 16 x [64, 128] x [128, 512], on a Zen 5); every other dtype, and
    bf16 elsewhere, in fp32 (oneDNN emulates bf16 there at a fraction of its fp32 speed: torch's bf16 bmm ~30x slower
    on AVX2; fp16 has no fast CPU path)."""
    return dtype if dtype == torch.bfloat16 and cpu_features().native_bf16 else torch.float32


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch_ref.linear_silu_and_mul; on bf16 stripes whose gate and up halves are whole stripes, in one pass
    (csrc/linear_bf16_avx512.cpp, gated): the same bits as silu_and_mul(linear(..)), without [gate | up] written out
    and read back."""
    with scope("matmul"):  # (fused, the activation is timed with the matmul it rides in)
        if hasattr(weight, "unpacked_shape") and x.dtype == torch.bfloat16:
            rows, k = weight.unpacked_shape
            ext = compiled()
            if ext is not None and rows % (2 * LINEAR_STRIPE) == 0:
                return ext.linear_bf16_stripes(x, weight, bias, rows // 2, k, gated=True)
        gate_up = linear(x, weight, bias)
    return silu_and_mul(gate_up)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor):
    ext = compiled()
    if ext is None:
        return torch_ref.rotary_embedding(positions, query, key, cos_sin_cache)
    q, k = ext.rotary_embedding(positions, query, key, cos_sin_cache)
    return q, k


# fp32 experts with this many tokens or more run their matmuls through oneDNN, fewer through csrc/fused_moe_cpu.cpp's
# own tiles. oneDNN's matmul wants the weights whole, so each such call first puts one expert's stripes back together:
# on Sapphire Rapids (W3's layer) that paid from about 192 tokens. bf16 experts on AVX512-BF16 stay on the tiles
# (csrc/stripe_tile.h) at every size: on a Zen 5 they were level with oneDNN up to 1024 tokens and 1.4-1.7x faster at
# a 2048-token prefill chunk (W3's, W4's and a 1024 x 768 layer), where oneDNN's one call per busy expert, each on
# weights put back together, ran at 380-450 GFLOP/s against the tiles' 640-670 (W3 offline 1.12x, W4 1.05x).
ONEDNN_EXPERT_TOKENS = 192
# On AMX, bf16 experts with this many tokens or more run on AMX tiles instead, through oneDNN's brgemm microkernel on
# the packed weights as they lie (no copy). On W3's layer (64 experts, top-8; `npu-llm bench moe`), against the
# tiles and oneDNN's matmul: 2.3x faster at 512 tokens, 1.8-2.5x at 2048, 1.4-3x at 64 and 128 (8 and 16 per expert).
# Nearer 2 per expert this machine's noise hid any difference. Without AMX (AVX512-BF16 alone, oneDNN held there by
# ONEDNN_MAX_CPU_ISA) brgemm measured level with the tiles, so that level keeps them.
BRGEMM_EXPERT_TOKENS = 5


def pack_expert_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For csrc/fused_moe_cpu.cpp, where this build has it: each expert's [N, K] weight as [N / S, K, S], stripes of
    S output columns, K-major inside (so each of the kernel's tasks streams one contiguous block). Else as they are,
    for torch_ref."""
    ext = compiled()
    stripe = ext.expert_stripe() if ext is not None and ext.has_fused_experts() else 0
    if not stripe or w13.dtype not in (torch.float32, torch.bfloat16) or w13.shape[1] % stripe or w2.shape[1] % stripe:
        return w13, w2
    pairs = w13.dtype == torch.bfloat16 and ext.expert_pairs()  # AVX512-BF16: k in pairs, for its dot products
    if pairs and (w13.shape[2] % 2 or w2.shape[2] % 2):
        return w13, w2
    w13, w2 = _in_stripes(w13, stripe, pairs), _in_stripes(w2, stripe, pairs)
    w13.stripes = w2.stripes = "pairs" if pairs else "single"
    return w13, w2


def _in_stripes(w: torch.Tensor, stripe: int, pairs: bool) -> torch.Tensor:
    """[E, N, K] as [E, N / S, K, S], or in pairs of k, [E, N / S, K / 2, S, 2] (stored as [E, N / S, K, S])."""
    experts, n, k = w.shape
    if not pairs:
        return w.view(experts, n // stripe, stripe, k).transpose(2, 3).contiguous()
    paired = w.view(experts, n // stripe, stripe, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()
    return paired.view(experts, n // stripe, k, stripe)


def _whole(w: torch.Tensor, pairs: bool) -> torch.Tensor:
    """_in_stripes' stripes back as [E, N, K]."""
    experts, stripes, k, stripe = w.shape
    if pairs:
        paired = w.view(experts, stripes, k // 2, stripe, 2).permute(0, 1, 3, 2, 4)
        return paired.reshape(experts, stripes * stripe, k)
    return w.transpose(2, 3).reshape(experts, stripes * stripe, k)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """torch_ref.fused_experts in one C++ call on the weights pack_expert_weights put in stripes; else the
    per-expert loop."""
    ext = compiled()
    with scope("moe.experts"):
        if not getattr(w13, "stripes", False):
            return torch_ref.fused_experts(x, w13, w2, topk_weights, topk_ids, first_expert)
        if ext is None:  # (NPU_LLM_CPU_KERNELS=0 after packing)
            whole13, whole2 = (_whole(w, w.stripes == "pairs") for w in (w13, w2))
            return torch_ref.fused_experts(x, whole13, whole2, topk_weights, topk_ids, first_expert)
        amx = w13.stripes == "pairs" and cpu_features().level == "amx"
        onednn_from = ONEDNN_EXPERT_TOKENS if x.dtype == torch.float32 else 0
        return ext.fused_experts(x.contiguous(), w13, w2, topk_weights, topk_ids, first_expert, onednn_from,
                                 BRGEMM_EXPERT_TOKENS if amx else 0)


def fused_experts_int8(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                       w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       first_expert: int = 0) -> torch.Tensor:
    """torch_ref's per-expert loop for W8A8 dynamic experts, each expert's two matmuls on int8_linear (this CPU
    level's int8 kernel, on the weights pack_int8_expert_weights prepacked where it did). (A fused kernel over int8
    experts, as fused_experts has for float ones, is not written.)"""
    with scope("moe.experts"):
        return torch_ref.fused_experts_int8(x, getattr(w13, "experts", w13), getattr(w2, "experts", w2), w13_scale,
                                            w2_scale, topk_weights, topk_ids, first_expert, linear=int8_linear)


def pack_int8_expert_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's int8 weights as pack_int8_weight packs a linear layer's (with VNNI: prepacked for oneDNN), as the
    list `.experts` of the stacked tensors, which stay (fused_experts_int8 reads the list where there is one)."""
    for stacked in (w13, w2):
        packed = [pack_int8_weight(stacked[e]) for e in range(stacked.shape[0])]
        if any(hasattr(p, "out_features") for p in packed):
            stacked.experts = packed
    return w13, w2


def describe() -> str:
    """The CPU level and what runs at it, for the start-up log and `doctor`."""
    features, reason = cpu_features(), unavailable_reason()
    kernels = f"C++ kernels: the {features.build} build" if reason is None else f"no C++ kernels ({reason})"
    return f"{features.describe()}; {kernels}"
