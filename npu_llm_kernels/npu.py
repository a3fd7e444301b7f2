"""Ascend NPU kernels: torch_npu's fused paged-attention op set, called as vllm-ascend calls it.

Sources (see docs/npu.md): op schemas from Ascend/op-plugin (branch 7.1.0, the
torch_npu 2.5.1.post1 line) op_plugin/ops/atb/*.cpp; call sites from vllm-ascend v0.9.1
(attention/attention_v1.py, attention/attention.py, ops/layernorm.py, ops/rotary_embedding.py).
ATB ops return nothing and write their outputs in place; outputs must be contiguous; lengths
(seq_len, context_lens) go as CPU int32 ("otherwise error: tensor.hostData is null").
Only fp16 and bf16 run on these ops; block size must be 128.
The MoE ops (select_experts, fused_experts): torch_npu's public MoE ops, called with the arguments
vllm-ascend v0.23.0 passes (ops/fused_moe/, device/device_op.py), schemas from op-plugin master; the MLA ops
likewise, in npu_mla.py.
"""
from __future__ import annotations

import weakref

import torch
import torch_npu

from npu_llm_kernels import npu_releases
from npu_llm_kernels.metadata import AttentionMetadata, GraphCapture
from npu_llm_kernels.npu_mla import NpuMLA as MLA  # noqa: F401  (DeepSeek's latent attention: its own ops)
from npu_llm_kernels.npu_quant import (  # noqa: F401  (W8A8, W8A16)
    ACL_FORMAT_FRACTAL_NZ, int8_linear, pack_int8_weight, pack_w8a16_weight, w8a16_linear,
)
from npu_llm_kernels.timing import scope
from npu_llm_kernels.torch_ref import (  # noqa: F401  (plain torch on the NPU)
    linear, linear_silu_and_mul, matmul_dtype, pack_linear_weight, silu_and_mul,
)
# LoRA's shrink and expand as torch matmuls: vllm-ascend's punica ops are AscendC kernels of its own, not torch_npu's
from npu_llm_kernels.torch_ref import lora_add, pack_lora_weights  # noqa: F401
from npu_llm_kernels.torch_ref import select_experts as _ref_select_experts

BLOCK_SIZE = 128
# The cache writes skip slot -1, which vllm-ascend pads with (PAD_SLOT_ID): the op-plugin tests' golden for
# _npu_reshape_and_cache skips negative slots, and npu_kv_rmsnorm_rope_cache's doc leaves them unwritten while it
# calls repeated slots undefined, so a dummy step's or a captured batch's padding rows must not all write the
# scratch block's one slot (docs/npu.md section 1).
SKIPS_PAD_SLOTS = True
# Masked value per dtype, as vllm-ascend builds its masks (attention.py generate_attn_mask /
# get_splitfuse_attn_mask): -inf for fp16; for bf16 the prefill kernel takes 1 and splitfuse -10000.
_PREFILL_MASKED = {torch.float16: float("-inf"), torch.bfloat16: 1.0}
_SPLITFUSE_MASKED = {torch.float16: float("-inf"), torch.bfloat16: -10000.0}


