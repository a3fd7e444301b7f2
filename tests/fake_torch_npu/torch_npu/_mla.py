"""The fake's MLA ops (DeepSeek's latent attention), as vllm-ascend v0.23.0's mla_v1 backend calls them.

Schemas: op-plugin master op_plugin_functions.yaml. Semantics and refusals: each op's doc,
docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md (docs/npu.md section 12). Each op implements the mode vllm-ascend
uses; the others (NZ caches, quantised caches, other layouts) raise as "not part of the fake". The rotary ops
de-interleave the rope pairs as their docs' formulas do, so a caller that de-interleaved them already gets wrong
numbers, as it would on the chip.
"""
from __future__ import annotations

import torch

from npu_llm_kernels import torch_ref
from npu_llm_kernels.metadata import cdiv

from . import _graphs
from . import _check_workspace, _count, _distinct_slots, _half, _not_in_fake, _on_device, _require, calls

LATENT, ROPE, HEAD = 512, 64, 128


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1), (x2, x3), ... -> x0, x2, ... | x1, x3, ...: the docs' "reshape and transpose" before RotateHalf."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, half = _deinterleave(x.float()), x.shape[-1] // 2
    return x * cos.float() + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.float()


def npu_interleave_rope(x, cos, sin):
    name = "npu_interleave_rope"
    _count(name)
    _half(name, x, cos, sin)
    _on_device(name, x=x, cos=cos, sin=sin)
    _require(x.dim() == 4 and x.is_contiguous(), f"{name}: x must be a contiguous [B, N, S, D]")
    batch, _, seq, dim = x.shape
    _require(dim == ROPE, f"{name}: D must be {ROPE}, got {dim}")
    for arg, t in (("cos", cos), ("sin", sin)):
        _require(t.dim() == 4 and t.shape[0] == batch and t.shape[1] == 1 and t.shape[2] in (seq, 1)
                 and t.shape[3] == dim, f"{name}: {arg} must be [B, 1, S or 1, D], got {tuple(t.shape)}")
    return _rotate(x, cos, sin).to(x.dtype)


def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None, c_kv_scale=None,
                              k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                              is_output_kv=False):
    name = "npu_kv_rmsnorm_rope_cache"
    _count(name)
    _not_in_fake(name, all(t is None for t in (k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset, v)),
                 "quantised caches")
    _not_in_fake(name, cache_mode in ("PA", "PA_BNSD"), f"cache_mode {cache_mode!r} (NZ or Norm)")
    _half(name, kv, gamma, cos, sin, k_cache, ckv_cache)
    _on_device(name, kv=kv, gamma=gamma, cos=cos, sin=sin, index=index, k_cache=k_cache, ckv_cache=ckv_cache)
    _require(kv.dim() == 4 and kv.shape[1] == 1 and kv.shape[3] == LATENT + ROPE,
             f"{name}: kv must be [B, 1, S, {LATENT + ROPE}] ({LATENT} to normalise, {ROPE} to rotate), "
             f"got {tuple(kv.shape)}")
    batch, _, seq, _ = kv.shape
    _require(gamma.shape == (LATENT,), f"{name}: gamma must be [{LATENT}]")
    for arg, t in (("cos", cos), ("sin", sin)):
        _require(t.shape == (batch, 1, seq, ROPE), f"{name}: {arg} must be [B, 1, S, {ROPE}], got {tuple(t.shape)}")
    _require(index.dtype == torch.int64 and index.shape == (batch * seq,),
             f"{name}: index must be int64 [B*S] (global slots), got {index.dtype} {tuple(index.shape)}")
    for arg, t, width in (("k_cache", k_cache, ROPE), ("ckv_cache", ckv_cache, LATENT)):
        _require(t.dim() == 4 and t.shape[2] == 1 and t.shape[3] == width and t.is_contiguous(),
                 f"{name}: {arg} must be a contiguous [blocks, block_size, 1, {width}], got {tuple(t.shape)}")
    _require(k_cache.shape[:2] == ckv_cache.shape[:2], f"{name}: the two caches must have the same blocks")
    c, r = kv.float().split([LATENT, ROPE], dim=-1)
    y = (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.float()).to(kv.dtype)
    k_embed = _rotate(r, cos, sin).to(kv.dtype)
    _graphs.launch(_write_rows, ("k_cache", "ckv_cache"), index=index, k_embed=k_embed, y=y, k_cache=k_cache,
                   ckv_cache=ckv_cache)
    if not is_output_kv:
        return k_cache, ckv_cache, kv.new_empty(0), kv.new_empty(0)
    return k_cache, ckv_cache, k_embed, y


