"""The fake's W8A8 and W8A16 ops, as vllm-ascend v0.23.0's w8a8 (static), w8a8_dynamic and w8a16 linear methods call
them.

Schemas: op-plugin master op_plugin_functions.yaml. Semantics and refusals: each op's doc (docs/npu.md section 13):
npu_dynamic_quant (scale = row absmax / 127, y = round(x / scale)), npu_quantize with div_mode=False
(y = int8(x * scales + zero_points)), npu_quant_matmul (x1 @ x2 * scale [* pertoken_scale] + bias, with its table
of supported scale, bias, pertoken and output dtypes on A2/A3), npu_format_cast (layout only; the fake records the
format, get_npu_format reads it), npu_weight_quant_batchmatmul (x @ ((weight + antiquant_offset) * antiquant_scale)
+ bias, the scale and offset [N] per channel or [ceil(K / group), N] per group, in x's dtype; an NZ weight in graph
mode only), npu_trans_quant_param (an fp32 scale as npu_quant_matmul's int64). Modes vllm-ascend does not use raise
as "not part of the fake".
"""
from __future__ import annotations

import torch

from . import _graphs
from . import _count, _not_in_fake, _on_device, _require

ND, NZ = 2, 29
_HALF = (torch.float16, torch.bfloat16)
_INPUT = (torch.float32, *_HALF)


def npu_format_cast(input, acl_format, customize_dtype=None):
    name = "npu_format_cast"
    _count(name)
    _on_device(name, input=input)
    _require(acl_format in (ND, NZ), f"{name}: the fake knows formats {ND} (ND) and {NZ} (FRACTAL_NZ), got {acl_format}")
    _not_in_fake(name, customize_dtype is None, "customize_dtype")
    _require(acl_format == ND or input.dim() >= 2, f"{name}: FRACTAL_NZ needs at least 2 dims")
    out = input.clone()  # a new tensor; the logical values are unchanged
    out.npu_format = acl_format
    return out


def get_npu_format(tensor) -> int:
    return getattr(tensor, "npu_format", ND)


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    name = "npu_dynamic_quant"
    _count(name)
    _on_device(name, input=input)
    _require(input.dtype in _HALF, f"{name}: input must be float16/bfloat16, got {input.dtype}")
    _require(input.dim() > 1, f"{name}: input must have more than one dim, got {input.dim()}")
    _require(dst_type in (None, torch.int8), f"{name}: dst_type must be int8 (or None) on A2/A3, got {dst_type}")
    _not_in_fake(name, smooth_scales is None and group_index is None and quant_mode == "pertoken"
                 and dst_type_max == 0.0, "smoothing, groups or other modes")
    y = torch.empty(input.shape, dtype=torch.int8, device=input.device)
    scale = torch.empty(input.shape[:-1], dtype=torch.float32, device=input.device)
    _graphs.launch(_dynamic_quant, ("y", "scale"), x=input, y=y, scale=scale)
    return y, scale


def _dynamic_quant(x, y, scale):
    x = x.float()
    s = x.abs().amax(dim=-1) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)  # a zero row: any scale gives zeros
    y.copy_(torch.round(x / s.unsqueeze(-1)).clamp(-128, 127).to(torch.int8))
    scale.copy_(s)


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    name = "npu_quantize"
    _count(name)
    _on_device(name, input=input, scales=scales)
    _require(input.dtype in _INPUT, f"{name}: input must be float32/float16/bfloat16, got {input.dtype}")
    _require(dtype == torch.qint8, f"{name}: the fake quantizes to torch.qint8 (vllm-ascend's), got {dtype}")
    _not_in_fake(name, not div_mode, "div_mode=True")
    size = input.shape[axis]
    for arg, t in (("scales", scales), ("zero_points", zero_points)):
        if t is None:
            continue
        _on_device(name, **{arg: t})
        _require(t.dtype == input.dtype, f"{name}: with div_mode=False {arg} must be the input's dtype {input.dtype}, "
                                         f"got {t.dtype}")
        _require(t.dim() == 1 and t.shape[0] in (1, size),
                 f"{name}: {arg} must be 1-D of size 1 or input.shape[axis] ({size}), got {list(t.shape)}")
    y = torch.empty(input.shape, dtype=torch.int8, device=input.device)
    _graphs.launch(_quantize, ("y",), x=input, scales=scales, zero_points=zero_points, y=y)
    return y


