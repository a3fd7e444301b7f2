"""Multi-head latent attention (DeepSeek V2/V3), with a latent KV cache.

Each token caches one row shared by all heads: its compressed KV latent `kv_c` (kv_lora_rank values, after
kv_a_layernorm) and its rotated rope key `k_pe` (qk_rope_head_dim values). That row is the whole KV cache: one
tensor per layer, one "KV head" of kv_lora_rank + qk_rope_head_dim, which the paged-attention kernels read as both
key and value. At DeepSeek V3's shape that is 576 values a token and layer, against 2 * 128 * 192 for the same
attention cached as MHA.

Attention takes the two forms vLLM's MLA backends take:
- Decode, the absorbed form (DeepSeek V2's paper, section 2.1.3): W_UK, the key half of kv_b_proj, is folded into
  the query, so that q_nope . (W_UK kv_c) becomes (W_UK^T q_nope) . kv_c and the query meets the cached latent
  directly; the attention's output, a mix of latents, goes through W_UV, the value half, per head. A decode step
  reads only the latent rows: the bandwidth the latent cache saves.
- Prefill (and each chunk of a chunked prefill, over its cached prefix too), up-projected: the context's latents
  go through kv_b_proj once to per-head keys (nope | the shared k_pe) and values, and the chunk attends as MHA with
  qk_head_dim-wide keys and v_head_dim-wide values. With many queries per key that costs a third of the absorbed
  form's flops (192 + 128 against 576 + 512 multiply-adds a query and key at V3's shape). A chunk of few queries
  over a long context (a verified draft's two tokens, a short chunk after a long prefix) is cheaper absorbed, as a
  decode: each chunk takes the form that costs it less (_absorbs), where the platform's kernels take both.

DeepSeek lays a head's rope dimensions out in interleaved pairs (x0, x1), (x2, x3)...; the platform's MLA
kernels say which layout their rotary takes (the portable ones NeoX's halves, x0, x2, ... | x1, x3, ...; the
NPU's fused ops the pairs, which they de-interleave themselves), and the loader permutes the rope rows of the q and
kv_a projections into it once. q and k are permuted alike, so q . k is unchanged.

The cache and the attention are the platform's MLA kernels (npu_llm_kernels/mla.py, npu_mla.py).

Tensor parallel (as vLLM shards MLA): the heads are split (q_b_proj / q_proj and kv_b_proj by rows, o_proj by
columns); q_a_proj, kv_a_proj_with_mqa and their norms are replicated, and each rank caches the whole latent.
"""
from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import nn

from backend.distributed import SINGLE, TensorParallel
from backend.models.architectures import rope_parameters_of
from backend.models.layers import Linear, RMSNorm, RowParallelLinear
from npu_llm_kernels import AttentionMetadata


def mla_softmax_scale(config) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale squared where the rope is scaled with mscale_all_dim (DeepSeek
    scales q . k as a whole, rope and non-rope dimensions alike; the rope table carries its own factor)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = rope_parameters_of(config)
    factor, mscale_all_dim = rope.get("factor", 1.0), rope.get("mscale_all_dim", 0)
    if rope.get("rope_type", rope.get("type", "default")) != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def interleaved_rope(config) -> bool:
    """Whether the checkpoint's rope dimensions come in interleaved pairs: V2 always, V3 unless rope_interleave
    is false."""
    return config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True))


