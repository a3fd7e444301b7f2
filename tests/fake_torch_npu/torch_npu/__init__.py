"""A CPU-backed stand-in for torch_npu, for contract tests on machines without Ascend hardware.

It implements the ops npu_llm_kernels/npu.py calls with npu_llm_kernels/torch_ref.py semantics (the MoE ops with
their docs' equivalent code), and checks their arguments the way the real ops document them
(docs/npu.md): keyword names, fp16/bf16 only, int32 slot indices and block tables, CPU int32
lengths, contiguous outputs, block sizes, the exact causal masks vllm-ascend builds, and the MoE
ops' bounds on experts, groups and k. A wrong call raises, as the real op would fail. Device
tensors are on "npu:N" (fake_npu_device.py: host memory underneath, but
placed apart from host tensors, so an argument on the wrong side of the bus is refused).
Graph capture and replay (torch.npu.NPUGraph, task-group updates) live in _graphs.py; the
torch.distributed backend "hccl" (collectives between ranks, over gloo underneath) in _hccl.py.

The host it plays has CANN NNAL and FAKE_NPU_DEVICES (1) Ascend910B3 chips unless FAKE_NPU_NNAL=0 or
FAKE_NPU_SOC say otherwise.
Only tests put this package on sys.path (tests/test_npu_contract.py).
"""
from __future__ import annotations

import os
import types

import fake_npu_device
import torch

from npu_llm_kernels import torch_ref
from npu_llm_kernels.metadata import AttentionMetadata, cdiv

from . import _graphs, _hccl
from . import profiler
from .op_plugin.atb import _atb_ops

# built for this torch, or the release FAKE_TORCH_NPU_VERSION declares (see the end of this file)
__version__ = os.environ.get("FAKE_TORCH_NPU_VERSION",
                             ".".join(torch.__version__.split("+")[0].split(".")[:2]) + ".0.post1")
calls: dict[str, int] = {}  # op name -> times called, for the tests
_HALF = (torch.float16, torch.bfloat16)


class NpuOpError(RuntimeError):
    pass


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise NpuOpError(message)


def _count(name: str) -> None:
    if name.startswith("_npu_"):  # the ATB ops: torch_npu loads their library on first use
        _atb_ops._register_atb_extensions()
    calls[name] = calls.get(name, 0) + 1


def _half(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        _require(t.dtype in _HALF, f"{name}: only float16/bfloat16 are supported, got {t.dtype}")
    _require(len({t.dtype for t in tensors}) == 1, f"{name}: all tensors must share one dtype")


def _cpu_int32(name: str, arg: str, t: torch.Tensor) -> None:
    # ATB reads CPU tensors as host data; a device tensor here has no hostData (docs/npu.md)
    _require(t.dtype == torch.int32 and t.device.type == "cpu", f"{name}: {arg} must be a CPU int32 tensor")


def _on_device(name: str, **tensors: torch.Tensor) -> None:
    for arg, t in tensors.items():
        _require(t.device.type == "npu", f"{name}: {arg} must be on the NPU, got a {t.device.type} tensor")


# -- cache write ------------------------------------------------------------------------------------


def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices):
    name = "_npu_reshape_and_cache"
    _count(name)
    _half(name, key, value, key_cache, value_cache)
    _on_device(name, key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_indices=slot_indices)
    _require(key.dim() == 3 and key_cache.dim() == 4, f"{name}: key [T,N,D] and caches [blocks,block_size,N,D]")
    _require(key_cache.shape[2:] == key.shape[1:], f"{name}: cache heads/dim {tuple(key_cache.shape[2:])} != key's")
    _require(key_cache.is_contiguous() and value_cache.is_contiguous(), f"{name}: caches must be contiguous")
    _require(slot_indices.dtype == torch.int32, f"{name}: slot_indices must be int32, got {slot_indices.dtype}")
    _require(slot_indices.shape == (key.shape[0],), f"{name}: one slot per token")
    _graphs.launch(_write_cache, ("key_cache", "value_cache"), key=key, value=value, key_cache=key_cache,
                   value_cache=value_cache, slots=slot_indices)


def _write_cache(key, value, key_cache, value_cache, slots):
    # The op-plugin tests' golden skips negative slots (vllm-ascend's padding); two tokens for one slot race.
    # (Checked here, when the kernel runs: a captured graph's slots are known only at replay.)
    written = _distinct_slots("_npu_reshape_and_cache", slots, key_cache.shape[0] * key_cache.shape[1])
    torch_ref.reshape_and_cache(key[written], value[written], key_cache, value_cache, slots[written].long())