def require_ops(parts) -> None:
    """Refuse, at load, a torch_npu without the ops these parts of a model call (npu_releases.OPS' names), naming the
    release to install."""
    npu_releases.require(torch_npu, ["attention", *parts])


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    # OP 7.1.0: _npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache,
    #                                  Tensor slot_indices) -> (); slot_indices int32 on device (VA forward()).
    torch_npu._npu_reshape_and_cache(
        key=key.contiguous(), value=value.contiguous(), key_cache=key_cache, value_cache=value_cache,
        slot_indices=slot_mapping.to(torch.int32),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # OP yaml: npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (y, rstd); VA ops/layernorm.py
    return torch_npu.npu_rms_norm(x, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    # OP yaml: npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon) -> (y, rstd, x1 + x2)
    y, _, summed = torch_npu.npu_add_rms_norm(x, residual, weight, eps)
    return y, summed


# -- vision towers (Qwen2.5-VL, Qwen3-VL) ---------------------------------------------------------------------------
# The fused attention's TND layout takes heads of 192 on op-plugin 7.1.0 (128 or 192 on master): the vision heads
# (Qwen2.5-VL's 80, Qwen3-VL's 72) are padded with zeros to 192, which changes no score, and the output is cut back.
# (vllm-ascend pads its vision weights to heads of 128, for the newer op-plugin it runs on.)
TND_HEAD = 192


def vision_rotary(x, cos, sin):
    # OP: npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode="half") -> Tensor: self * r1 +
    #   rotate_half(self) * r2, r1 / r2 broadcast over [B, S, N, D] (D even, under 896); the op vllm-ascend rotates
    #   its vision q and k with (its heads padded to 128, ours at their width)
    rotated = torch_npu.npu_rotary_mul(x[None], cos[None, :, None].to(x.dtype), sin[None, :, None].to(x.dtype))
    return rotated[0]


def vision_attention(query, key, value, cu_seqlens: list[int], scale: float):
    # OP: npu_fused_infer_attention_score(query, key, value, *, actual_seq_lengths, actual_seq_lengths_kv, num_heads,
    #   scale, input_layout, num_key_value_heads, sparse_mode, ...) -> (out, lse): TND with the segments' cumulative
    #   ends on the host, sparse_mode 0 without a mask (full attention in each window or frame), bfloat16 only
    dim = query.shape[-1]
    if dim > TND_HEAD:
        raise ValueError(f"vision heads of {dim} are wider than the NPU's fused attention takes ({TND_HEAD})")
    q, k, v = (torch.nn.functional.pad(t, (0, TND_HEAD - dim)).to(torch.bfloat16).contiguous()
               for t in (query, key, value))
    ends = cu_seqlens[1:]
    with scope("attention.vision"):
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q, k, v, actual_seq_lengths=ends, actual_seq_lengths_kv=ends, num_heads=query.shape[1],
            num_key_value_heads=query.shape[1], input_layout="TND", sparse_mode=0, scale=scale,
            antiquant_mode=0, antiquant_scale=None, block_table=None, block_size=0, softmax_lse_flag=False)
    return out[..., :dim].to(query.dtype)


def rotary_embedding(positions, query, key, cos_sin_cache):
    # RopeAtb.cpp: _npu_rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size,
    #                                    Tensor cos_sin_cache, bool is_neox_style) -> (); q/k contiguous [T, N*D],
    # rotated in place (VA rope_forward_oot).
    _claim_rope_table(cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    q = query.reshape(num_tokens, -1).contiguous()
    k = key.reshape(num_tokens, -1).contiguous()
    torch_npu._npu_rotary_embedding(positions.to(torch.int64), q, k, head_dim, cos_sin_cache, True)
    return q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, -1, head_dim)


# The rotary op builds its cos/sin tables from the first cos_sin_cache it is given and keeps them in
# process-global statics, ignoring every later table (RopeAtb.cpp, op-plugin 7.0.0 through master).
# A second model in the process, or a longer max_model_len, would be rotated with the first table:
# refuse any table that is not the first one or a prefix of it (up to rounding: the same table computed
# for another length can round differently in half precision).
_rope_table: torch.Tensor | None = None
_rope_tables_seen: list[weakref.ref] = []  # tables already checked, by identity (tensors compare elementwise)


def _claim_rope_table(table: torch.Tensor) -> None:
    global _rope_table
    if any(seen() is table for seen in _rope_tables_seen):
        return
    if _rope_table is None:
        _rope_table = table
    elif not (table.shape[1:] == _rope_table.shape[1:] and len(table) <= len(_rope_table)
              and torch.allclose(table.cpu().float(), _rope_table[: len(table)].cpu().float(), rtol=0, atol=1e-2)):
        raise RuntimeError(
            "torch_npu's _npu_rotary_embedding keeps the rope table of the first model it ran for the life of "
            f"the process ({list(_rope_table.shape)}), and this model's differs ({list(table.shape)}): serve "
            "each model, or each longer max_model_len, in its own process"
        )
    _rope_tables_seen[:] = [seen for seen in _rope_tables_seen if seen() is not None] + [weakref.ref(table)]


def paged_attention(query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale: float):
    """The op for the batch's state, as vllm-ascend v0.9.1 picks it (model_runner_v1 attn_state):
    decode only -> _npu_paged_attention; fresh prefills only -> _npu_flash_attention; anything else
    (chunked prefill, a cached prefix, decodes mixed with prefills) -> _npu_paged_attention_splitfuse."""
    if key_cache.shape[1] != BLOCK_SIZE:
        raise ValueError(f"the NPU paged-attention kernels need block_size {BLOCK_SIZE}, got {key_cache.shape[1]}")
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    q_lens, ctx_lens = metadata.query_lens, metadata.context_lens
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)  # CPU, per docs/npu.md §0
    decode_only = metadata.num_decodes == len(q_lens)
    # splitfuse serves a mixed batch's decodes and prefill chunks in one op: it counts as prefill attention
    with scope("attention.decode" if decode_only else "attention.prefill"):
        if decode_only:
            # OP 7.1.0 _npu_paged_attention(query, key_cache, value_cache, int num_kv_heads, int num_heads,
            #                               float scale_value, block_table, context_lens, Tensor(a!) out)
            args = dict(query=query.contiguous(), key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
                        num_heads=num_heads, scale_value=scale, block_table=metadata.block_tables,
                        context_lens=context_lens, out=out)
            if metadata.graph_capture is None:
                torch_npu._npu_paged_attention(**args)
            else:
                _capture_paged_attention(args, metadata.graph_capture)
        elif metadata.num_decodes == 0 and q_lens == ctx_lens:
            # SelfAttentionAtb.cpp _npu_flash_attention(query, key, value, mask, seq_len, float scale_value,
            #                                           int num_heads, int num_kv_heads, Tensor(a!) out); mask [S, S]
            longest = max(q_lens)
            future = torch.ones(longest, longest, dtype=torch.bool, device=query.device).triu(1)
            mask = torch.zeros(longest, longest, dtype=query.dtype, device=query.device)
            mask.masked_fill_(future, _PREFILL_MASKED[query.dtype])
            torch_npu._npu_flash_attention(
                query=query.contiguous(), key=key.contiguous(), value=value.contiguous(), mask=mask,
                seq_len=torch.tensor(q_lens, dtype=torch.int32), scale_value=scale, num_heads=num_heads,
                num_kv_heads=num_kv_heads, out=out,
            )
        else:
            # _npu_paged_attention_splitfuse(query, key_cache, value_cache, block_table, context_lens, mask,
            #   seq_len, int num_kv_heads, int num_heads, float scale_value, Tensor(a!) out). Mask [T, max_ctx]:
            # the token at absolute position p sees KV at positions <= p (VA get_splitfuse_attn_mask).
            positions = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, ctx_lens)]).to(query.device)
            columns = torch.arange(max(ctx_lens), device=query.device)
            mask = torch.zeros(len(positions), len(columns), dtype=query.dtype, device=query.device)
            mask.masked_fill_(columns[None, :] > positions[:, None], _SPLITFUSE_MASKED[query.dtype])
            torch_npu._npu_paged_attention_splitfuse(
                query=query.contiguous(), key_cache=key_cache, value_cache=value_cache,
                block_table=metadata.block_tables, context_lens=context_lens, mask=mask,
                seq_len=torch.tensor(q_lens, dtype=torch.int32), num_kv_heads=num_kv_heads, num_heads=num_heads,
                scale_value=scale, out=out,
            )
    return out