def _write_rows(index, k_embed, y, k_cache, ckv_cache):
    written = _distinct_slots("npu_kv_rmsnorm_rope_cache", index, k_cache.shape[0] * k_cache.shape[1])
    k_cache.view(-1, ROPE)[index[written]] = k_embed.reshape(-1, ROPE)[written]
    ckv_cache.view(-1, LATENT)[index[written]] = y.reshape(-1, LATENT)[written]


# -- attention -------------------------------------------------------------------------------------------------


def _host_lengths(name: str, arg: str, lengths, count: int | None = None) -> list[int]:
    _require(isinstance(lengths, (list, tuple)) and all(isinstance(n, int) for n in lengths),
             f"{name}: {arg} must be a host list of ints (SymInt[]), got {type(lengths).__name__}")
    _require(count is None or len(lengths) == count, f"{name}: {arg} must hold {count} lengths, got {len(lengths)}")
    return list(lengths)


def _cumulative(name: str, arg: str, lengths, total: int) -> list[int]:
    ends = _host_lengths(name, arg, lengths)
    _require(0 < len(ends) <= 4096, f"{name}: {arg} must hold 1-4096 entries in TND")
    _require(all(b >= a for a, b in zip([0] + ends, ends)) and ends[-1] == total,
             f"{name}: {arg} must be cumulative, ending at the {total} tokens, got {ends}")
    return [b - a for a, b in zip([0] + ends, ends)]