def _distinct_slots(name: str, slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """The mask of the slots a cache write writes (the non-negative ones), refusing a slot given twice (the docs
    call repeated slots undefined) or one past the cache."""
    written = slots >= 0
    values, counts = slots[written].unique(return_counts=True)
    if len(values):
        _require(int(counts.max()) == 1, f"{name}: slot {int(values[counts.argmax()])} written twice in one call "
                                         "(undefined on the chip: pad with -1)")
        _require(int(values[-1]) < capacity, f"{name}: slot {int(values[-1])} past the cache's {capacity}")
    return written


# -- norms and rotary -------------------------------------------------------------------------------


def npu_rms_norm(x, gamma, epsilon=1e-6):
    _count("npu_rms_norm")
    y = torch_ref.rms_norm(x, gamma, epsilon)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return y, rstd


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    _count("npu_add_rms_norm")
    y, summed = torch_ref.add_rms_norm(x1, x2, gamma, epsilon)
    return y, torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + epsilon), summed


_rope_tables: dict[str, torch.Tensor] = {}  # the op's process-global cos/sin statics (RopeAtb.cpp)


def _npu_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    name = "_npu_rotary_embedding"
    _count(name)
    _require(positions.dtype == torch.int64, f"{name}: positions must be int64")
    _on_device(name, positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    _require(query.dim() == 2 and key.dim() == 2, f"{name}: query/key must be [T, N*head_size]")
    _require(query.is_contiguous() and key.is_contiguous(), f"{name}: query/key must be contiguous (written in place)")
    _require(query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0, f"{name}: head_size mismatch")
    _require(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_size,
             f"{name}: cos_sin_cache must be [max_position, head_size={head_size}], got {tuple(cos_sin_cache.shape)}")
    _require(is_neox_style, f"{name}: only neox style is used here")
    # The real op builds its cos/sin tables from the first cos_sin_cache it is given, keeps them in
    # static variables for the life of the process and ignores every later table: so does the fake.
    if "cos_sin" not in _rope_tables:
        _rope_tables["cos_sin"] = cos_sin_cache.detach().clone()
    table = _rope_tables["cos_sin"]
    if len(positions) and not _graphs.is_capturing():  # (a capture cannot read device values back)
        _require(int(positions.max()) < table.shape[0], f"{name}: position beyond the cached table's {table.shape[0]} rows")
    _graphs.launch(_rotate, ("query", "key"), positions=positions, query=query, key=key, head_size=head_size,
                   table=table)


def _rotate(positions, query, key, head_size, table):
    q, k = torch_ref.rotary_embedding(positions, query.view(len(positions), -1, head_size),
                                      key.view(len(positions), -1, head_size), table.to(query.dtype))
    query.copy_(q.reshape(query.shape))
    key.copy_(k.reshape(key.shape))


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """x * r1 + rotate_half(x) * r2 on [B, S, N, D], r1 / r2 of x's dtype broadcast over it (the vision towers')."""
    name = "npu_rotary_mul"
    _count(name)
    _on_device(name, input=input, r1=r1, r2=r2)
    _require(rotary_mode == "half", f"{name}: only rotary_mode 'half' is used here")
    _require(input.dim() == 4 and r1.dim() == r2.dim() == 4, f"{name}: input, r1 and r2 must be 4-D")
    _require(r1.dtype == r2.dtype == input.dtype, f"{name}: r1 and r2 must be of the input's dtype {input.dtype}")
    _require(r1.shape == r2.shape and r1.shape[-1] == input.shape[-1] and input.shape[-1] % 2 == 0,
             f"{name}: r1 / r2 {tuple(r1.shape)} must span the input's even last dimension {tuple(input.shape)}")
    torch.broadcast_shapes(r1.shape, input.shape)  # (raises where they do not broadcast)
    x1, x2 = input.float().chunk(2, dim=-1)
    return (input.float() * r1.float() + torch.cat((-x2, x1), dim=-1) * r2.float()).to(input.dtype)


# -- attention --------------------------------------------------------------------------------------


def _check_paged(name, query, key_cache, value_cache, num_kv_heads, num_heads, block_table, out):
    _half(name, query, key_cache, value_cache, out)
    _on_device(name, query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table, out=out)
    _require(block_table.dtype == torch.int32, f"{name}: block_table must be int32")
    block_size = key_cache.shape[1]
    _require(block_size % 16 == 0 and block_size <= 128, f"{name}: block_size must be a multiple of 16, <= 128")
    _require(key_cache.shape[2] == num_kv_heads, f"{name}: key_cache holds {key_cache.shape[2]} heads, not {num_kv_heads}")
    _check_heads(name, query, num_heads, num_kv_heads, out)


def _check_heads(name, query, num_heads, num_kv_heads, out):
    _require(query.dim() == 3 and query.shape[1] == num_heads, f"{name}: query must be [T, num_heads={num_heads}, D]")
    _require(num_kv_heads > 0 and num_heads % num_kv_heads == 0, f"{name}: num_heads must be a multiple of num_kv_heads")
    _require(0 < query.shape[2] <= 256, f"{name}: head_dim must be in (0, 256], got {query.shape[2]}")
    _require(out.is_contiguous() and out.shape == query.shape, f"{name}: out must be contiguous, shaped like query")


def _metadata(query_lens, context_lens, block_table, block_size) -> AttentionMetadata:
    return AttentionMetadata(
        query_lens=query_lens, context_lens=context_lens, num_decodes=0, block_size=block_size,
        slot_mapping=torch.empty(0, dtype=torch.long), block_tables=block_table,
        context_lens_tensor=torch.tensor(context_lens, dtype=torch.int32, device=block_table.device))


def _npu_paged_attention(*, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                         context_lens, out, workspace=None):
    # The op-plugin master schema: `*, Tensor? workspace=None` after out (7.1.0 has no workspace).
    name = "_npu_paged_attention"
    _count(name)
    _check_paged(name, query, key_cache, value_cache, num_kv_heads, num_heads, block_table, out)
    _cpu_int32(name, "context_lens", context_lens)
    _require(context_lens.shape == (query.shape[0],), f"{name}: one context length per query token")
    # Under graph capture the op cannot allocate its own workspace (vllm-ascend passes one it got from
    # _npu_paged_attention_get_workspace), and a workspace given must hold what the op needs for these lengths.
    _check_workspace(name, workspace, lambda: _workspace_bytes(num_heads, context_lens))
    # context_lens is host data: the op reads it when issued (a graph keeps the values it was captured with)
    _graphs.launch(_decode_attention, ("out",), query=query, key_cache=key_cache, value_cache=value_cache,
                   block_table=block_table, context_lens=context_lens.tolist(), scale=scale_value, out=out)


def _check_workspace(name, workspace, needed) -> None:
    """A capture needs a workspace given (the op cannot allocate one inside a graph), and one given must hold the
    needed() bytes."""
    _require(workspace is not None or not _graphs.is_capturing(), f"{name}: a graph capture needs a workspace")
    if workspace is not None:
        _on_device(name, workspace=workspace)
        size, need = workspace.numel() * workspace.element_size(), needed()
        _require(size >= need, f"{name}: workspace of {size} bytes, the op needs {need}")


def _decode_attention(query, key_cache, value_cache, block_table, context_lens, scale, out):
    md = _metadata([1] * query.shape[0], context_lens, block_table, key_cache.shape[1])
    out.copy_(torch_ref.decode_attention(query, key_cache, value_cache, md, scale))


def _workspace_bytes(num_heads: int, context_lens: torch.Tensor) -> int:
    # The fake's stand-in for ATB's GetAtbWorkspaceSizeCmd: it grows with the context lengths given.
    return 4 * num_heads * sum(context_lens.tolist())


def _npu_paged_attention_get_workspace(*, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                                       block_table, context_lens, out):
    # PagedAttentionAtb.cpp: at::empty({workspace_size}, query.options().dtype(at::kByte)), sized by the
    # host context_lens it is given.
    _count("_npu_paged_attention_get_workspace")
    _cpu_int32("_npu_paged_attention_get_workspace", "context_lens", context_lens)
    return torch.empty(_workspace_bytes(num_heads, context_lens), dtype=torch.uint8, device=query.device)


def _causal_mask(q_lens, ctx_lens, columns, masked, dtype):
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, ctx_lens)])
    mask = torch.zeros(len(positions), columns, dtype=dtype)
    return mask.masked_fill_(torch.arange(columns)[None, :] > positions[:, None], masked)


