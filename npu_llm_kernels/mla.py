"""Multi-head latent attention's kernels (DeepSeek), the portable set: built from a platform's plain ops.

backend/models/mla.py computes the projections and calls these for the cache and the attention; a platform with
fused MLA ops gives its own class with the same methods (the NPU: npu_mla.py). The cache here is one tensor per
layer, [blocks, block_size, 1, kv_lora_rank + rope_dim]: a token's normalised latent kv_c and its rotated k_pe in
one row, which the platform's paged attention reads as both key and value.
"""
from __future__ import annotations

from types import ModuleType

import torch

from npu_llm_kernels import torch_ref  # (a module: torch_ref names this class as its own MLA, importing it back)
from npu_llm_kernels.metadata import AttentionMetadata, cdiv
from npu_llm_kernels.timing import scope


class PortableMLA:
    # q_pe and k_pe rows come in NeoX halves (the loader de-interleaves DeepSeek's pairs), as the rotary op takes them
    rope_interleaved = False
    absorbs_chunks = True  # attend_latents takes chunks of several queries in the absorbed form

    def __init__(self, ops: ModuleType, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float):
        self.ops, self.num_heads, self.scale = ops, num_heads, scale
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim

    @staticmethod
    def check(num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, v_head_dim: int) -> None:
        """Any shape runs here."""

    @staticmethod
    def kv_cache(shape: tuple, kv_lora_rank: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of a layer: one tensor of latent rows, read as both."""
        cache = torch.zeros(shape, dtype=dtype, device=device)
        return cache, cache

    def rope_and_cache(self, q_pe, kv, norm, positions, cos_sin_cache, kv_cache, slot_mapping):
        """q_pe [T, H, rope] and the kv_a projection's output kv [T, rank + rope]: kv_c normalised, q_pe and k_pe
        rotated, the latent row written to its slot. Returns (q_pe, kv_c [T, rank], k_pe [T, 1, rope])."""
        kv_c, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = norm(kv_c.contiguous())
        q_pe, k_pe = self.ops.rotary_embedding(positions, q_pe.contiguous(), k_pe.reshape(-1, 1, self.rope_dim),
                                               cos_sin_cache)
        cache, _ = kv_cache
        rows = torch.cat((kv_c, k_pe.reshape(-1, self.rope_dim)), dim=-1)
        cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, rows)  # one write: key and value are one row
        return q_pe, kv_c, k_pe

    def context(self, kv_cache, metadata: AttentionMetadata, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's whole context from the cache: (kv_c [ctx, rank], k_pe [ctx, 1, rope])."""
        ctx_len = metadata.context_lens[i]
        rows = torch_ref.gather_kv(kv_cache[0], metadata.block_tables[i, :cdiv(ctx_len, metadata.block_size)])[:ctx_len]
        return rows[:, 0, :self.kv_lora_rank], rows[:, :, self.kv_lora_rank:]

    def decode(self, q_latent, q_pe, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        """Absorbed queries [T, H, rank] and [T, H, rope] of decode-only metadata against the cached rows: the
        attended latents [T, H, rank]."""
        cache, _ = kv_cache
        # decode-only metadata: the kernel reads the cache alone, never this step's key and value
        o = self.ops.paged_attention(torch.cat((q_latent, q_pe), dim=-1), None, None, cache, cache, metadata,
                                     self.scale)
        return o[..., :self.kv_lora_rank]

    def prefill(self, q_nope, q_pe, k_nope, k_pe, v, query_lens: list[int], kv_lens: list[int]) -> torch.Tensor:
        """Up-projected prefill chunks as MHA: queries [Tq, H, nope] and [Tq, H, rope]; each chunk's whole context
        as k_nope [Tk, H, nope], the shared k_pe [Tk, 1, rope] and v [Tk, H, v_head_dim], chunk after chunk. A
        chunk's queries are its context's last tokens. Returns [Tq, H, v_head_dim]."""
        query = torch.cat((q_nope, q_pe), dim=-1)
        key = torch.cat((k_nope, k_pe.expand(-1, self.num_heads, -1)), dim=-1)
        out, q_start, k_start = [], 0, 0
        with scope("attention.prefill"):
            for q_len, kv_len in zip(query_lens, kv_lens):
                out.append(self.ops.prefill_attention(query[q_start:q_start + q_len], key[k_start:k_start + kv_len],
                                                      v[k_start:k_start + kv_len], self.scale))
                q_start, k_start = q_start + q_len, k_start + kv_len
        return torch.cat(out)

    def attend_latents(self, q_latent, q_pe, contexts, query_lens: list[int]) -> torch.Tensor:
        """Chunks in the absorbed form: queries [Tq, H, rank] and [Tq, H, rope], chunk after chunk, each against
        its context's (kv_c [ctx, rank], k_pe [ctx, 1, rope]), its queries the context's last tokens. Returns the
        attended latents [Tq, H, rank]."""
        out, start = [], 0
        with scope("attention.prefill"):
            for (kv_c, k_pe), q_len in zip(contexts, query_lens):
                query = torch.cat((q_latent[start:start + q_len], q_pe[start:start + q_len]), dim=-1)
                latent = kv_c.unsqueeze(1)
                out.append(self.ops.prefill_attention(query, torch.cat((latent, k_pe), dim=-1), latent, self.scale))
                start += q_len
        return torch.cat(out)