def _capture_paged_attention(args: dict, capture: GraphCapture) -> None:
    """Capture the decode op as a task group that can be re-issued with new context lengths.

    The op reads context_lens as host data, which a captured graph would freeze, so it is
    issued inside graph_task_group_begin/end and, before each replay, re-issued with the
    step's lengths inside graph_task_update_begin/end (vllm-ascend compilation/acl_graph.py
    _update_attn_pa_params). Under capture the op needs a preallocated workspace (the op-plugin
    schema's `workspace=` and _npu_paged_attention_get_workspace, from op-plugin 7.2.0 on: torch_npu 2.5.1.post1 and
    older lack both). One workspace serves every layer of the graph, as in vllm-ascend.
    """
    if not hasattr(torch_npu, "_npu_paged_attention_get_workspace"):
        raise RuntimeError(
            "NPU graph mode needs a torch_npu whose _npu_paged_attention takes a workspace "
            f"(torch_npu {getattr(torch_npu, '__version__', '?')} has none); run with enforce_eager=True"
        )
    if capture.workspace is None:
        capture.workspace = graph_workspace(args)
    args["workspace"] = capture.workspace
    stream = torch.npu.current_stream()
    torch.npu.graph_task_group_begin(stream)
    torch_npu._npu_paged_attention(**args)
    handle = torch.npu.graph_task_group_end(stream)

    def update(context_lens: torch.Tensor) -> None:
        stream = torch.npu.current_stream()
        torch.npu.graph_task_update_begin(stream, handle)
        torch_npu._npu_paged_attention(**{**args, "context_lens": context_lens})
        torch.npu.graph_task_update_end(stream)

    capture.updates.append(update)


