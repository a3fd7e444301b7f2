"""Which torch_npu release first ships each op npu-llm calls on the NPU (docs/npu.md section 15), and the check that
turns a missing op into an error at load, naming the release to install, instead of an AttributeError at the op's
first call in the middle of a request.

Ops come from Ascend/op-plugin (op_plugin_functions.yaml, the ATB ops' op_plugin/ops/atb/*.cpp), each torch_npu
release building one op-plugin line (Ascend/pytorch's release tags and COMPATIBILITY table). The ops are looked up by
name in the torch_npu at hand, so a build that backports one passes; the table only says what to install.
Imports nothing of torch_npu: `doctor` and the kernels pass the module in.
"""
from __future__ import annotations

from types import ModuleType

# op-plugin line -> the torch_npu releases built from it and the CANN they need
RELEASES = {
    "7.0.0": "torch_npu 2.5.1 (CANN 8.1.RC1)",
    "7.1.0": "torch_npu 2.5.1.post1 or 2.6.0 (CANN 8.2.RC1)",
    "7.2.0": "torch_npu 2.6.0.post3, 2.7.1 or 2.8.0 (CANN 8.3.RC1)",
}

# What each part of a model calls, with the op-plugin line that first has it
OPS = {
    "attention": {
        "_npu_reshape_and_cache": "7.0.0", "_npu_flash_attention": "7.0.0", "_npu_paged_attention": "7.0.0",
        "_npu_paged_attention_splitfuse": "7.0.0", "_npu_rotary_embedding": "7.0.0", "npu_rms_norm": "7.0.0",
        "npu_add_rms_norm": "7.0.0",
    },
    "decode graphs": {"_npu_paged_attention_get_workspace": "7.2.0"},  # (and _npu_paged_attention's workspace=)
    "mixture of experts": {
        "npu_moe_gating_top_k": "7.0.0", "npu_moe_init_routing_v2": "7.0.0", "npu_grouped_matmul": "7.0.0",
        "npu_swiglu": "7.0.0", "npu_moe_token_unpermute": "7.1.0",
    },
    "latent attention (MLA)": {
        "npu_kv_rmsnorm_rope_cache": "7.0.0", "npu_interleave_rope": "7.0.0",
        "npu_fused_infer_attention_score": "7.0.0",
        "npu_fused_infer_attention_score_v2": "7.2.0", "npu_fused_infer_attention_score_v2.out": "7.2.0",
        "_npu_fused_infer_attention_score_v2_get_max_workspace": "7.2.0", "npu_attention_update": "7.2.0",
    },
    "W8A8": {"npu_dynamic_quant": "7.0.0", "npu_quantize": "7.0.0", "npu_quant_matmul": "7.0.0",
             "npu_trans_quant_param": "7.0.0", "npu_format_cast": "7.0.0"},
    "W8A16": {"npu_weight_quant_batchmatmul": "7.0.0"},
    "vision tower": {"npu_rotary_mul": "7.0.0", "npu_fused_infer_attention_score": "7.0.0"},
}


class NpuReleaseError(RuntimeError):
    pass


def _has(torch_npu: ModuleType, op: str) -> bool:
    target = torch_npu
    for part in op.split("."):  # (npu_fused_infer_attention_score_v2.out: an overload, an attribute of the op)
        target = getattr(target, part, None)
        if target is None:
            return False
    return True


def missing(torch_npu: ModuleType, parts) -> dict[str, str]:
    """The ops of `parts` this torch_npu lacks, each with the op-plugin line that first has it."""
    return {op: line for part in parts for op, line in OPS[part].items() if not _has(torch_npu, op)}


def require(torch_npu: ModuleType, parts) -> None:
    """Raise NpuReleaseError naming the release to install if this torch_npu lacks an op of `parts`."""
    absent = missing(torch_npu, parts)
    if absent:
        needed = max(absent.values(), key=lambda line: tuple(map(int, line.split("."))))
        users = [part for part in parts if set(OPS[part]) & set(absent)]
        raise NpuReleaseError(
            f"torch_npu {getattr(torch_npu, '__version__', '?')} lacks {', '.join(sorted(absent))}, which "
            f"{' and '.join(users)} call on the NPU: install {RELEASES[needed]} or later "
            f"(op-plugin {needed}; docs/npu.md section 15)")