def _npu_flash_attention(*, query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out):
    name = "_npu_flash_attention"
    _count(name)
    _half(name, query, key, value, mask, out)
    _on_device(name, query=query, key=key, value=value, mask=mask, out=out)
    _check_heads(name, query, num_heads, num_kv_heads, out)
    _require(key.shape[1] == num_kv_heads, f"{name}: key holds {key.shape[1]} heads, not {num_kv_heads}")
    _cpu_int32(name, "seq_len", seq_len)
    lens = seq_len.tolist()
    _require(sum(lens) == query.shape[0] == key.shape[0], f"{name}: sum(seq_len) must equal the token count")
    longest = max(lens)
    masked = float("-inf") if query.dtype == torch.float16 else 1.0  # vllm-ascend generate_attn_mask
    expected = _causal_mask([longest], [longest], longest, masked, query.dtype)
    _require(mask.shape == (longest, longest) and torch.equal(mask.cpu(), expected),
             f"{name}: mask must be the [S,S] causal mask (masked = {masked} for {query.dtype})")
    _graphs.launch(_prefill_attention, ("out",), query=query, key=key, value=value, lens=lens, scale=scale_value,
                   out=out)


def _prefill_attention(query, key, value, lens, scale, out):
    start = 0
    for n in lens:
        out[start : start + n] = torch_ref.prefill_attention(query[start : start + n], key[start : start + n],
                                                             value[start : start + n], scale)
        start += n