def npu_fused_infer_attention_score(query, key, value, *, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, query_rope=None, key_rope=None, num_heads=1,
                                    scale=1.0, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
                                    antiquant_mode=0, antiquant_scale=None, block_table=None, block_size=0,
                                    softmax_lse_flag=False, **others):
    """vllm-ascend's MLA prefill: TND, no cache (block_table None), causal (sparse_mode 3) or over a context
    (sparse_mode 0, no mask)."""
    name = "npu_fused_infer_attention_score"
    _count(name)
    _not_in_fake(name, input_layout == "TND" and block_table is None and block_size == 0,
                 f"layout {input_layout!r} or a paged cache")
    _not_in_fake(name, all(v is None for v in others.values()) and antiquant_scale is None and antiquant_mode == 0,
                 f"{sorted(k for k, v in others.items() if v is not None)} (quantisation, pse, padding, prefixes)")
    tensors = dict(query=query, key=key, value=value, **({} if query_rope is None else dict(query_rope=query_rope,
                                                                                           key_rope=key_rope)))
    for arg, t in tensors.items():
        _require(t.dtype == torch.bfloat16, f"{name}: the TND layout takes bfloat16 only, {arg} is {t.dtype}")
        _require(t.dim() == 3, f"{name}: {arg} must be [T, N, D] in TND")
    _on_device(name, **tensors)
    _require(query.shape[1] == num_heads and key.shape[1] == value.shape[1] == num_key_value_heads,
             f"{name}: num_heads {num_heads} / num_key_value_heads {num_key_value_heads} must match the tensors")
    _require(num_heads % num_key_value_heads == 0 and num_heads // num_key_value_heads <= 64,
             f"{name}: num_heads must be a multiple of num_key_value_heads, at most 64 times it")
    if query_rope is not None:
        _require(key_rope is not None, f"{name}: query_rope needs key_rope")
        _require(query.shape[2] == key.shape[2] == value.shape[2] == HEAD,
                 f"{name}: with rope, query, key and value must be {HEAD} wide")
        _require(query_rope.shape == (*query.shape[:2], ROPE) and key_rope.shape == (*key.shape[:2], ROPE),
                 f"{name}: query_rope / key_rope must be [T, N, {ROPE}] beside query / key")
        query, key = torch.cat((query, query_rope), dim=-1), torch.cat((key, key_rope), dim=-1)
    _require(query.shape[2] == key.shape[2], f"{name}: query and key must be as wide")
    _require(query.shape[2] == value.shape[2] == 128 or (query.shape[2] == 192 and value.shape[2] in (128, 192)),
             f"{name}: TND takes heads of 128 or 192: q.k and v of 128, or q.k of 192 with v of 128 or 192 "
             f"(got q.k {query.shape[2]}, v {value.shape[2]})")
    q_lens = _cumulative(name, "actual_seq_lengths", actual_seq_lengths, query.shape[0])
    kv_lens = _cumulative(name, "actual_seq_lengths_kv", actual_seq_lengths_kv, key.shape[0])
    _require(len(q_lens) == len(kv_lens), f"{name}: one kv length per query length")
    _not_in_fake(name, sparse_mode in (0, 3), f"sparse_mode {sparse_mode}")
    if sparse_mode == 3:
        _require(atten_mask is not None and atten_mask.dtype in (torch.int8, torch.bool, torch.uint8)
                 and atten_mask.shape == (2048, 2048), f"{name}: sparse_mode 3 takes the optimised [2048, 2048] mask")
        _on_device(name, atten_mask=atten_mask)
        _require(torch.equal(atten_mask.cpu().bool(), torch.ones(2048, 2048, dtype=torch.bool).triu(1)),
                 f"{name}: the sparse_mode 3 mask must be 1 above the diagonal")
        _require(all(q <= k for q, k in zip(q_lens, kv_lens)), f"{name}: a query may not outnumber its keys")
    else:
        _require(atten_mask is None, f"{name}: sparse_mode 0 here is unmasked")
    out, lse = [], []
    q_start = k_start = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        o, l = _attend(query[q_start:q_start + q_len], key[k_start:k_start + kv_len],
                       value[k_start:k_start + kv_len], scale, causal=sparse_mode == 3)
        out.append(o)
        lse.append(l)
        q_start, k_start = q_start + q_len, k_start + kv_len
    lse_out = torch.cat(lse).unsqueeze(-1) if softmax_lse_flag else query.new_empty(0, dtype=torch.float32)
    return torch.cat(out).to(torch.bfloat16), lse_out