def _quantize(x, scales, zero_points, y):
    v = x.float() * scales.float()
    if zero_points is not None:
        v = v + zero_points.float()
    y.copy_(torch.round(v).clamp(-128, 127).to(torch.int8))


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, x1_dtype=None,
                     x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None, y_scale=None):
    name = "npu_quant_matmul"
    _count(name)
    _on_device(name, x1=x1, x2=x2, scale=scale)
    _not_in_fake(name, all(a is None for a in (offset, x1_dtype, x2_dtype, pertoken_scale_dtype, scale_dtype,
                                               group_sizes, y_scale)), "offsets, dtype overrides or groups")
    _require(x1.dtype == torch.int8 and x2.dtype == torch.int8, f"{name}: x1 and x2 must be int8, got {x1.dtype}, "
                                                                f"{x2.dtype}")
    _require(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0],
             f"{name}: x1 [M, K] and x2 [K, N], got {list(x1.shape)} and {list(x2.shape)}")
    k, n = x2.shape
    _require(k <= 65535 and n <= 65535, f"{name}: the last dims must be <= 65535")
    _require(output_dtype in _HALF, f"{name}: the fake covers bf16/fp16 outputs (vllm-ascend's), got {output_dtype}")
    _require(scale.dim() == 1 and scale.shape[0] in (1, n), f"{name}: scale must be 1-D [1] or [N={n}]")
    if output_dtype == torch.bfloat16:
        _require(scale.dtype in (torch.float32, torch.bfloat16), f"{name}: a bf16 output takes an fp32 or bf16 scale, "
                                                                f"got {scale.dtype}")
    else:
        allowed = (torch.float32,) if pertoken_scale is not None else (torch.float32, torch.int64)
        _require(scale.dtype in allowed, f"{name}: an fp16 output takes a {' or '.join(map(str, allowed))} scale "
                                         f"here, got {scale.dtype}")
        # the doc: "when the output is int8 or float16 and there is no pertoken_scale, graph mode does not support
        # passing scale directly as float32" (npu_trans_quant_param's int64 instead)
        _require(pertoken_scale is not None or scale.dtype == torch.int64 or not _graphs.is_capturing(),
                 f"{name}: under graph capture an fp16 output without pertoken_scale takes an int64 scale from "
                 "npu_trans_quant_param, not float32")
    if pertoken_scale is not None:
        _on_device(name, pertoken_scale=pertoken_scale)
        _require(pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == (x1.shape[0],),
                 f"{name}: pertoken_scale must be fp32 [M={x1.shape[0]}], got {pertoken_scale.dtype} "
                 f"{list(pertoken_scale.shape)}")
    if bias is not None:
        _on_device(name, bias=bias)
        _require(bias.shape == (n,), f"{name}: bias must be [N={n}], got {list(bias.shape)}")
        _require(bias.dtype in (torch.int32, torch.float32, torch.bfloat16),
                 f"{name}: bias must be int32, fp32 or bf16, got {bias.dtype}")
        _require(bias.dtype == torch.int32 or output_dtype == torch.bfloat16 or pertoken_scale is not None,
                 f"{name}: an fp16 output without pertoken_scale takes an int32 bias, got {bias.dtype}")
    y = torch.empty(x1.shape[0], n, dtype=output_dtype, device=x1.device)
    _graphs.launch(_quant_matmul, ("y",), x1=x1, x2=x2, scale=scale, pertoken_scale=pertoken_scale, bias=bias, y=y)
    return y


def npu_trans_quant_param(scale, offset=None, round_mode=0):
    """fp32 scales as the int64 npu_quant_matmul takes: the scale cut to FP19 (its low 13 mantissa bits cleared) in
    bits 0-31, bit 46 set (the doc's formula; offsets are not part of the fake)."""
    name = "npu_trans_quant_param"
    _count(name)
    _on_device(name, scale=scale)
    _require(scale.dtype == torch.float32 and scale.dim() in (1, 2), f"{name}: scale must be 1-D or 2-D float32, "
                                                                     f"got {scale.dim()}-D {scale.dtype}")
    _not_in_fake(name, offset is None and round_mode == 0, "offsets or another round_mode")
    bits = scale.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFE000
    return bits | (1 << 46)


