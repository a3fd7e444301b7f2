"""Multi-head latent attention on the Ascend NPU: torch_npu's MLA ops, called as vllm-ascend v0.23.0's mla_v1
backend calls them (docs/npu.md section 12).

- The cache is two tensors a layer, as VA's: the normalised latent [blocks, 128, 1, 512] and the rotated rope key
  [blocks, 128, 1, 64], written by npu_kv_rmsnorm_rope_cache, which also normalises kv_c and rotates k_pe.
- The rotary ops (that one and npu_interleave_rope for q_pe) take DeepSeek's interleaved rope pairs and
  de-interleave them themselves: the loader leaves those rows as the checkpoint has them (rope_interleaved).
- Decode: npu_fused_infer_attention_score_v2 on the paged latent (BNSD_NBSD), the absorbed query against the
  latent as both key and value. Under graph capture it is issued in a task group from a preallocated workspace and
  re-issued with each step's lengths before the replay, as VA's update_graph_params does.
- Prefill: npu_fused_infer_attention_score (TND, sparse_mode 3: causal aligned at the bottom right) over the
  up-projected keys and values. Chunks after a cached prefix run as VA's _compute_prefill_context runs them: the
  new tokens causally over themselves, the prefix in chunks of a bounded size without a mask, each call with its
  softmax LSE, merged by npu_attention_update (the chunks bound the op's workspace).
The ops' sizes are DeepSeek V2/V3's: a 512 + 64 latent, 128-wide nope queries and values, at most 128 heads.
"""
from __future__ import annotations

from itertools import accumulate
from types import ModuleType

import torch
import torch_npu

from npu_llm_kernels import torch_ref
from npu_llm_kernels.metadata import AttentionMetadata, GraphCapture, cdiv
from npu_llm_kernels.timing import scope

LATENT, ROPE, HEAD = 512, 64, 128  # the ops' only sizes (docs/npu.md 12.1, 12.3)
MAX_HEADS = 128
MASK_SIZE = 2048  # VA's splitfuse mask: [2048, 2048] int8, 1 above the diagonal (attention/attention_mask.py)
# Context tokens of all a step's sequences in one call at most (VA's chunked-prefill workspace, 128 Ki tokens at most:
# attention/utils.py ascend_chunked_prefill_workspace_size), and the most LSEs npu_attention_update merges
CONTEXT_BUDGET = 128 * 1024
MAX_MERGED = 16
BLOCK = 128  # the NPU's KV block, which VA rounds its context chunks to