def _attend(q, k, v, scale, causal: bool):
    """q [q_len, N, D] against k/v [kv_len, Nkv, D]; causal: the queries are the last of the keys' tokens.
    Returns (out [q_len, N, Dv], lse [q_len, N]) in fp32."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qnd,knd->nqk", q.float(), k) * scale
    if causal:
        q_len, kv_len = q.shape[0], k.shape[0]
        future = torch.arange(kv_len)[None, :] > torch.arange(q_len)[:, None] + (kv_len - q_len)
        scores = scores.masked_fill(future.to(scores.device), float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.einsum("nqk,knd->qnd", (scores - lse[..., None]).exp(), v), lse.transpose(0, 1)


def npu_attention_update(lse, local_out, update_type):
    """The doc's merge of attention computed over parts of the keys: m = max lse_i, L = m + log sum exp(lse_i - m),
    O = sum O_i exp(lse_i - L); update_type 1 also returns L."""
    name = "npu_attention_update"
    _count(name)
    _require(isinstance(lse, (list, tuple)) and isinstance(local_out, (list, tuple)) and len(lse) == len(local_out),
             f"{name}: lse and local_out are lists of one length")
    _require(1 <= len(lse) <= 16, f"{name}: 1 to 16 parts (SP), got {len(lse)}")
    _require(update_type in (0, 1), f"{name}: update_type must be 0 or 1, got {update_type}")
    rows, dim = local_out[0].shape if local_out[0].dim() == 2 else (None, None)
    for i, (l, o) in enumerate(zip(lse, local_out)):
        _on_device(name, lse=l, local_out=o)
        _require(l.dtype == torch.float32 and l.dim() == 1, f"{name}: lse[{i}] must be 1-D float32, got "
                                                            f"{l.dim()}-D {l.dtype}")
        _require(o.dtype == torch.float32 and o.dim() == 2 and o.shape == (rows, dim) and l.shape == (rows,),
                 f"{name}: local_out[{i}] must be float32 [rows, D] beside its lse [rows], all parts alike")
    _require(8 <= dim <= 512 and dim % 8 == 0, f"{name}: head_dim must be a multiple of 8 in [8, 512], got {dim}")
    out = torch.empty(rows, dim, dtype=torch.float32, device=local_out[0].device)
    total = torch.empty(rows if update_type == 1 else 0, dtype=torch.float32, device=out.device)
    _graphs.launch(_merge, ("out", "total"), lse=list(lse), local_out=list(local_out), out=out, total=total)
    return out, total


def _merge(lse, local_out, out, total):
    stacked = torch.stack(lse)  # [SP, rows]
    merged = stacked.logsumexp(0)
    empty = stacked == float("-inf")  # a part with no keys: weight 0 (the other NaNs a bug may make still show)
    weights = torch.where(empty, 0.0, stacked - merged).exp().masked_fill(empty, 0.0)
    out.copy_(sum(w[:, None] * o for w, o in zip(weights, local_out)))
    if total.numel():
        total.copy_(merged)


def _check_latent_decode(name, query, key, value, query_rope, key_rope, atten_mask, actual_seq_qlen,
                         actual_seq_kvlen, block_table, num_query_heads, num_key_value_heads, input_layout,
                         sparse_mode, block_size, others) -> list[int]:
    """vllm-ascend's MLA decode: BNSD_NBSD over the paged latent (the same tensor as key and value) and rope."""
    _not_in_fake(name, input_layout == "BNSD_NBSD" and actual_seq_qlen is None and sparse_mode == 0
                 and atten_mask is None, f"layout {input_layout!r} with a mask or query lengths (speculative decode)")
    _not_in_fake(name, all(v is None for v in others.values()),
                 f"{sorted(k for k, v in others.items() if v is not None)} (quantisation, pse, sinks)")
    _half(name, query, key, query_rope, key_rope)
    _on_device(name, query=query, key=key, value=value, query_rope=query_rope, key_rope=key_rope,
               block_table=block_table)
    _not_in_fake(name, value.data_ptr() == key.data_ptr() and value.shape == key.shape,
                 "a value other than the latent key (MHA paged decode)")
    _require(query.dim() == 4 and query.shape[2] == 1 and query.shape[3] == LATENT,
             f"{name}: query must be [B, N, 1, {LATENT}] in BNSD, got {tuple(query.shape)}")
    batch, heads = query.shape[:2]
    _require(heads == num_query_heads and heads in [1 << i for i in range(8)],
             f"{name}: with a {LATENT}-wide latent, num_query_heads must be 1, 2, 4, ..., 128 and the query's N, "
             f"got {num_query_heads} for N = {heads}")
    _require(num_key_value_heads == 1, f"{name}: the latent is one KV head")
    _require(query_rope is not None and query_rope.shape == (batch, heads, 1, ROPE),
             f"{name}: query_rope must be [B, N, 1, {ROPE}]")
    _require(key.dim() == 4 and key.shape[1] == 1 and key.shape[3] == LATENT,
             f"{name}: key must be the paged latent [blocks, 1, block_size, {LATENT}], got {tuple(key.shape)}")
    _require(key_rope is not None and key_rope.shape == (*key.shape[:3], ROPE),
             f"{name}: key_rope must be [blocks, 1, block_size, {ROPE}] beside key")
    _require(block_size == key.shape[2] and block_size % 16 == 0 and 0 < block_size <= 1024,
             f"{name}: block_size must be the cache's, a multiple of 16 up to 1024, got {block_size}")
    _require(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] >= batch,
             f"{name}: block_table must be int32 [B, max_blocks]")
    lengths = _host_lengths(name, "actual_seq_kvlen", actual_seq_kvlen, batch)
    _require(all(0 <= n <= block_table.shape[1] * block_size for n in lengths),
             f"{name}: actual_seq_kvlen holds per-request lengths within the block table, got {lengths}")
    return lengths


