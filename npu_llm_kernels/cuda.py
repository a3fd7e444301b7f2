"""CUDA kernels: torch_ref's ops run as they are on CUDA tensors (scaled_dot_product_attention picks
flash or memory-efficient attention there), so this module only names the CUDA op set. Where a CUDA
version must differ from the reference (a flash-attention varlen or paged kernel), it goes here and
tests/test_cuda.py holds it to torch_ref."""
from __future__ import annotations

from npu_llm_kernels.torch_ref import (  # noqa: F401
    MLA,
    SKIPS_PAD_SLOTS,
    add_rms_norm,
    decode_graph_widths,
    fused_experts,
    fused_experts_int8,
    int8_linear,
    pack_int8_expert_weights,
    pack_int8_weight,
    pack_w8a16_weight,
    linear,
    linear_silu_and_mul,
    matmul_dtype,
    lora_add,
    pack_expert_weights,
    pack_lora_weights,
    pack_linear_weight,
    paged_attention,
    prefill_attention,
    require_ops,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    select_experts,
    silu_and_mul,
    vision_attention,
    vision_rotary,
    w8a16_linear,
)