def _npu_paged_attention_splitfuse(*, query, key_cache, value_cache, block_table, context_lens, mask, seq_len,
                                   num_kv_heads, num_heads, scale_value, out):
    name = "_npu_paged_attention_splitfuse"
    _count(name)
    _check_paged(name, query, key_cache, value_cache, num_kv_heads, num_heads, block_table, out)
    _cpu_int32(name, "seq_len", seq_len)
    _cpu_int32(name, "context_lens", context_lens)
    _on_device(name, mask=mask)
    q_lens, ctx_lens = seq_len.tolist(), context_lens.tolist()
    _require(sum(q_lens) == query.shape[0], f"{name}: sum(seq_len) must equal the token count")
    masked = float("-inf") if query.dtype == torch.float16 else -10000.0  # vllm-ascend get_splitfuse_attn_mask
    expected = _causal_mask(q_lens, ctx_lens, max(ctx_lens), masked, query.dtype)
    _require(mask.shape == expected.shape and torch.equal(mask.cpu(), expected),
             f"{name}: mask must be [T, max context] with token at position p seeing KV <= p")
    _graphs.launch(_chunked_attention, ("out",), query=query, key_cache=key_cache, value_cache=value_cache,
                   block_table=block_table, q_lens=q_lens, ctx_lens=ctx_lens, scale=scale_value, out=out)


def _chunked_attention(query, key_cache, value_cache, block_table, q_lens, ctx_lens, scale, out):
    block_size, start = key_cache.shape[1], 0
    for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        blocks = block_table[i, : cdiv(c, block_size)].long()
        k = torch_ref.gather_kv(key_cache, blocks)[:c]
        v = torch_ref.gather_kv(value_cache, blocks)[:c]
        out[start : start + q] = torch_ref.prefill_attention(query[start : start + q], k, v, scale)
        start += q


# -- mixture of experts ------------------------------------------------------------------------------
# Schemas: op-plugin master op_plugin_functions.yaml. Semantics and refusals: each op's doc,
# docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md (docs/npu.md section 11). The fake implements the calls
# vllm-ascend's unquantised MoE makes; other modes of these ops raise as "not part of the fake".
# Rows an op leaves unwritten (past the pairs routed to this rank's experts) hold NaN here, so that a
# caller that reads them shows.

_FLOAT = (*_HALF, torch.float32)