# vllm-ascend asks for the captured op's workspace at this context length for every sequence: the
# op "only returns max workspace with specific seq_lens", and shorter ones can need more than
# longer ones (model_runner_v1.py SEQ_LEN_WITH_MAX_PA_WORKSPACE).
SEQ_LEN_WITH_MAX_PA_WORKSPACE = 6144


def graph_workspace(args: dict) -> torch.Tensor:
    """The decode op's workspace for a captured batch: the larger of the op's answers at
    SEQ_LEN_WITH_MAX_PA_WORKSPACE and at the capture's own context lengths."""
    batch = args["query"].shape[0]
    at_6144 = {**args, "context_lens": torch.full((batch,), SEQ_LEN_WITH_MAX_PA_WORKSPACE, dtype=torch.int32)}
    candidates = [torch_npu._npu_paged_attention_get_workspace(**a) for a in (at_6144, args)]
    return max(candidates, key=lambda w: w.numel() * w.element_size())


def decode_graph_widths(max_len: int, block_size: int) -> list[int]:
    """One width: the decode op is re-issued with each step's real lengths, so no ladder is needed."""
    return [max_len]


# -- mixture of experts (docs/npu.md section 11) ------------------------------------------------------------------
# As vllm-ascend v0.23.0 runs an unquantised MoE layer on one rank's experts (the AllGather path,
# ops/fused_moe/moe_comm_method.py): route, sort the (token, expert) pairs by expert, two grouped matmuls around
# SwiGLU, and the weighted sum back per token. VA's A2/A3 adaptor sends gating and routing to its own compiled
# ops; its A5 adaptor, and npu-llm, to torch_npu's (device/device_op.py).


