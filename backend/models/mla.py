"""Multi-head latent attention (DeepSeek V2/V3), with a latent KV cache.

Each token caches one row shared by all heads: its compressed KV latent `kv_c` (kv_lora_rank values, after
kv_a_layernorm) and its rotated rope key `k_pe` (qk_rope_head_dim values). That row is the whole KV cache: one
tensor per layer, one "KV head" of kv_lora_rank + qk_rope_head_dim, which the paged-attention kernels read as both
key and value. At DeepSeek V3's shape that is 576 values a token and layer, against 2 * 128 * 192 for the same
attention cached as MHA.

Attention runs in the absorbed form (DeepSeek V2's paper, section 2.1.3; vLLM's MLA decode): W_UK, the key half
of kv_b_proj, is folded into the query, so that q_nope . (W_UK kv_c) becomes (W_UK^T q_nope) . kv_c and the query
meets the cached latent directly; the attention's output, a mix of latents, goes through W_UV, the value half,
per head. So no step up-projects the cache: every query attends to [kv_c | k_pe] with [W_UK^T q_nope | q_pe].

DeepSeek lays a head's rope dimensions out in interleaved pairs (x0, x1), (x2, x3)...; the loader permutes those
rows of the q and kv_a projections into halves (x0, x2, ... | x1, x3, ...) once, so the platform's rotary op
(NeoX's halves) rotates them as DeepSeek does. q and k are permuted alike, so q . k is unchanged.

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
        q_rows = self.num_heads * self.qk_head_dim
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, ops)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, ops)
            self.q_b_proj = Linear(self.q_lora_rank, q_rows, False, ops)
        else:
            self.q_proj = Linear(hidden, q_rows, False, ops)
        self.kv_a_proj_with_mqa = Linear(hidden, self.cache_dim, bias, ops)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps, ops)
        # loaded as the checkpoint holds it, then split into the absorbed W_UK and W_UV (absorb_weights)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = RowParallelLinear(self.num_heads * self.v_head_dim, hidden, bias, ops, tp)
        self.w_uk: torch.Tensor | None = None  # [heads, nope, kv_lora_rank]: q_nope -> the latent's space
        self.w_uv: torch.Tensor | None = None  # [heads, kv_lora_rank, v_head_dim]: an attended latent -> values
        self.ops = ops

    @property
    def q_up(self) -> Linear:
        """The projection whose rows are the heads' queries."""
        return self.q_b_proj if self.q_lora_rank else self.q_proj

    def absorb_weights(self) -> None:
        """After loading, before packing: the rope rows de-interleaved, and kv_b_proj split into W_UK and W_UV."""
        if self.interleaved:
            halves = torch.cat((torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2)))
            q_rows = torch.arange(self.num_heads * self.qk_head_dim).view(self.num_heads, self.qk_head_dim)
            q_rows[:, self.nope_dim:] = q_rows[:, self.nope_dim:][:, halves]
            _permute_rows(self.q_up, q_rows.reshape(-1))
            kv_rows = torch.arange(self.cache_dim)
            kv_rows[self.kv_lora_rank:] = kv_rows[self.kv_lora_rank:][halves]
            _permute_rows(self.kv_a_proj_with_mqa, kv_rows)
        w = self.kv_b_proj.weight.data.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        # On the CPU in fp32: torch's bf16 bmm there is ~30x slower than its fp32 one (no oneDNN bf16 path without
        # AVX512-BF16), and these two matmuls run at every step.
        dtype = torch.float32 if w.device.type == "cpu" else w.dtype
        self.w_uk = w[:, :self.nope_dim].to(dtype).contiguous()
        self.w_uv = w[:, self.nope_dim:].transpose(1, 2).to(dtype).contiguous()
        del self.kv_b_proj

    def forward(self, x, positions, cos_sin_cache, kv_cache, metadata: AttentionMetadata):
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(-1, self.num_heads, self.qk_head_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.ops.rotary_embedding(positions, q_pe.contiguous(), k_pe.reshape(-1, 1, self.rope_dim),
                                               cos_sin_cache)
        q_latent = torch.bmm(q_nope.transpose(0, 1).to(self.w_uk.dtype), self.w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat((q_latent.to(q_pe.dtype), q_pe), dim=-1)
        latent = torch.cat((kv_c.unsqueeze(1), k_pe), dim=-1)  # [T, 1, rank + rope]: the cache row
        cache, _ = kv_cache  # (key and value are one tensor)
        self.ops.reshape_and_cache(latent, latent, cache, cache, metadata.slot_mapping)
        o = self.ops.paged_attention(query, latent, latent, cache, cache, metadata, self.scale)
        o = torch.bmm(o[..., :self.kv_lora_rank].transpose(0, 1).to(self.w_uv.dtype), self.w_uv)  # [H, T, v_head_dim]
        return self.o_proj(o.transpose(0, 1).reshape(-1, self.num_heads * self.v_head_dim).to(query.dtype))


def _permute_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight.data.copy_(linear.weight.data[rows])
    if linear.bias is not None:
        linear.bias.data.copy_(linear.bias.data[rows])