class MLAttention(nn.Module):
    def __init__(self, config, ops: ModuleType, tp: TensorParallel = SINGLE):
        super().__init__()
        hidden, eps, bias = config.hidden_size, config.rms_norm_eps, bool(getattr(config, "attention_bias", False))
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        # the KV cache: one row of kv_c | k_pe per token, read as a single KV head
        self.num_kv_heads, self.cache_dim = 1, self.kv_lora_rank + self.rope_dim
        self.scale = mla_softmax_scale(config)
        self.interleaved = interleaved_rope(config)
        self.ops = ops
        if ops is not None:  # (None: check_model builds the module to validate the config)
            ops.MLA.check(self.num_heads, self.kv_lora_rank, self.rope_dim, self.nope_dim, self.v_head_dim)
            self.kernels = ops.MLA(ops, self.num_heads, self.kv_lora_rank, self.rope_dim, self.scale)
        q_rows = self.num_heads * self.qk_head_dim
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, ops)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, ops)
            self.q_b_proj = Linear(self.q_lora_rank, q_rows, False, ops)
        else:
            self.q_proj = Linear(hidden, q_rows, False, ops)
        self.kv_a_proj_with_mqa = Linear(hidden, self.cache_dim, bias, ops)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps, ops)
        # loaded as the checkpoint holds it: the up-projected form's matmul over all heads at once (as vLLM's MLA
        # prefill runs it), and split into W_UK and W_UV (absorb_weights) for the absorbed form
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim), False, ops)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_head_dim, hidden, bias, ops, tp)
        self.w_uk: torch.Tensor | None = None  # [heads, nope, kv_lora_rank]: q_nope -> the latent's space
        self.w_uv: torch.Tensor | None = None  # [heads, kv_lora_rank, v_head_dim]: an attended latent -> values

    @property
    def q_up(self) -> Linear:
        """The projection whose rows are the heads' queries."""
        return self.q_b_proj if self.q_lora_rank else self.q_proj

    def absorb_weights(self) -> None:
        """After loading, before packing: the rope rows in the kernels' layout, and W_UK and W_UV split from
        kv_b_proj."""
        if self.interleaved != self.kernels.rope_interleaved:
            pairs_to_halves = torch.cat((torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2)))
            order = pairs_to_halves if self.interleaved else torch.argsort(pairs_to_halves)
            q_rows = torch.arange(self.num_heads * self.qk_head_dim).view(self.num_heads, self.qk_head_dim)
            q_rows[:, self.nope_dim:] = q_rows[:, self.nope_dim:][:, order]
            _permute_rows(self.q_up, q_rows.reshape(-1))
            kv_rows = torch.arange(self.cache_dim)
            kv_rows[self.kv_lora_rank:] = kv_rows[self.kv_lora_rank:][order]
            _permute_rows(self.kv_a_proj_with_mqa, kv_rows)
        w = self.kv_b_proj.weight.data.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        # in the dtype the platform's torch.bmm multiplies fastest (a CPU without bf16 hardware: fp32); these two
        # matmuls run at every step
        dtype = self.ops.matmul_dtype(w.dtype)
        self.w_uk = w[:, :self.nope_dim].to(dtype).contiguous()
        self.w_uv = w[:, self.nope_dim:].transpose(1, 2).to(dtype).contiguous()

    def forward(self, x, positions, cos_sin_cache, kv_cache, metadata: AttentionMetadata):
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(-1, self.num_heads, self.qk_head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe, kv_c, k_pe = self.kernels.rope_and_cache(q_pe, self.kv_a_proj_with_mqa(x), self.kv_a_layernorm,
                                                       positions, cos_sin_cache, kv_cache, metadata.slot_mapping)
        n = metadata.num_decodes
        if n == len(metadata.query_lens):
            return self.o_proj(self._values(self.kernels.decode(self._absorb(q_nope), q_pe, kv_cache, metadata)))
        o = torch.empty(q.shape[0], self.num_heads * self.v_head_dim, dtype=q.dtype, device=q.device)
        if n:
            o[:n] = self._values(self.kernels.decode(self._absorb(q_nope[:n]), q_pe[:n], kv_cache, metadata.decodes()))
        self._prefill(o, q_nope, q_pe, kv_c, k_pe, kv_cache, metadata)
        return self.o_proj(o)

    def _absorb(self, q_nope) -> torch.Tensor:
        """Queries [T, H, nope] into the latent's space: W_UK^T q_nope, [T, H, kv_lora_rank]."""
        return torch.bmm(q_nope.transpose(0, 1).to(self.w_uk.dtype), self.w_uk).transpose(0, 1).to(q_nope.dtype)

    def _values(self, latents) -> torch.Tensor:
        """Attended latents [T, H, kv_lora_rank] through W_UV: [T, H * v_head_dim]."""
        o = torch.bmm(latents.transpose(0, 1).to(self.w_uv.dtype), self.w_uv)  # [H, T, v_head_dim]
        return o.transpose(0, 1).reshape(-1, self.num_heads * self.v_head_dim).to(latents.dtype)

    def _up_project(self, kv_c) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [ctx, kv_lora_rank] to per-head keys' nope parts [ctx, H, nope] and values [ctx, H, v_head_dim]:
        kv_b_proj, one matmul for all heads in the platform's layout (on the CPU twice the speed of per-head fp32
        matmuls from W_UK and W_UV, or more: a bf16 model's runs on bf16 tiles where the CPU has them)."""
        kv = self.kv_b_proj(kv_c).view(-1, self.num_heads, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        return k_nope, v

    def _absorbs(self, q_len: int, ctx_len: int) -> bool:
        """Whether a prefill chunk costs fewer multiply-adds absorbed (attending over rank-wide latent rows: per
        query and key 2 rank - nope - v more a head) than up-projected (which first maps every context latent
        through kv_b_proj: rank (nope + v) a head and key). A verified draft's chunk or a short chunk after a long
        prefix is absorbed; a prompt's own first chunk never is."""
        if not self.kernels.absorbs_chunks:
            return False
        rank, nope, v = self.kv_lora_rank, self.nope_dim, self.v_head_dim
        return q_len * ctx_len * (2 * rank - nope - v) < (ctx_len - q_len) * rank * (nope + v)

    def _prefill(self, o, q_nope, q_pe, kv_c, k_pe, kv_cache, metadata: AttentionMetadata) -> None:
        """The prefill chunks (after the decodes), into their rows of o [T, heads * v_head_dim]: each in the form
        that costs it less (_absorbs)."""
        absorbed, projected, start = [], [], metadata.num_decodes  # (sequence, first token row, query length)
        for i in range(metadata.num_decodes, len(metadata.query_lens)):
            q_len = metadata.query_lens[i]
            (absorbed if self._absorbs(q_len, metadata.context_lens[i]) else projected).append((i, start, q_len))
            start += q_len
        if absorbed:
            rows = torch.cat([torch.arange(first, first + q_len) for _, first, q_len in absorbed]).to(o.device)
            contexts = [self.kernels.context(kv_cache, metadata, i) for i, _, _ in absorbed]
            latents = self.kernels.attend_latents(self._absorb(q_nope[rows]), q_pe[rows], contexts,
                                                  [q_len for *_, q_len in absorbed])
            o[rows] = self._values(latents)
        if projected:
            latents, rope_keys = [], []
            for i, first, q_len in projected:
                if metadata.context_lens[i] == q_len:  # nothing cached before this chunk: its own new rows
                    latents.append(kv_c[first:first + q_len])
                    rope_keys.append(k_pe[first:first + q_len])
                else:
                    cached_c, cached_pe = self.kernels.context(kv_cache, metadata, i)
                    latents.append(cached_c)
                    rope_keys.append(cached_pe)
            rows = torch.cat([torch.arange(first, first + q_len) for _, first, q_len in projected]).to(o.device)
            k_nope, v = self._up_project(torch.cat(latents))
            out = self.kernels.prefill(q_nope[rows], q_pe[rows], k_nope, torch.cat(rope_keys), v,
                                       [q_len for *_, q_len in projected],
                                       [metadata.context_lens[i] for i, _, _ in projected])
            o[rows] = out.reshape(-1, self.num_heads * self.v_head_dim)


def _permute_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight.data.copy_(linear.weight.data[rows])
    if linear.bias is not None:
        linear.bias.data.copy_(linear.bias.data[rows])
