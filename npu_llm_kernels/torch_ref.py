"""Portable PyTorch kernels: the CPU path, and the reference every other backend is tested against.

Cache layout (the Ascend one): per layer key_cache / value_cache of shape
[num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence lives in slot
block_table[t // block_size] * block_size + t % block_size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from npu_llm_kernels.metadata import AttentionMetadata, cdiv
from npu_llm_kernels.timing import scope


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in whatever layout `linear` runs fastest from (here: as it is)."""
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def pack_lora_weights(shrink: torch.Tensor, expand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A LoRA layer's shrink A [w, K] and expand B [N, w] in lora_add's layout: A, and B^T [w, N]."""
    return shrink.contiguous(), expand.t().contiguous()


def lora_add(y: torch.Tensor, x: torch.Tensor, segments: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
    """Batched LoRA (vLLM's punica SGMV): for each segment (start, end, shrink, expand_t) of rows sharing an adapter,
    y[start:end] += x[start:end] shrink^T expand_t, in place (weights as pack_lora_weights lays them out)."""
    for start, end, shrink, expand_t in segments:
        y[start:end] += (x[start:end] @ shrink.t()) @ expand_t


# compressed-tensors' symmetric int8 range is [-128, 127], and its scale maps absmax to half of it: 255 / 2.
INT8_HALF_RANGE = 127.5


def quantize_int8(x: torch.Tensor, scale: torch.Tensor | None = None,
                  offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): x [T, K] as int8 values (held in fp32) and the scale they are multiplied by to give x again
    (x = (q - offset) * scale).

    With no scale, each row (token) gets its own, from its absolute maximum (dynamic quantization); otherwise
    the given one (static), with msModelSlim's integer offset where its activations are asymmetric. The arithmetic
    is compressed-tensors' (x / scale + offset, rounded half to even, clamped), which transformers runs for these
    checkpoints, so that greedy outputs agree with it token for token."""
    x = x.float()
    if scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True) / INT8_HALF_RANGE
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)  # an all-zero row stays zero
    shifted = x / scale if offset is None else x / scale + offset.float()
    return torch.round(shifted).clamp_(-128, 127), scale.float()


def pack_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """int8 weights in whatever layout `int8_linear` runs fastest from (here: as they are, [N, K])."""
    return weight


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                bias: torch.Tensor | None = None, input_offset: torch.Tensor | None = None,
                int8_matmul=None) -> torch.Tensor:
    """y = x w^T (+ bias) for int8 weights [N, K] with per-channel scales [N, 1], x quantized to int8 first: per token
    (input_scale None) or with the static input_scale [1] (and input_offset [1]: msModelSlim's asymmetric
    activations, whose offset times the weights' row sums its quant_bias takes away again, inside `bias`). The int8
    products are summed exactly in fp32 (while the partial sums stay below 2^24; to fp32's rounding beyond), then
    scaled: what an int8 GEMM with int32 accumulators gives. Here the weights are converted per call (the
    portable path: CUDA, and the CPU where its kernels do not apply). `int8_matmul(q, weight)`, where given, sums
    q [T, K] (int8 values in fp32) times weight^T in a kernel of its own, into fp32 [T, N]."""
    q, scale = quantize_int8(x.reshape(-1, x.shape[-1]), input_scale, input_offset)
    products = F.linear(q, weight.float()) if int8_matmul is None else int8_matmul(q, weight)
    y = products * weight_scale.view(1, -1).float() * scale  # (the order oneDNN's GEMM and its epilogue take: cpu.py)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def pack_w8a16_weight(weight: torch.Tensor, weight_scale: torch.Tensor, weight_offset: torch.Tensor | None):
    """W8A16 tensors in the layout `w8a16_linear` runs from (here: as they are; the scales fp32)."""
    return weight, weight_scale.float(), None if weight_offset is None else weight_offset.float()


# W8A16 dequantizes this many weights at a time (2 MB in bf16), block after block of output rows: never a whole
# layer's weights at once for a large layer.
W8A16_BLOCK = 1 << 20


