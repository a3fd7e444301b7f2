"""Ascend NPU kernels: torch_npu's fused paged-attention op set, called as vllm-ascend calls it.

Sources (see docs/npu.md): op schemas from Ascend/op-plugin (branch 7.1.0, the
torch_npu 2.5.1.post1 line) op_plugin/ops/atb/*.cpp; call sites from vllm-ascend v0.9.1
(attention/attention_v1.py, attention/attention.py, ops/layernorm.py, ops/rotary_embedding.py).
ATB ops return nothing and write their outputs in place; outputs must be contiguous; lengths
(seq_len, context_lens) go as CPU int32 ("otherwise error: tensor.hostData is null").
Only fp16 and bf16 run on these ops; block size must be 128.
"""
from __future__ import annotations

import weakref

import torch
import torch_npu

from kernels.metadata import AttentionMetadata, GraphCapture
from kernels.timing import scope
from kernels.torch_ref import linear, pack_linear_weight, silu_and_mul  # noqa: F401  (plain torch on the NPU)

BLOCK_SIZE = 128
# Masked value per dtype, as vllm-ascend builds its masks (attention.py generate_attn_mask /
# get_splitfuse_attn_mask): -inf for fp16; for bf16 the prefill kernel takes 1 and splitfuse -10000.
_PREFILL_MASKED = {torch.float16: float("-inf"), torch.bfloat16: 1.0}
_SPLITFUSE_MASKED = {torch.float16: float("-inf"), torch.bfloat16: -10000.0}


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
    master schema's `workspace=` and _npu_paged_attention_get_workspace; torch_npu 2.5.1, op-plugin
    7.1.0, lacks both). One workspace serves every layer of the graph, as in vllm-ascend.
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