class NpuMLA:
    rope_interleaved = True  # the fused rotary ops de-interleave DeepSeek's pairs themselves
    absorbs_chunks = False  # chunks of several queries are up-projected (the decode op here takes one a sequence)

    def __init__(self, ops: ModuleType, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float):
        self.num_heads, self.scale = num_heads, scale
        self.query_heads = 1 << (num_heads - 1).bit_length()  # decode pads the heads to a power of two (VA)

    @staticmethod
    def check(num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, v_head_dim: int) -> None:
        if (kv_lora_rank, rope_dim, nope_dim, v_head_dim) != (LATENT, ROPE, HEAD, HEAD) or num_heads > MAX_HEADS:
            raise ValueError(
                f"the NPU's MLA ops take a {LATENT} + {ROPE} latent, {HEAD}-wide nope queries and values and at most "
                f"{MAX_HEADS} heads a rank (DeepSeek V2/V3's shapes); this model has kv_lora_rank {kv_lora_rank}, "
                f"qk_rope_head_dim {rope_dim}, qk_nope_head_dim {nope_dim}, v_head_dim {v_head_dim} and {num_heads} "
                "heads a rank")

    @staticmethod
    def kv_cache(shape: tuple, kv_lora_rank: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent cache, rope cache), as VA lays out kv_cache[0] and kv_cache[1]."""
        num_blocks, block_size, _, row = shape
        return (torch.zeros(num_blocks, block_size, 1, kv_lora_rank, dtype=dtype, device=device),
                torch.zeros(num_blocks, block_size, 1, row - kv_lora_rank, dtype=dtype, device=device))

    def rope_and_cache(self, q_pe, kv, norm, positions, cos_sin_cache, kv_cache, slot_mapping):
        num_tokens = kv.shape[0]
        # VA get_cos_and_sin_mla: the full-width tables [T, 1, 1, 64], each half's frequencies twice
        half = cos_sin_cache.shape[1] // 2
        rows = cos_sin_cache.index_select(0, positions).to(kv.dtype)
        cos = rows[:, :half].repeat(1, 2).view(num_tokens, 1, 1, 2 * half)
        sin = rows[:, half:].repeat(1, 2).view(num_tokens, 1, 1, 2 * half)
        # OP: npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor; VA rope_single: x [B, N, 1, 64]
        q_pe = torch_npu.npu_interleave_rope(q_pe.reshape(num_tokens, self.num_heads, 1, ROPE).contiguous(), cos, sin)
        latent_cache, rope_cache = kv_cache
        # OP: npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, ..., float epsilon=1e-5,
        #   str cache_mode='Norm', bool is_output_kv=False) -> (k_cache, ckv_cache, k_embed_out, y_out).
        # VA exec_kv_prefill: kv [T, 1, 1, 576], index int64 slots, "PA" mode, is_output_kv=True for the prefill's
        # own keys (decode reads the cache alone, but a step may hold both).
        _, _, k_pe, kv_c = torch_npu.npu_kv_rmsnorm_rope_cache(
            kv.view(num_tokens, 1, 1, -1), norm.weight, cos, sin, slot_mapping.to(torch.int64), rope_cache,
            latent_cache, epsilon=norm.eps, cache_mode="PA", is_output_kv=True)
        q_pe = q_pe.view(num_tokens, self.num_heads, ROPE)
        return q_pe, kv_c.view(num_tokens, LATENT), k_pe.view(num_tokens, 1, ROPE)

    def context(self, kv_cache, metadata: AttentionMetadata, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # (VA gathers with npu_paged_cache_load; an index_select of the blocks is the same rows)
        ctx_len = metadata.context_lens[i]
        blocks = metadata.block_tables[i, :cdiv(ctx_len, metadata.block_size)]
        latent_cache, rope_cache = kv_cache
        return (torch_ref.gather_kv(latent_cache, blocks)[:ctx_len, 0],
                torch_ref.gather_kv(rope_cache, blocks)[:ctx_len])

    def decode(self, q_latent, q_pe, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens, pad = q_latent.shape[0], self.query_heads - self.num_heads
        latent_cache, rope_cache = kv_cache
        block_size = latent_cache.shape[1]
        # VA _forward_decode, no speculative decode, ND cache: BNSD_NBSD, query [T, N, 1, D], the caches as
        # [blocks, 1, block_size, D], value = key (the latent); host per-request KV lengths.
        query = torch.nn.functional.pad(q_latent, (0, 0, 0, pad)).unsqueeze(2).contiguous()
        key = latent_cache.view(-1, 1, block_size, LATENT)
        args = dict(
            query_rope=torch.nn.functional.pad(q_pe, (0, 0, 0, pad)).unsqueeze(2).contiguous(),
            key_rope=rope_cache.view(-1, 1, block_size, ROPE), num_query_heads=self.query_heads,
            num_key_value_heads=1, input_layout="BNSD_NBSD", atten_mask=None, sparse_mode=0,
            softmax_scale=self.scale, block_table=metadata.block_tables, block_size=block_size,
            actual_seq_kvlen=list(metadata.context_lens))
        with scope("attention.decode"):
            if metadata.graph_capture is None:
                out, _ = torch_npu.npu_fused_infer_attention_score_v2(query, key, key, **args)
            else:
                out = _capture_decode(query, key, args, metadata.graph_capture)
        return out.view(self.query_heads, num_tokens, LATENT)[:self.num_heads].transpose(0, 1)

    def prefill(self, q_nope, q_pe, k_nope, k_pe, v, query_lens: list[int], kv_lens: list[int]) -> torch.Tensor:
        """Each sequence's queries (the last query_lens[i] of its kv_lens[i] keys) over its keys."""
        k_pe = k_pe.expand(-1, self.num_heads, -1)
        prefixes = [k - q for q, k in zip(query_lens, kv_lens)]
        if not any(prefixes):
            return self._attend(q_nope, q_pe, k_nope, k_pe, v, query_lens, kv_lens, causal=True)[0].to(q_nope.dtype)
        # VA _compute_prefill_context: the new tokens over themselves, then each chunk of the prefixes, merged
        starts = list(accumulate([0] + kv_lens[:-1]))
        parts = [self._attend_rows(q_nope, q_pe, k_nope, k_pe, v, query_lens,
                                   [(s + p, s + k) for s, p, k in zip(starts, prefixes, kv_lens)], causal=True)]
        chunk = context_chunk(prefixes)
        for first in range(0, max(prefixes), chunk):
            spans = [(s + min(first, p), s + min(first + chunk, p)) for s, p in zip(starts, prefixes)]
            parts.append(self._attend_rows(q_nope, q_pe, k_nope, k_pe, v, query_lens, spans, causal=False))
        tokens = q_nope.shape[0]
        with scope("attention.prefill"):
            # OP: npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type) -> (out, lse): the outputs
            #   weighted by exp(lse_i - logsumexp(lse)); as VA calls it: fp32 lse [T*N] and out [T*N, D], the new
            #   tokens' first, update_type 0
            lses = [lse.reshape(-1) for _, lse in parts]
            outs = [o.float().reshape(tokens * self.num_heads, -1) for o, _ in parts]
            out, _ = torch_npu.npu_attention_update(lses, outs, 0)
        return out.view(tokens, self.num_heads, -1).to(q_nope.dtype)

    def _attend_rows(self, q_nope, q_pe, k_nope, k_pe, v, query_lens, spans, causal: bool):
        """_attend over each sequence's keys in [start, stop) of the given spans."""
        rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(k_nope.device)
        return self._attend(q_nope, q_pe, k_nope[rows], k_pe[rows], v[rows], query_lens, [b - a for a, b in spans],
                            causal, lse=True)

    def _attend(self, q_nope, q_pe, k_nope, k_pe, v, query_lens, kv_lens, causal: bool, lse: bool = False):
        """(out in bf16 [T, N, v_head_dim], fp32 lse [T, N, 1] where asked): one call of the fused attention."""
        if self.num_heads == self.query_heads:  # VA: the rope parts as separate arguments
            query, key, rope = q_nope, k_nope, dict(query_rope=q_pe, key_rope=k_pe)
        else:  # VA with padded heads: q and k concatenated to 192, no rope arguments
            query, key, rope = torch.cat((q_nope, q_pe), dim=-1), torch.cat((k_nope, k_pe), dim=-1), {}
        # "FIA with TND layout only supports bfloat16" (VA): every input cast, the output cast back
        inputs = dict(query=query, key=key, value=v, **rope)
        bf16 = {name: t.to(torch.bfloat16).contiguous() for name, t in inputs.items()}
        # OP: npu_fused_infer_attention_score(query, key, value, *, atten_mask, actual_seq_lengths,
        #   actual_seq_lengths_kv, ..., query_rope, key_rope, num_heads, scale, input_layout, num_key_value_heads,
        #   sparse_mode, ..., softmax_lse_flag) -> (out, lse). As VA _forward_prefill calls it: TND, cumulative host
        #   lengths, sparse_mode 3 with the [2048, 2048] mask; as _compute_prefill_context calls it over a context
        #   chunk: sparse_mode 0, no mask; the lse where it is merged.
        with scope("attention.prefill"):
            return torch_npu.npu_fused_infer_attention_score(
                **bf16, atten_mask=_causal_mask(q_nope.device) if causal else None,
                actual_seq_lengths=list(accumulate(query_lens)), actual_seq_lengths_kv=list(accumulate(kv_lens)),
                num_heads=self.num_heads, num_key_value_heads=self.num_heads, input_layout="TND",
                sparse_mode=3 if causal else 0, scale=self.scale, antiquant_mode=0, antiquant_scale=None,
                block_table=None, block_size=0, softmax_lse_flag=lse)