def _not_in_fake(name: str, condition: bool, what: str) -> None:
    _require(condition, f"{name}: {what} is not part of the fake (npu-llm does not use it)")


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    name = "npu_moe_gating_top_k"
    _count(name)
    _on_device(name, x=x)
    _require(x.dim() == 2 and x.dtype in _FLOAT, f"{name}: x must be 2-D float16/bfloat16/float32, got "
                                                  f"{x.dim()}-D {x.dtype}")
    experts = x.shape[1]
    _require(experts <= 2048, f"{name}: at most 2048 experts (x's last dim), got {experts}")
    _require(group_count > 0 and experts % group_count == 0,
             f"{name}: the {experts} experts must divide into group_count={group_count} groups")
    per_group = experts // group_count
    _require(per_group > 2, f"{name}: each group must hold more than 2 experts, got {per_group}")
    _require(-(-per_group // 32) * 32 * group_count <= 2048,
             f"{name}: experts per group aligned to 32, times group_count, must be <= 2048")
    _require(1 <= k_group <= group_count, f"{name}: k_group must be in [1, group_count={group_count}], got {k_group}")
    _require(1 <= k <= per_group * k_group,
             f"{name}: k must be in [1, k_group * experts per group = {per_group * k_group}], got {k}")
    _require(renorm == 0, f"{name}: only renorm=0 (norm, then top-k) is supported, got {renorm}")
    _require(norm_type in (0, 1), f"{name}: norm_type must be 0 (softmax) or 1 (sigmoid), got {norm_type}")
    _require(group_select_mode in (0, 1), f"{name}: group_select_mode must be 0 or 1, got {group_select_mode}")
    _not_in_fake(name, input_ids is None and tid2eid is None, "hash routing (input_ids, tid2eid)")
    if bias is not None:
        _on_device(name, bias=bias)
        _require(bias.shape == (experts,) and bias.dtype == x.dtype,
                 f"{name}: bias must be 1-D [{experts}] in x's dtype {x.dtype}, got {list(bias.shape)} {bias.dtype}")
    y = torch.empty(x.shape[0], k, dtype=x.dtype, device=x.device)
    ids = torch.empty(x.shape[0], k, dtype=torch.int32, device=x.device)
    norm = torch.empty(tuple(x.shape) if out_flag else (0,), dtype=torch.float32, device=x.device)
    _graphs.launch(_gating_top_k, ("y", "ids", "norm"), x=x, bias=bias, k=k, k_group=k_group,
                   group_count=group_count, group_select_mode=group_select_mode, norm_type=norm_type,
                   routed_scaling_factor=routed_scaling_factor, eps=eps, y=y, ids=ids, norm=norm)
    return y, ids, norm


def _gating_top_k(x, bias, k, k_group, group_count, group_select_mode, norm_type, routed_scaling_factor, eps,
                  y, ids, norm):
    # The doc's equivalent code: scores in fp32, the bias only for the choice, ties to the lower index.
    scores = x.float().softmax(-1) if norm_type == 0 else x.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if group_count > 1:
        grouped = choice.view(len(choice), group_count, -1)
        group_scores = grouped.amax(-1) if group_select_mode == 0 else grouped.topk(2, dim=-1).values.sum(-1)
        best = torch.argsort(-group_scores, dim=-1, stable=True)[:, :k_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[2], dim=1), float("-inf"))
    chosen = torch.argsort(-choice, dim=-1, stable=True)[:, :k]
    weights = scores.gather(1, chosen)
    if norm_type == 1:  # sigmoid scores are always renormalised, softmax ones never
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    y.copy_(weights * routed_scaling_factor)
    ids.copy_(chosen)
    if norm.numel():
        norm.copy_(scores)


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0, x_dtype=None):
    name = "npu_moe_init_routing_v2"
    _count(name)
    _on_device(name, x=x, expert_idx=expert_idx)
    _require(x.dim() == 2 and x.dtype in (*_FLOAT, torch.int8),
             f"{name}: x must be 2-D float16/bfloat16/float32/int8, got {x.dim()}-D {x.dtype}")
    _require(expert_idx.dtype == torch.int32 and expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0],
             f"{name}: expert_idx must be int32 [N={x.shape[0]}, K], got {list(expert_idx.shape)} {expert_idx.dtype}")
    limit = 5120 if expert_tokens_num_type == 2 else 10240
    _require(0 < expert_num <= limit, f"{name}: expert_num must be in [1, {limit}], got {expert_num}")
    start, end = active_expert_range if len(active_expert_range) else (0, expert_num)
    _require(len(active_expert_range) in (0, 2) and 0 <= start < end <= expert_num,
             f"{name}: active_expert_range must be [start, end) with end <= expert_num={expert_num}, "
             f"got {list(active_expert_range)}")
    _require(expert_tokens_num_type in (0, 1, 2), f"{name}: expert_tokens_num_type must be 0, 1 or 2")
    _not_in_fake(name, quant_mode in (-1, 1) and scale is None and offset is None and x_dtype is None,
                 "quantisation other than int8 dynamic (quant_mode 1) without smoothing scales")
    _require(quant_mode == -1 or x.dtype in _FLOAT, f"{name}: quant_mode={quant_mode} quantizes a float x, got "
                                                   f"{x.dtype}")
    _not_in_fake(name, drop_pad_mode == 0 and row_idx_type == 0, "drop/pad mode or scatter indices")
    _not_in_fake(name, expert_tokens_num_flag and expert_tokens_num_type != 2, "no counts, or key-value counts")
    pairs = expert_idx.numel()
    _not_in_fake(name, active_num in (-1, 0) or active_num >= pairs, "dropping pairs (0 < active_num < N*K)")
    if pairs and not _graphs.is_capturing():  # (a capture cannot read device values back)
        _require(0 <= int(expert_idx.min()) and int(expert_idx.max()) < expert_num,
                 f"{name}: expert ids must be in [0, expert_num={expert_num})")
    quantized = quant_mode == 1
    expanded_x = torch.empty(pairs, x.shape[1], dtype=torch.int8 if quantized else x.dtype, device=x.device)
    expanded_row_idx = torch.empty(pairs, dtype=torch.int32, device=x.device)
    counts = torch.empty(end - start, dtype=torch.int64, device=x.device)
    expanded_scale = torch.empty(pairs if quantized else 0, dtype=torch.float32, device=x.device)
    _graphs.launch(_init_routing, ("expanded_x", "expanded_row_idx", "counts", "expanded_scale"), x=x,
                   expert_idx=expert_idx, start=start, end=end, cumsum=expert_tokens_num_type == 0,
                   expanded_x=expanded_x, expanded_row_idx=expanded_row_idx, counts=counts,
                   expanded_scale=expanded_scale)
    return expanded_x, expanded_row_idx, counts, expanded_scale