def _dequant_scale(scale: torch.Tensor) -> torch.Tensor:
    """The fp32 scale an int64 one (npu_trans_quant_param's) carries, or a float scale as it is."""
    if scale.dtype != torch.int64:
        return scale.float()
    return (scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32)


def _quant_matmul(x1, x2, scale, pertoken_scale, bias, y):
    sums = x1.int() @ x2.int()  # int32 accumulation; an int32 bias joins the sums, a float one the result
    if bias is not None and bias.dtype == torch.int32:
        sums = sums + bias
    out = sums.float() * _dequant_scale(scale)
    if pertoken_scale is not None:
        out = out * pertoken_scale.unsqueeze(-1)
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    y.copy_(out)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
    name = "npu_weight_quant_batchmatmul"
    _count(name)
    _on_device(name, x=x, weight=weight, antiquant_scale=antiquant_scale)
    _not_in_fake(name, quant_scale is None and quant_offset is None, "a quantized (int8) output")
    _require(x.dtype in _HALF, f"{name}: x must be fp16 or bf16, got {x.dtype}")
    _require(weight.dtype == torch.int8, f"{name}: the fake covers int8 weights (W8A16), got {weight.dtype}")
    # the doc: "when weight is FRACTAL_NZ, single-op (eager) invocation is not yet supported; only graph mode"
    _require(get_npu_format(weight) == ND or _graphs.is_capturing(),
             f"{name}: a FRACTAL_NZ weight runs only in graph mode; an eager call takes it in ND")
    _require(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[0],
             f"{name}: x [M, K] and weight [K, N], got {list(x.shape)} and {list(weight.shape)}")
    k, n = weight.shape
    _not_in_fake(name, antiquant_scale.dtype != torch.int64, "an int64 (fp16 per-channel) antiquant_scale")
    _require(antiquant_scale.dtype == x.dtype, f"{name}: antiquant_scale must be in x's dtype {x.dtype}, got "
                                               f"{antiquant_scale.dtype}")
    if antiquant_group_size:
        _require(antiquant_group_size % 32 == 0 and 32 <= antiquant_group_size <= k - 1,
                 f"{name}: antiquant_group_size must be a multiple of 32 in [32, K - 1], got {antiquant_group_size}")
        groups = -(-k // antiquant_group_size)
        _require(tuple(antiquant_scale.shape) == (groups, n),
                 f"{name}: per group, antiquant_scale must be [ceil(K / group) = {groups}, N = {n}], got "
                 f"{list(antiquant_scale.shape)}")
    else:
        _require(antiquant_scale.numel() in (1, n) and antiquant_scale.dim() <= 2
                 and (antiquant_scale.dim() < 2 or antiquant_scale.shape[0] == 1),
                 f"{name}: per channel, antiquant_scale must be [N = {n}], [1, N] or [1], got "
                 f"{list(antiquant_scale.shape)}")
    if antiquant_offset is not None:
        _on_device(name, antiquant_offset=antiquant_offset)
        _require(antiquant_offset.dtype == antiquant_scale.dtype and antiquant_offset.shape == antiquant_scale.shape,
                 f"{name}: antiquant_offset must match antiquant_scale's dtype and shape")
    if bias is not None:
        _on_device(name, bias=bias)
        _require(bias.numel() == n, f"{name}: bias must hold N = {n} values, got {list(bias.shape)}")
        _require(bias.dtype == (torch.float32 if x.dtype == torch.bfloat16 else torch.float16),
                 f"{name}: a {x.dtype} x takes a {'float32' if x.dtype == torch.bfloat16 else 'float16'} bias, "
                 f"got {bias.dtype}")
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    _graphs.launch(_weight_quant_matmul, ("y",), x=x, weight=weight, scale=antiquant_scale, offset=antiquant_offset,
                   group=antiquant_group_size, bias=bias, y=y)
    return y


def _weight_quant_matmul(x, weight, scale, offset, group, bias, y):
    """weight [K, N]: dequantized in fp32, each group of `group` rows of K (or all of K) with its row of scales."""
    k, n = weight.shape
    w = weight.float() if offset is None else weight.float() + offset.float().reshape(-1, n).repeat_interleave(
        group or k, dim=0)[:k]
    w = w * scale.float().reshape(-1, n).repeat_interleave(group or k, dim=0)[:k]
    out = x.float() @ w.to(x.dtype).float()
    if bias is not None:
        out = out + bias.float().reshape(n)
    y.copy_(out)
