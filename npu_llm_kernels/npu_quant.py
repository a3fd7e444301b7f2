"""W8A8 and W8A16 linear layers on the NPU, as vllm-ascend v0.23.0 runs them (docs/npu.md, section 13). W8A8: its
`AscendW8A8DynamicLinearMethod` (quantization/methods/w8a8_dynamic.py) for dynamic per-token activations, and
`AscendW8A8LinearMethod` (w8a8_static.py) for static ones, whose dequantization scale is input_scale * weight_scale
for compressed-tensors checkpoints.

- Weights: int8 [N, K] transposed to [K, N] and cast to FRACTAL_NZ (`npu_format_cast(w, 29)`, vllm-ascend's
  maybe_trans_nz, which converts int8 weights by default).
- Dynamic: `npu_dynamic_quant(x, dst_type=torch.int8)` gives int8 rows and their fp32 scales (absmax / 127), then
  `npu_quant_matmul(x, w, weight_scale, pertoken_scale=..., bias=..., output_dtype=x.dtype)`.
- Static: `npu_quantize(x, 1 / input_scale (per column), input_offset (per column; zero for compressed-tensors),
  torch.qint8, -1, False)`, then `npu_quant_matmul(x, w, input_scale * weight_scale, bias=..., output_dtype=x.dtype)`,
  the scale as `npu_trans_quant_param`'s int64 for an fp16 output (graph mode takes no fp32 one there).
  An msModelSlim layer's deq_scale and quant_bias arrive here folded (backend/models/quantization.py): its
  weight_scale is deq_scale / input_scale and its bias quant_bias * deq_scale, so the op gets deq_scale back
  (to fp32's rounding) and a float bias where vllm-ascend passes the int32 quant_bias.

The scales go as fp32: npu_quant_matmul's table of supported combinations takes an fp32 scale for bf16 and fp16
outputs alike (vllm-ascend passes a bf16 weight_scale for bf16 models, which the table also allows).
Dynamic quantization here divides by 127, as the op does, where compressed-tensors divides by 127.5: the NPU's
results differ from the CPU's by that rounding, as vllm-ascend's differ from vLLM's.

W8A16, as its `AscendW8A16LinearMethod` (quantization/methods/w8a16.py), but with int8 weights [K, N] in ND (its NZ
runs only in graph mode, by the op's doc),
`npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset, bias=...)`, which dequantizes
(w + offset) * scale inside the matmul. Its scales are per channel [N]; compressed-tensors' grouped ones go as
[K / G, N] with antiquant_group_size G (the op's per-group form). Scales and offsets in x's dtype, as the op requires.
"""
from __future__ import annotations

import torch
import torch_npu

ACL_FORMAT_FRACTAL_NZ = 29


def pack_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [K, N] in FRACTAL_NZ, the layout npu_quant_matmul reads fastest."""
    return torch_npu.npu_format_cast(weight.t().contiguous(), ACL_FORMAT_FRACTAL_NZ)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                bias: torch.Tensor | None = None, input_offset: torch.Tensor | None = None) -> torch.Tensor:
    """torch_ref.int8_linear on the NPU; `weight` as pack_int8_weight left it ([K, N])."""
    flat = x.reshape(-1, x.shape[-1])
    scale = weight_scale.reshape(-1).float()
    bias = None if bias is None else bias.float()
    if input_scale is None:
        quantized, pertoken_scale = torch_npu.npu_dynamic_quant(flat, dst_type=torch.int8)
        y = torch_npu.npu_quant_matmul(quantized, weight, scale, pertoken_scale=pertoken_scale, bias=bias,
                                       output_dtype=x.dtype)
    else:
        k = flat.shape[-1]
        reciprocal = (1.0 / input_scale.float()).to(x.dtype).repeat(k)
        offset = torch.zeros(k, dtype=x.dtype, device=x.device) if input_offset is None else \
            input_offset.to(x.dtype).repeat(k)
        quantized = torch_npu.npu_quantize(flat, reciprocal, offset, torch.qint8, -1, False)
        deq_scale = input_scale.float() * scale
        if x.dtype == torch.float16:
            if bias is not None:
                # Without per-token scales an fp16 output takes an int32 bias only, added to the int32 sums: the
                # float bias over deq_scale (an msModelSlim layer's quant_bias again, exactly, as its fold made it).
                bias = torch.round(bias / deq_scale).to(torch.int32)
            # ... and, in graph mode, an int64 scale only (the op's doc): npu_trans_quant_param's
            deq_scale = torch_npu.npu_trans_quant_param(deq_scale)
        y = torch_npu.npu_quant_matmul(quantized, weight, deq_scale, bias=bias, output_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[1])


def pack_w8a16_weight(weight: torch.Tensor, weight_scale: torch.Tensor, weight_offset: torch.Tensor | None):
    """int8 [N, K] -> [K, N] in ND; scales [N, G] (and offsets [N, 1]) -> [N] per channel, [G, N] per group.
    Not FRACTAL_NZ, which vllm-ascend casts to: npu_weight_quant_batchmatmul's doc takes an NZ weight in graph mode
    only, and prefill steps always run eagerly.
    The op takes groups of a multiple of 32 input features, fewer than K: others fail the load here, not a step."""
    k, groups = weight.shape[1], weight_scale.shape[1]
    if groups > 1 and ((k // groups) % 32 or k // groups >= k):
        raise ValueError(f"W8A16 groups of {k // groups} input features: npu_weight_quant_batchmatmul takes groups of "
                         f"a multiple of 32, fewer than K = {k}")

    def per_column(t):
        return None if t is None else (t.reshape(-1) if t.shape[1] == 1 else t.t().contiguous())
    return weight.t().contiguous(), per_column(weight_scale), per_column(weight_offset)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_offset: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch_ref.w8a16_linear on the NPU; the tensors as pack_w8a16_weight left them. A bf16 x takes an fp32 bias, an
    fp16 one an fp16 bias (the op's table)."""
    flat = x.reshape(-1, x.shape[-1])
    group = weight.shape[0] // weight_scale.shape[0] if weight_scale.dim() == 2 else 0
    if bias is not None:
        bias = bias.to(torch.float32 if x.dtype == torch.bfloat16 else x.dtype)
    y = torch_npu.npu_weight_quant_batchmatmul(
        flat, weight, weight_scale.to(x.dtype), None if weight_offset is None else weight_offset.to(x.dtype),
        bias=bias, antiquant_group_size=group)
    return y.reshape(*x.shape[:-1], weight.shape[1])