def _init_routing(x, expert_idx, start, end, cumsum, expanded_x, expanded_row_idx, counts, expanded_scale):
    # The doc's equivalent code (dropless, gather index): the pairs of experts in [start, end) sorted by expert,
    # stably; expanded_row_idx[(t, k) flat] is where the pair landed, -1 for experts outside the range.
    flat = expert_idx.reshape(-1).long()
    order = torch.where(flat < start, torch.iinfo(torch.int32).max, flat).argsort(stable=True)
    held = (flat >= start) & (flat < end)
    n = int(held.sum())
    expanded_row_idx.fill_(-1)
    expanded_row_idx[order[:n]] = torch.arange(n, dtype=torch.int32)
    rows = x[order[:n] // expert_idx.shape[1]]
    if expanded_x.dtype == torch.int8 and x.dtype != torch.int8:  # quant_mode 1: the doc's absmax / 127 per row
        scale = rows.float().abs().amax(dim=-1) / 127
        expanded_scale.fill_(float("nan"))  # (past the n valid rows: not written by the op)
        expanded_scale[:n] = scale
        expanded_x[:n] = torch.round(rows.float() / scale.clamp_min(1e-30)[:, None]).clamp(-128, 127).to(torch.int8)
    else:
        expanded_x[:n] = rows
    if expanded_x.is_floating_point():
        expanded_x[n:] = float("nan")  # not written by the op
    tokens = torch.bincount(flat[held] - start, minlength=end - start)
    counts.copy_(tokens.cumsum(0) if cumsum else tokens)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None):
    name = "npu_grouped_matmul"
    _count(name)
    _require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), f"{name}: x and weight are lists")
    _not_in_fake(name, len(x) == 1 and len(weight) == 1, "more than one x or weight tensor")
    _not_in_fake(name, all(a is None for a in (offset, antiquant_scale, antiquant_offset, activation_input,
                                               activation_quant_scale, activation_quant_offset, x_dtype,
                                               weight_dtype, scale_dtype, per_token_scale_dtype)),
                 "quantisation other than int8 x and weight with per-channel and per-token scales")
    _not_in_fake(name, act_type == 0 and tuning_config is None, "a fused activation or tuning_config")
    x, w = x[0], weight[0]
    _on_device(name, x=x, weight=w)
    _require(x.dim() == 2 and w.dim() == 3, f"{name}: x must be 2-D and the weight 3-D [E, K, N], got "
                                            f"{x.dim()}-D and {w.dim()}-D")
    _require(split_item in (2, 3), f"{name}: one x with one 3-D weight needs split_item 2 or 3, got {split_item}")
    _not_in_fake(name, group_type == 0, f"group_type={group_type} (the fake groups along M: 0)")
    _require(group_list is not None, f"{name}: group_list is required with a 3-D weight")
    _on_device(name, group_list=group_list)
    _require(group_list.dtype == torch.int64 and group_list.dim() == 1, f"{name}: group_list must be 1-D int64, got "
                                                                        f"{group_list.dim()}-D {group_list.dtype}")
    _require(group_list_type in (0, 1), f"{name}: group_list_type must be 0 (cumsum) or 1 (counts) for "
                                        f"{x.dtype} (2 needs int8 x and weight), got {group_list_type}")
    _require(group_list_type != 1 or len(group_list) > 1,
             f"{name}: group_list_type 1 (counts) takes two groups or more, got one")
    _require(len(group_list) == w.shape[0] <= 1024,
             f"{name}: one group per expert of the weight ({w.shape[0]}), at most 1024; "
             f"group_list has {len(group_list)}")
    _require(x.shape[1] == w.shape[1], f"{name}: x's inner dim {x.shape[1]} != the weight's K {w.shape[1]}")
    _require(w.shape[1] < 65536 and w.shape[2] < 65536, f"{name}: inner dims must be < 65536, got {list(w.shape[1:])}")
    quantized = x.dtype == torch.int8
    if quantized:
        _check_quantized_gmm(name, x, w, scale, per_token_scale, bias, output_dtype)
    else:
        _require(scale is None and per_token_scale is None, f"{name}: scales go with int8 x and weight")
        _require(x.dtype == w.dtype and x.dtype in _HALF,
                 f"{name}: unquantised x and weight must be float16 or bfloat16, one dtype; got {x.dtype}, {w.dtype}")
        _require(output_dtype in (None, x.dtype), f"{name}: unquantised output is x's dtype {x.dtype}")
    if bias is not None:
        _require(len(bias) == 1 and bias[0].shape == (w.shape[0], w.shape[2]), f"{name}: bias must be [[E, N]]")
        want = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        _require(bias[0].dtype == want, f"{name}: a {x.dtype} matmul takes a {want} bias, got {bias[0].dtype}")
        _on_device(name, bias=bias[0])
    if not _graphs.is_capturing():  # (a capture cannot read device values back)
        sizes = group_list.tolist()
        sizes = sizes if group_list_type == 1 else [b - a for a, b in zip([0] + sizes, sizes)]
        _require(min(sizes, default=0) >= 0, f"{name}: group sizes must be >= 0 (a cumsum non-decreasing)")
        # The doc asks sum == x rows; vllm-ascend passes more rows (those of other ranks' experts) and relies on
        # the op leaving them alone, so the fake takes more rows and leaves them unwritten.
        _require(sum(sizes) <= x.shape[0], f"{name}: the groups hold {sum(sizes)} rows, x has {x.shape[0]}")
    y = torch.empty(x.shape[0], w.shape[2], dtype=output_dtype if quantized else x.dtype, device=x.device)
    _graphs.launch(_grouped_matmul, ("y",), x=x, weight=w, bias=None if bias is None else bias[0],
                   scale=None if scale is None else scale[0],
                   per_token_scale=None if per_token_scale is None else per_token_scale[0],
                   group_list=group_list, cumulative=group_list_type == 0, y=y)
    return [y]