def dequantize_int8(weight: torch.Tensor, weight_scale: torch.Tensor, weight_offset: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
    """int8 weights [N, K] in `dtype`: (q + offset) * scale, the scale [N, G] covering K / G input features each, in
    fp32 and rounded once (as compressed-tensors and npu_weight_quant_batchmatmul dequantize them)."""
    n, k = weight.shape
    w = weight.float() if weight_offset is None else weight.float() + weight_offset.float()
    w = w.view(n, weight_scale.shape[1], -1) * weight_scale.float().unsqueeze(-1)
    return w.view(n, k).to(dtype)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_offset: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 dequantize=dequantize_int8, linear=F.linear) -> torch.Tensor:
    """y = x ((w + offset) * scale)^T (+ bias) for int8 weights [N, K] with scales [N, G] (G = 1: per output channel;
    else per group of K / G input features) and offsets [N, 1] or None, x in the model's dtype. The weights are
    dequantized to x's dtype a block of output rows at a time (`dequantize`), each block multiplied by `linear`."""
    flat = x.reshape(-1, x.shape[-1])
    n = weight.shape[0]
    rows = max(1, W8A16_BLOCK // weight.shape[1])
    blocks = []
    for start in range(0, n, rows):
        part = slice(start, start + rows)
        w = dequantize(weight[part], weight_scale[part], None if weight_offset is None else weight_offset[part],
                       x.dtype)
        blocks.append(linear(flat, w, None if bias is None else bias[part]))
    y = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)
    return y.reshape(*x.shape[:-1], n)


def require_ops(parts) -> None:
    """Every op here is torch's own: nothing to require of a release (the NPU's kernels check torch_npu's)."""