def select_experts(router_logits, top_k, renormalize, scoring_func="softmax", num_expert_group=None, topk_group=None,
                   e_score_correction_bias=None, routed_scaling_factor=1.0):
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func must be softmax or sigmoid, got {scoring_func!r}")
    if scoring_func == "sigmoid" and not renormalize:
        # The op always renormalises sigmoid weights: VA takes plain torch here (check_npu_moe_gating_top_k).
        with scope("moe.router"):
            return _ref_select_experts(router_logits, top_k, False, scoring_func, num_expert_group, topk_group,
                                       e_score_correction_bias, routed_scaling_factor)
    groups = num_expert_group or 1
    bias = None if e_score_correction_bias is None else e_score_correction_bias.to(router_logits.dtype)  # VA casts
    renorm_here = scoring_func == "softmax" and renormalize  # the op never renormalises softmax weights
    with scope("moe.router"):
        # OP: npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, ..., int k_group=1, int group_count=1,
        #   int group_select_mode=0, int renorm=0, int norm_type=0, bool out_flag=False,
        #   float routed_scaling_factor=1.0, float eps=1e-20) -> (y in x's dtype, int32 ids, norm_out).
        # Arguments as VA's experts_selector.py _select_experts_with_fusion_ops and A5DeviceAdaptor pass them
        # (renorm=0, the only value the op takes; softmax renormalised afterwards), except group_select_mode: VA
        # always passes 1 (a group scores its best two), which is vLLM's grouped_topk with a correction bias only;
        # without one vLLM scores a group by its best expert (0).
        weights, ids, _ = torch_npu.npu_moe_gating_top_k(
            router_logits, k=top_k, bias=bias, k_group=topk_group if groups > 1 else 1, group_count=groups,
            group_select_mode=1 if bias is not None else 0, renorm=0, norm_type=0 if scoring_func == "softmax" else 1,
            out_flag=False, routed_scaling_factor=1.0 if renorm_here else routed_scaling_factor, eps=1e-20,
        )
        weights = weights.float()
        if renorm_here:  # (VA's A5 adaptor renormalises after the op has scaled, which undoes the scaling)
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * routed_scaling_factor
    return weights, ids.to(torch.int32)


def pack_expert_weights(w13, w2):
    # VA fused_moe.py AscendUnquantizedFusedMoEMethod.process_weights_after_loading: the grouped matmul takes
    # [E, K, N] weights, so w13 [E, 2I, H] -> [E, H, 2I] (gate columns, then up) and w2 [E, H, I] -> [E, I, H].
    return w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()


def fused_experts(x, w13, w2, topk_weights, topk_ids, first_expert=0):
    """Experts first_expert .. first_expert + E_local - 1 (w13 / w2 as pack_expert_weights made them); the pairs
    that chose other experts add nothing (the caller sums over ranks)."""
    expanded_x, row_idx, counts, _ = _dispatch(x, topk_ids, first_expert, w13.shape[0], quant_mode=-1)
    with scope("moe.experts"):
        # VA moe_mlp.py unquant_apply_mlp: npu_grouped_matmul(x=[h], weight=[w], split_item=2, group_list_type=1
        # (counts, as the dispatcher sets it), group_type=0, group_list=counts int64)[0], npu_swiglu between.
        # npu_swiglu(x, dim=-1) is silu(first half) * second half: silu(gate) * up, as torch_ref's silu_and_mul.
        gmm = dict(split_item=2, group_type=0, **_groups(counts))
        h = torch_npu.npu_grouped_matmul([expanded_x], [w13], **gmm)[0]
        h = torch_npu.npu_grouped_matmul([torch_npu.npu_swiglu(h)], [w2], **gmm)[0]
    return _combine(h, row_idx, topk_weights, x.dtype)


def pack_int8_expert_weights(w13, w2):
    # VA w8a8_dynamic.py AscendW8A8DynamicFusedMoEMethod.process_weights_after_loading: transpose(1, 2) to
    # [E, K, N], then npu_format_cast(w, 29) unconditionally ("npu_grouped_matmul_swiglu_quant can only support
    # weight nz").
    return tuple(torch_npu.npu_format_cast(w.transpose(1, 2).contiguous(), ACL_FORMAT_FRACTAL_NZ) for w in (w13, w2))