def context_chunk(prefixes: list[int]) -> int:
    """The prefix tokens a sequence's context chunk holds: VA's share of CONTEXT_BUDGET among the sequences with a
    prefix, in whole blocks, and no smaller than MAX_MERGED - 1 chunks need."""
    share = CONTEXT_BUDGET // sum(p > 0 for p in prefixes) // BLOCK * BLOCK
    fewest = cdiv(cdiv(max(prefixes), MAX_MERGED - 1), BLOCK) * BLOCK
    return max(share, fewest, BLOCK)



_masks: dict[torch.device, torch.Tensor] = {}


def _causal_mask(device) -> torch.Tensor:
    """VA's one splitfuse mask, shared by every layer."""
    if device not in _masks:
        _masks[device] = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=device).triu_(1)
    return _masks[device]


def _capture_decode(query, key, args: dict, capture: GraphCapture) -> torch.Tensor:
    """The decode op in a task group, re-issued with each step's lengths (VA update_graph_params): the lengths are
    host data, which a captured graph would freeze. One workspace, from the op's own sizing, serves every layer."""
    if capture.workspace is None:
        capture.workspace = torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(query, key, key, **args)
    num_tokens = query.shape[0]
    out = torch.empty(args["num_query_heads"], num_tokens, 1, LATENT, dtype=query.dtype, device=query.device)
    lse = torch.empty(num_tokens, dtype=query.dtype, device=query.device)  # VA's softmax_lse: [T], the query's dtype
    stream = torch.npu.current_stream()
    torch.npu.graph_task_group_begin(stream)
    torch_npu.npu_fused_infer_attention_score_v2.out(query, key, key, **args, workspace=capture.workspace,
                                                     out=[out, lse])
    handle = torch.npu.graph_task_group_end(stream)

    def update(context_lens: torch.Tensor) -> None:
        stream = torch.npu.current_stream()
        torch.npu.graph_task_update_begin(stream, handle)
        step = {**args, "actual_seq_kvlen": context_lens.tolist()}
        torch_npu.npu_fused_infer_attention_score_v2.out(query, key, key, **step, workspace=capture.workspace,
                                                         out=[out, lse])
        torch.npu.graph_task_update_end(stream)

    capture.updates.append(update)
    return out