def _check_quantized_gmm(name, x, w, scale, per_token_scale, bias, output_dtype):
    """The doc's per-token row for A2/A3: int8 x and weight, fp32 per_token_scale, and a bf16 scale for a bf16
    output or an fp32 one for an fp16 output; [E, N] scales as vllm-ascend passes them (the doc says 1-D)."""
    experts, n = w.shape[0], w.shape[2]
    _require(w.dtype == torch.int8, f"{name}: an int8 x takes an int8 weight, got {w.dtype}")
    _require(output_dtype in _HALF, f"{name}: per-token quantisation outputs bf16 or fp16, got {output_dtype}")
    _require(scale is not None and per_token_scale is not None and len(scale) == 1 and len(per_token_scale) == 1,
             f"{name}: int8 x and weight need one scale and one per_token_scale")
    want = torch.bfloat16 if output_dtype == torch.bfloat16 else torch.float32
    _on_device(name, scale=scale[0], per_token_scale=per_token_scale[0])
    _require(scale[0].dtype == want and tuple(scale[0].shape) == (experts, n),
             f"{name}: a {output_dtype} output takes a {want} scale [E={experts}, N={n}], got {scale[0].dtype} "
             f"{list(scale[0].shape)}")
    _require(per_token_scale[0].dtype == torch.float32 and tuple(per_token_scale[0].shape) == (x.shape[0],),
             f"{name}: per_token_scale must be fp32 [M={x.shape[0]}], got {per_token_scale[0].dtype} "
             f"{list(per_token_scale[0].shape)}")
    _not_in_fake(name, bias is None, "a bias with int8 x")


def _grouped_matmul(x, weight, bias, scale, per_token_scale, group_list, cumulative, y):
    sizes = group_list.diff(prepend=group_list.new_zeros(1)) if cumulative else group_list
    y.fill_(float("nan"))  # rows past the groups are not written
    start = 0
    for expert, size in enumerate(sizes.tolist()):
        rows = slice(start, start + size)
        if scale is not None:  # int32 sums, then the expert's per-channel and the rows' per-token scales
            out = (x[rows].int() @ weight[expert].int()).float() * scale[expert].float() * per_token_scale[rows, None]
        else:
            out = x[rows].float() @ weight[expert].float()
        y[rows] = out if bias is None else out + bias[expert].float()
        start += size


def npu_swiglu(x, dim=-1):
    name = "npu_swiglu"
    _count(name)
    _on_device(name, x=x)
    _require(x.dtype in _FLOAT, f"{name}: x must be float16/bfloat16/float32, got {x.dtype}")
    _require(1 <= x.dim() <= 8 and x.numel() > 0 and x.is_contiguous(),
             f"{name}: x must be 1-8-D, non-empty, contiguous")
    _require(x.shape[dim] % 2 == 0, f"{name}: dim {dim} must have an even size, got {x.shape[dim]}")
    shape = list(x.shape)
    shape[dim] //= 2
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    _graphs.launch(_swiglu, ("out",), x=x, dim=dim, out=out)
    return out