def npu_fused_infer_attention_score_v2(query, key, value, *, query_rope=None, key_rope=None, atten_mask=None,
                                       actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None,
                                       num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0,
                                       input_layout="BSH", sparse_mode=0, block_size=0, return_softmax_lse=False,
                                       **others):
    name = "npu_fused_infer_attention_score_v2"
    _count(name)
    lengths = _check_latent_decode(name, query, key, value, query_rope, key_rope, atten_mask, actual_seq_qlen,
                                   actual_seq_kvlen, block_table, num_query_heads, num_key_value_heads,
                                   input_layout, sparse_mode, block_size, others)
    # A graph would freeze the host lengths and the op's own workspace: captures call .out (vllm-ascend)
    _require(not _graphs.is_capturing(), f"{name}: under graph capture, call .out with a workspace")
    out = torch.empty(query.shape[1], query.shape[0], 1, LATENT, dtype=query.dtype, device=query.device)
    _graphs.launch(_latent_decode, ("out",), query=query, query_rope=query_rope, key=key, key_rope=key_rope,
                   block_table=block_table, lengths=lengths, scale=softmax_scale, out=out)
    return out, query.new_empty(0, dtype=torch.float32)


def _fia_v2_out(query, key, value, *, workspace=None, out, query_rope=None, key_rope=None, atten_mask=None,
                actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None, num_query_heads=1,
                num_key_value_heads=0, softmax_scale=1.0, input_layout="BSH", sparse_mode=0, block_size=0,
                return_softmax_lse=False, **others):
    name = "npu_fused_infer_attention_score_v2.out"
    _count(name)
    lengths = _check_latent_decode(name, query, key, value, query_rope, key_rope, atten_mask, actual_seq_qlen,
                                   actual_seq_kvlen, block_table, num_query_heads, num_key_value_heads,
                                   input_layout, sparse_mode, block_size, others)
    attention_out, softmax_lse = out
    batch, heads = query.shape[:2]
    _require(attention_out.shape == (heads, batch, 1, LATENT) and attention_out.is_contiguous()
             and attention_out.dtype == query.dtype, f"{name}: attention_out must be a contiguous [N, B, 1, "
             f"{LATENT}] (NBSD) in the query's dtype")
    _on_device(name, attention_out=attention_out, softmax_lse=softmax_lse)
    _check_workspace(name, workspace, lambda: _latent_workspace_bytes(batch, heads))
    # the lengths are host data: the op reads them when issued (a graph keeps them until a task-group update)
    _graphs.launch(_latent_decode, ("out",), query=query, query_rope=query_rope, key=key, key_rope=key_rope,
                   block_table=block_table, lengths=lengths, scale=softmax_scale, out=attention_out)


npu_fused_infer_attention_score_v2.out = _fia_v2_out


def _npu_fused_infer_attention_score_v2_get_max_workspace(query, key, value, **kwargs):
    # Sized by the shapes alone: the largest any lengths need (it is "max"). (Not an ATB op: no _count.)
    name = "_npu_fused_infer_attention_score_v2_get_max_workspace"
    calls[name] = calls.get(name, 0) + 1
    return torch.empty(_latent_workspace_bytes(*query.shape[:2]), dtype=torch.uint8, device=query.device)


def _latent_workspace_bytes(batch: int, heads: int) -> int:
    return 4 * batch * heads * (LATENT + ROPE)


def _latent_decode(query, query_rope, key, key_rope, block_table, lengths, scale, out):
    block_size = key.shape[2]
    latent_rows = key.view(-1, block_size, 1, LATENT)  # [blocks, 1, block_size, D] with one KV head
    rope_rows = key_rope.view(-1, block_size, 1, ROPE)
    for b, length in enumerate(lengths):
        blocks = block_table[b, :cdiv(length, block_size)].long()
        c = torch_ref.gather_kv(latent_rows, blocks)[:length, 0].float()  # [L, 512]
        r = torch_ref.gather_kv(rope_rows, blocks)[:length, 0].float()
        scores = (query[b, :, 0].float() @ c.T + query_rope[b, :, 0].float() @ r.T) * scale  # [N, L]
        out[:, b, 0] = (scores.softmax(-1) @ c).to(out.dtype)