def fused_experts_int8(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, first_expert=0):
    """W8A8 dynamic experts (w13 / w2 as pack_int8_expert_weights made them, scales [E, N, 1]), as VA's
    AscendW8A8DynamicFusedMoEMethod runs them with its gmm-swiglu-quant fusion off (moe_mlp.py quant_apply_mlp,
    non-MC2): the routing quantizes each pair's row (quant_mode=1: absmax / 127, its fp32 scale beside it), a
    grouped int8 matmul with the per-channel and per-token scales, npu_swiglu, npu_dynamic_quant, and the second
    grouped int8 matmul. The scales go in the output's dtype (the op's table: bf16 scales for a bf16 output; an
    fp16 output takes fp32 ones), [E, N] as VA passes them."""
    expanded_x, row_idx, counts, expanded_scale = _dispatch(x, topk_ids, first_expert, w13.shape[0], quant_mode=1)
    scale_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    with scope("moe.experts"):
        gmm = dict(split_item=2, group_type=0, output_dtype=x.dtype, **_groups(counts))
        h = torch_npu.npu_grouped_matmul([expanded_x], [w13], scale=[w13_scale.squeeze(-1).to(scale_dtype)],
                                         per_token_scale=[expanded_scale], **gmm)[0]
        h, pertoken_scale = torch_npu.npu_dynamic_quant(torch_npu.npu_swiglu(h), dst_type=torch.int8)
        h = torch_npu.npu_grouped_matmul([h], [w2], scale=[w2_scale.squeeze(-1).to(scale_dtype)],
                                         per_token_scale=[pertoken_scale], **gmm)[0]
    return _combine(h, row_idx, topk_weights, x.dtype)


def _groups(counts: torch.Tensor) -> dict:
    """npu_grouped_matmul's group_list for the experts' row counts: the counts themselves (type 1), as VA passes
    them, except for one expert a rank, whose list of one count the doc refuses for type 1; one count is also its
    own cumulative sum (type 0). Under expert parallelism the counts add up to fewer rows than x has (the pairs of
    other ranks' experts trail them), where the doc asks for all of them: VA relies on the op leaving those rows
    alone, and so does npu-llm (docs/npu.md 11.3)."""
    return dict(group_list=counts.to(torch.int64), group_list_type=0 if len(counts) == 1 else 1)


def _dispatch(x, topk_ids, first_expert, num_local_experts, quant_mode):
    """(expanded_x, row_idx, counts, expanded_scale): the pairs of this rank's experts sorted by expert."""
    num_tokens, top_k = topk_ids.shape
    end = first_expert + num_local_experts
    with scope("moe.dispatch"):
        # OP: npu_moe_init_routing_v2(x, expert_idx, *, ..., int active_num=-1, int expert_num=-1, ...,
        #   int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1,
        #   int[2] active_expert_range=[], ...) -> (expanded_x, expanded_row_idx, counts, expanded_scale).
        # As VA's TokenDispatcherWithAllGather.token_dispatch calls it (token_dispatcher.py): all T*K pairs, counts
        # per local expert (type 1), this rank's range. VA's expert_num is the global expert count, which this
        # signature does not carry: ids above the range are clamped to `end` (still outside it), so end + 1 bounds
        # every id as the op requires. quant_mode 1 quantizes each row to int8 (VA's W8A8 dynamic MoE).
        return torch_npu.npu_moe_init_routing_v2(
            x, topk_ids.to(torch.int32).clamp(max=end), active_num=num_tokens * top_k, expert_num=end + 1,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[first_expert, end],
            quant_mode=quant_mode,
        )


def _combine(h, row_idx, topk_weights, dtype):
    """Each token's pairs' rows of h, weighted and summed."""
    with scope("moe.combine"):
        # OP: npu_moe_token_unpermute(permuted_tokens, sorted_indices int32 [T*K], probs [T, K]) -> [T, H]:
        # out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*K + k]]; the doc wants sorted_indices a
        # permutation of [0, T*K). The rows past the n local pairs are never written by the ops above, so they are
        # zeroed, and the pairs of other experts (-1 in row_idx) point at them, one each. (VA passes abs(row_idx)
        # on A2/A3, repeating row 1, and relies on masked weights; the raw -1s on A5.)
        held = row_idx >= 0
        n = held.sum()
        h = h.masked_fill((torch.arange(len(h), device=h.device) >= n)[:, None], 0)
        sorted_indices = torch.where(held, row_idx, (~held).cumsum(0) - 1 + n).to(torch.int32)
        return torch_npu.npu_moe_token_unpermute(h, sorted_indices, probs=topk_weights.to(dtype))