# index_copy_ writes every slot it is given (a slot of -1 would be out of range): the engine points the rows it
# must not keep (a dummy step's, a captured batch's padding) at the scratch block instead (metadata.PAD_SLOT_ID).
SKIPS_PAD_SLOTS = False


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new tokens' K/V ([T, num_kv_heads, head_dim]) into their cache slots, in place."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The cache rows of `block_ids` ([..., n]) as [..., n * block_size, num_kv_heads, head_dim]."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_dim)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention for a flat batch of decode tokens and prefill chunks.

    query [T, num_heads, head_dim]; key/value [T, num_kv_heads, head_dim] are this step's new
    tokens, already written to the cache. Each sequence's new tokens sit at the end of its
    context and see every earlier token of it. Returns [T, num_heads, head_dim].
    """
    return attend(query, key, value, key_cache, value_cache, metadata, scale, decode_attention, prefill_attention)


def attend(query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale: float, decode,
           prefill) -> torch.Tensor:
    """paged_attention with the decode part (one batched call for the leading one-token sequences) and the
    prefill part (one call a sequence, prefill_attention's signature) pluggable."""
    nd = metadata.num_decodes
    if nd == len(metadata.query_lens):  # a decode-only step: the decode kernel's output is the whole result
        with scope("attention.decode"):
            return decode(query, key_cache, value_cache, metadata, scale)
    out = torch.empty_like(query)
    if nd:
        with scope("attention.decode"):
            out[:nd] = decode(query[:nd], key_cache, value_cache, metadata, scale)
    with scope("attention.prefill"):
        start = nd
        for i in range(nd, len(metadata.query_lens)):
            q_len, ctx_len = metadata.query_lens[i], metadata.context_lens[i]
            if ctx_len == q_len:  # nothing cached before this chunk: attend to the new K/V directly
                k, v = key[start : start + q_len], value[start : start + q_len]
            else:
                blocks = metadata.block_tables[i, : cdiv(ctx_len, metadata.block_size)]
                k = gather_kv(key_cache, blocks)[:ctx_len]
                v = gather_kv(value_cache, blocks)[:ctx_len]
            out[start : start + q_len] = prefill(query[start : start + q_len], k, v, scale)
            start += q_len
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: q [q_len, Hq, D] are the last q_len of the ctx_len tokens in k/v [ctx_len, Hkv, D]
    (v's head size may differ from q's and k's, as in MLA's up-projected prefill)."""
    q_len, num_heads, head_dim = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # [Hkv, group, len, D], K/V broadcast over the group: CPU flash attention parallelises over
    # both leading dims, and it is about twice as fast as enable_gqa or repeat_interleave.
    q4 = q.transpose(0, 1).reshape(num_kv_heads, group, q_len, head_dim)
    k4 = k.transpose(0, 1)[:, None].expand(num_kv_heads, group, ctx_len, head_dim)
    v4 = v.transpose(0, 1)[:, None].expand(num_kv_heads, group, ctx_len, v.shape[-1])
    if ctx_len == q_len:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    else:
        # query i sits at absolute position ctx_len - q_len + i and sees keys at or before it
        rows = torch.arange(q_len, device=q.device)[:, None] + (ctx_len - q_len)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
    return o.reshape(num_heads, q_len, v.shape[-1]).transpose(0, 1)


def decode_attention(query, key_cache, value_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [B, Hq, D]: the one new token of each of the first B sequences."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_ctx = max(metadata.context_lens[:num_seqs])
    blocks = metadata.block_tables[:num_seqs, : cdiv(max_ctx, metadata.block_size)]
    k = gather_kv(key_cache, blocks).transpose(1, 2)  # [B, Hkv, L, D]
    v = gather_kv(value_cache, blocks).transpose(1, 2)
    visible = torch.arange(k.shape[2], device=query.device) < metadata.context_lens_tensor[:num_seqs, None]
    # One query token per sequence: the `group` query heads sharing a KV head act as `group`
    # query rows against that head, which is several times faster than enable_gqa on CPU.
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :], scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)


def decode_graph_widths(max_len: int, block_size: int) -> list[int]:
    """The context widths (tokens) to capture decode graphs for, shortest first.

    Under capture, decode_attention reads every block up to the width the graph was captured with
    (context_lens only masks), so a ladder of widths keeps short contexts cheap.
    """
    widths, width = [], 2 * block_size
    while width < max_len:
        widths.append(width)
        width *= 2
    return widths + [max_len]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the weight, as Hugging Face Llama does."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the residual add fused in front of the norm."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: x [.., 2I] holds gate and up side by side; silu(gate) * up [.., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which plain torch matmuls (bmm) multiply a model's weights of `dtype` fastest here: itself."""
    return dtype


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The gated MLP's projection and activation: silu_and_mul of x times its [gate | up] weights [2I, K]."""
    with scope("matmul"):
        gate_up = linear(x, weight, bias)
    return silu_and_mul(gate_up)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Neox-style rotary embedding of query [T, Hq, D] and key [T, Hkv, D].

    cos_sin_cache is vLLM's [max_position, head_dim]: cos and sin of each frequency, side by side.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# -- vision towers (Qwen2.5-VL, Qwen3-VL: backend/models/qwen_vl.py) ---------------------------------------------


def vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary of x [patches, heads, head_dim] by each patch's own cos / sin [patches, head_dim] (a row's
    and a column's frequencies, doubled), in fp32 as transformers computes it, back in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]).to(x.dtype)


def vision_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: list[int],
                     scale: float) -> torch.Tensor:
    """Full (not causal) attention within each segment of [patches, heads, head_dim] tensors: the segments are the
    windows or frames that cu_seqlens bounds (cumulative, from 0)."""
    out = torch.empty_like(query)
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        out[start:stop] = F.scaled_dot_product_attention(
            query[start:stop].transpose(0, 1), key[start:stop].transpose(0, 1), value[start:stop].transpose(0, 1),
            scale=scale).transpose(0, 1)
    return out


