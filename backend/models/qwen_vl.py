"""Qwen2.5-VL: a vision transformer whose output takes the place of the image placeholder tokens' embeddings in a
Qwen2 language model (backend/models/llama.py) that rotates q and k by M-RoPE, three position streams.

The vision tower, as transformers' Qwen2_5_VisionTransformerPretrainedModel computes it:
- patches (channels x 2 frames x 14 x 14 values, as the image processor cut them) through a linear embedding (the
  checkpoint's Conv3d, whose stride equals its kernel);
- 2-D rotary: half of each head's frequencies rotate by the patch's row, half by its column;
- blocks of RMSNorm, attention and a gated SiLU MLP; most attend within windows of window_size pixels (the patches
  reordered window by window), those in fullatt_block_indexes over the whole image;
- the merger: each 2x2 group of patches (spatial_merge_size) concatenated, RMSNorm'ed and through an MLP into one
  embedding of the language model's width. The image's tokens are these embeddings, in the processor's order.

M-RoPE: each token's position has a time, a row and a column stream (backend/engine/image_inputs.py builds them);
mrope_section splits a head's rotary frequencies into three runs, each rotating by its stream. Text tokens carry the
same position in all three, which is plain RoPE.

Tensor parallel: the language model is sharded as ever; the vision tower is small and replicated on every rank.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from backend.distributed import SINGLE, TensorParallel
from backend.models.llama import LlamaForCausalLM
from npu_llm_kernels import AttentionMetadata, torch_ref

VISION_EPS = 1e-6


class VisionRMSNorm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_ref.rms_norm(x, self.weight, VISION_EPS)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(len(x), 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # each window (or image) attends within itself
            out[start:stop] = F.scaled_dot_product_attention(
                q[start:stop].transpose(0, 1), k[start:stop].transpose(0, 1), v[start:stop].transpose(0, 1),
            ).transpose(0, 1)
        return self.proj(out.reshape(len(x), -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary in fp32 (as transformers rotates the vision tower's q and k), cos/sin [patches, head_dim]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate)
        self.up_proj = nn.Linear(hidden, intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = VisionRMSNorm(config.hidden_size)
        self.norm2 = VisionRMSNorm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, cu_seqlens):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.linear(pixel_values.to(self.proj.weight.dtype), self.proj.weight.reshape(len(self.proj.weight), -1))


class PatchMerger(nn.Module):
    def __init__(self, config):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.mlp[0].in_features))


class VisionTransformer(nn.Module):
    """Qwen2.5-VL's vision tower: one image's patches [patches, C*T*P*P] and grid (t, h, w) -> its token
    embeddings [t*h*w / merge^2, out_hidden_size]."""

    def __init__(self, config):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.window_patches = config.window_size // self.merge // config.patch_size  # a window's side, merged
        self.full_attention = set(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        self.head_dim = config.hidden_size // config.num_heads
        self.rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid_thw
        x = self.patch_embed(pixel_values)
        cos, sin = self._rotary(t, h, w, x.device)
        order, windows = self._windows(t, h, w)
        group = self.merge**2  # the merger's patches stay together: windows move whole groups
        order_t = torch.as_tensor(order, device=x.device)

        def by_window(a: torch.Tensor) -> torch.Tensor:
            return a.reshape(len(a) // group, group, -1)[order_t].reshape(len(a), -1)

        x, cos, sin = by_window(x), by_window(cos), by_window(sin)
        frames = [i * h * w for i in range(t + 1)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_attention else windows)
        return self.merger(x)[torch.argsort(order_t)]

    def _rotary(self, t: int, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] fp32: row frequencies then column frequencies, each twice (neox halves), with
        the patches in the processor's order (2x2 merge groups together)."""
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")

        def merge_order(a: np.ndarray) -> np.ndarray:
            return a.reshape(h // self.merge, self.merge, w // self.merge, self.merge).transpose(0, 2, 1, 3).ravel()

        positions = torch.from_numpy(np.tile(np.stack((merge_order(rows), merge_order(cols)), -1), (t, 1)))
        quarter = torch.arange(0, self.head_dim // 2, 2, dtype=torch.float32, device="cpu") / (self.head_dim // 2)
        inv_freq = 1.0 / self.rope_theta**quarter  # (head_dim / 4 frequencies, for rows and again for columns)
        freqs = (positions[:, :, None].float() * inv_freq).flatten(1)  # [patches, rows' | columns']
        emb = torch.cat((freqs, freqs), dim=-1).to(device)
        return emb.cos(), emb.sin()

    def _windows(self, t: int, h: int, w: int) -> tuple[np.ndarray, list[int]]:
        """The merge groups in window order (window by window, row-major inside each), and the windows' boundaries in
        patches; transformers' get_window_index, whose padding adds a whole window where a side divides evenly."""
        side, (mh, mw) = self.window_patches, (h // self.merge, w // self.merge)
        pad_h, pad_w = side - mh % side, side - mw % side
        grid = np.pad(np.arange(t * mh * mw).reshape(t, mh, mw), ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
        nh, nw = (mh + pad_h) // side, (mw + pad_w) // side
        grid = grid.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, side * side)
        sizes = (grid >= 0).sum(1)
        bounds = np.concatenate(([0], np.cumsum(sizes[sizes > 0]) * self.merge**2))
        return grid[grid >= 0], bounds.tolist()


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """The language model (a Qwen2 decoder) with the vision tower beside it. `config` is the language model's config
    with `vision_language` set to the whole Qwen2.5-VL config (backend/models/loader.py's load_config)."""

    def __init__(self, config, ops: ModuleType, tp: TensorParallel = SINGLE, expert_parallel: bool = False):
        super().__init__(config, ops, tp, expert_parallel)
        self.visual = VisionTransformer(config.vision_language.vision_config)
        self.mrope_section = list(config.rope_parameters["mrope_section"])
        if 2 * sum(self.mrope_section) != self.model.layers[0].self_attn.rotary_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must split the heads' "
                             f"{self.model.layers[0].self_attn.rotary_dim // 2} rotary frequencies")
        # which stream (0 time, 1 row, 2 column) rotates each of the table's columns: cos | sin, a frequency each
        streams = np.repeat([0, 1, 2], self.mrope_section)
        self.stream_of_column = np.concatenate((streams, streams))

    is_multimodal = True

    def encode_image(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's token embeddings [tokens, hidden], in the language model's dtype, on its device."""
        return self.visual(pixel_values.to(self.visual.patch_embed.proj.weight.device), grid_thw).to(self.dtype)

    def forward(self, input_ids, positions, kv_caches, metadata: AttentionMetadata, image_embeds=None) -> torch.Tensor:
        """positions: [3, tokens] M-RoPE streams; image_embeds: (rows of the batch, their embeddings) or None."""
        x = self.model.embed_tokens(input_ids)
        if image_embeds is not None:
            rows, embeddings = image_embeds
            x[rows] = embeddings
        # each token's own cos | sin row, its columns from the streams mrope_section assigns them
        table = self.cos_sin_cache[positions]  # [3, tokens, rotary_dim]
        streams = torch.as_tensor(self.stream_of_column, device=table.device)
        rows = table.gather(0, streams.expand(1, table.shape[1], -1)).squeeze(0)
        return self.model(None, None, rows, kv_caches, metadata, inputs_embeds=x)