def _swiglu(x, dim, out):
    a, b = x.float().chunk(2, dim=dim)  # the first half goes through silu
    out.copy_(torch.nn.functional.silu(a) * b)


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    name = "npu_moe_token_unpermute"
    _count(name)
    _on_device(name, permuted_tokens=permuted_tokens, sorted_indices=sorted_indices)
    _require(permuted_tokens.dim() == 2 and permuted_tokens.dtype in _FLOAT,
             f"{name}: permuted_tokens must be 2-D float16/bfloat16/float32")
    _require(sorted_indices.dim() == 1 and sorted_indices.dtype == torch.int32,
             f"{name}: sorted_indices must be 1-D int32, got {sorted_indices.dim()}-D {sorted_indices.dtype}")
    _require(not padded_mode and restore_shape is None,
             f"{name}: only padded_mode=False, restore_shape=None are supported")
    top_k = 1
    if probs is not None:
        _on_device(name, probs=probs)
        _require(probs.dim() == 2 and probs.dtype in _FLOAT, f"{name}: probs must be 2-D float16/bfloat16/float32")
        top_k = probs.shape[1]
    _require(top_k <= 512, f"{name}: topK must be <= 512 on Atlas A2/A3, got {top_k}")
    pairs = len(sorted_indices)
    tokens = pairs // top_k
    _require(permuted_tokens.shape[0] == pairs and (probs is None or probs.shape[0] * top_k == pairs),
             f"{name}: permuted_tokens [N*K, H] and sorted_indices [N*K] with probs [N, K]: got "
             f"{list(permuted_tokens.shape)}, {pairs}, {None if probs is None else list(probs.shape)}")
    if pairs and not _graphs.is_capturing():  # (a capture cannot read device values back)
        values = sorted_indices.tolist()
        _require(min(values) >= 0 and max(values) < pairs, f"{name}: sorted_indices must be in [0, {pairs - 1}]")
        _require(len(set(values)) == pairs, f"{name}: sorted_indices must not repeat an index")
    out = torch.empty(tokens, permuted_tokens.shape[1], dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    _graphs.launch(_unpermute, ("out",), permuted_tokens=permuted_tokens, sorted_indices=sorted_indices, probs=probs,
                   out=out)
    return out


def _unpermute(permuted_tokens, sorted_indices, probs, out):
    # out[i] = sum over j < K of probs[i, j] * permuted_tokens[sorted_indices[i * K + j]]
    rows = permuted_tokens.float().index_select(0, sorted_indices.long())
    if probs is not None:
        rows = rows * probs.float().reshape(-1, 1)
    out.copy_(rows.view(out.shape[0], -1, out.shape[1]).sum(1))


def npu_fusion_attention(*args, **kwargs):
    # transformers imports this name whenever torch_npu is importable; npu-llm never calls it.
    raise NpuOpError("npu_fusion_attention is not part of the fake (npu-llm does not use it)")


# -- the torch.npu surface npu-llm uses -------------------------------------------------------------

npu = types.ModuleType("torch.npu")
npu.is_available = lambda: True
npu.device_count = lambda: int(os.environ.get("FAKE_NPU_DEVICES", "1"))


def _set_device(device) -> None:
    index = torch.device(device).index if not isinstance(device, int) else device
    _require(index is not None and 0 <= index < npu.device_count(),
             f"Invalid device ID {index}: this host has {npu.device_count()} NPU(s)")  # (aclrtSetDevice's refusal)
    fake_npu_device.set_current(index)


npu.set_device = _set_device
npu.current_device = lambda: fake_npu_device._NPU.index if fake_npu_device._NPU is not None else 0
npu.synchronize = lambda device=None: None
npu.empty_cache = fake_npu_device.memory.empty_cache
# The chip's name, as aclrtGetSocName reports it (FAKE_NPU_SOC to play another chip).
npu.get_device_name = lambda device=None: os.environ.get("FAKE_NPU_SOC", "Ascend910B3")


def _mem_get_info(device=None):
    # (free, total) of a card of FAKE_NPU_MEMORY_GB (32) with a runtime context of CONTEXT_BYTES in use
    total = int(float(os.environ.get("FAKE_NPU_MEMORY_GB", "32")) * 2**30)
    return total - CONTEXT_BYTES - fake_npu_device.memory.reserved, total


CONTEXT_BYTES = 2**30


npu.mem_get_info = _mem_get_info
npu.memory_allocated = lambda device=None: fake_npu_device.memory.allocated
npu.memory_reserved = lambda device=None: fake_npu_device.memory.reserved
npu.max_memory_allocated = lambda device=None: fake_npu_device.memory.peak
npu.reset_peak_memory_stats = lambda device=None: setattr(fake_npu_device.memory, "peak",
                                                          fake_npu_device.memory.allocated)
for _name in ("NPUGraph", "graph", "graph_pool_handle", "current_stream", "graph_task_group_begin",
              "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end"):
    setattr(npu, _name, getattr(_graphs, _name))
npu.is_initialized = lambda: True
npu._is_in_bad_fork = lambda: False
npu.manual_seed = npu.manual_seed_all = lambda seed: None
fake_npu_device.install(npu)
torch.npu = npu
_hccl.register()


def _autoload() -> None:
    """The `torch.backends` entry point torch_npu registers: `import torch` has imported this package by now."""


# DeepSeek's latent attention (after the helpers above, which _mla uses)
from ._mla import (  # noqa: E402, F401
    _npu_fused_infer_attention_score_v2_get_max_workspace,
    npu_attention_update,
    npu_fused_infer_attention_score,
    npu_fused_infer_attention_score_v2,
    npu_interleave_rope,
    npu_kv_rmsnorm_rope_cache,
)
from ._quant import (  # noqa: E402, F401  (W8A8, W8A16)
    get_npu_format,
    npu_dynamic_quant,
    npu_format_cast,
    npu_quant_matmul,
    npu_quantize,
    npu_trans_quant_param,
    npu_weight_quant_batchmatmul,
)


# An older release declared (FAKE_TORCH_NPU_VERSION) lacks the ops op-plugin added after its line, as the real one
# does (op_plugin_functions.yaml and ops/atb on branches 7.0.0, 7.1.0 and 7.2.0; docs/npu.md section 15): torch_npu
# 2.5.1 is op-plugin 7.0.0, 2.5.1.post1 and 2.6.0 are 7.1.0; later releases have them all.
_ADDED = {"7.1.0": ["npu_moe_token_unpermute"],
          "7.2.0": ["npu_fused_infer_attention_score_v2", "_npu_fused_infer_attention_score_v2_get_max_workspace",
                    "npu_attention_update", "_npu_paged_attention_get_workspace"]}
_LINE = {"2.5.1": "7.0.0", "2.5.1.post1": "7.1.0", "2.6.0": "7.1.0"}.get(__version__)
for _added_in, _names in _ADDED.items():
    if _LINE is not None and _LINE < _added_in:
        for _name in _names:
            globals().pop(_name, None)