# -- mixture of experts ------------------------------------------------------------------------------------------
# Two ops, the same on every platform: the router's choice (select_experts), then the experts' work on the
# tokens sorted by expert, weighted and summed back per token (fused_experts). Expert weights are stacked:
# w13 [E, 2 * I, H] (gate rows, then up rows) and w2 [E, H, I].


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
                   num_expert_group: int | None = None, topk_group: int | None = None,
                   e_score_correction_bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0):
    """Each token's top_k experts and their weights: (topk_weights [T, k] fp32, topk_ids [T, k] int32).

    Scores are the softmax (Qwen3-MoE, Mixtral) or the sigmoid (GLM-4.5, DeepSeek V3) of the logits, in fp32.
    The choice adds e_score_correction_bias, where there is one, but the weights are the scores without it. With
    groups, only the topk_group best groups of experts are chosen from: a group's score is its best two (with a
    correction bias) or its best one, as vLLM's grouped_topk ranks them.
    """
    scores = router_logits.float()
    if scoring_func == "softmax":
        scores = scores.softmax(dim=-1)
    elif scoring_func == "sigmoid":
        scores = scores.sigmoid()
    else:
        raise ValueError(f"scoring_func must be softmax or sigmoid, got {scoring_func!r}")
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group and num_expert_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, num_expert_group, experts // num_expert_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if e_score_correction_bias is not None else grouped.amax(-1)
        best_groups = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // num_expert_group, dim=1), float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids.to(torch.int32)


def sort_by_expert(topk_ids: torch.Tensor, first_expert: int, num_local_experts: int):
    """The (token, choice) pairs that this rank's experts serve, sorted by expert (stable, so by token inside
    one): (order, counts), `order` indexing the flattened topk_ids, `counts` [num_local_experts] the pairs of
    each expert. Choices of experts held elsewhere (expert parallel) are left out."""
    local = topk_ids.reshape(-1).long() - first_expert
    held = (local >= 0) & (local < num_local_experts)
    local = torch.where(held, local, num_local_experts)  # the others sort last and are cut off
    order = local.argsort(stable=True)
    counts = torch.bincount(local, minlength=num_local_experts + 1)[:num_local_experts]
    return order[: int(held.sum())], counts


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """sum over a token's chosen experts e of weight * down_e(silu(gate_e(x)) * up_e(x)), for the experts held
    here (w13 / w2 hold experts first_expert, first_expert + 1, ...; the caller sums over ranks).

    This is the per-expert loop: tokens are sorted by expert, and each expert with tokens runs two F.linear
    calls on its rows. There is no loop over tokens.
    """
    return _per_expert(x, topk_weights, topk_ids, first_expert, w13.shape[0],
                       lambda e, rows: F.linear(silu_and_mul(F.linear(rows, w13[e])), w2[e]))


def pack_int8_expert_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 expert weights in the layout fused_experts_int8 runs from (here: as they are, [E, N, K])."""
    return w13, w2


def fused_experts_int8(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                       w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       first_expert: int = 0, linear=None) -> torch.Tensor:
    """fused_experts for W8A8 dynamic experts: int8 weights (w13 [E, 2I, H], w2 [E, H, I], or lists of each expert's
    weights in the platform's layout) with per-channel scales ([E, N, 1]), each expert's rows quantized per token as
    int8_linear quantizes them (`linear`: the platform's int8_linear, default this module's)."""
    linear = linear or int8_linear
    return _per_expert(x, topk_weights, topk_ids, first_expert, len(w13), lambda e, rows: linear(
        silu_and_mul(linear(rows, w13[e], w13_scale[e], None)), w2[e], w2_scale[e], None))


def _per_expert(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int,
                num_local_experts: int, mlp) -> torch.Tensor:
    """The per-expert loop: `mlp(expert, rows)` on the rows of each local expert's pairs, weighted and summed per
    token."""
    order, counts = sort_by_expert(topk_ids, first_expert, num_local_experts)
    top_k = topk_ids.shape[1]
    rows = order // top_k  # the token of each sorted pair
    gathered = x.index_select(0, rows)
    expert_out = torch.empty_like(gathered)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            expert_out[start : start + count] = mlp(expert, gathered[start : start + count])
            start += count
    weights = topk_weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, rows, expert_out * weights)


def pack_expert_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked expert weights in the layout fused_experts runs fastest from (here: as they are)."""
    return w13, w2


# Latent attention (DeepSeek's MLA) composed of the ops above (at the end: mla.py reads this module's functions).
from npu_llm_kernels.mla import PortableMLA as MLA  # noqa: E402
