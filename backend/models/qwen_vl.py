"""Qwen2.5-VL and Qwen3-VL: a vision transformer whose output takes the place of the image placeholder tokens'
embeddings in a Qwen2 (Qwen3) language model (backend/models/llama.py) that rotates q and k by M-RoPE, three position
streams.

The vision tower, as transformers' Qwen2_5_VisionTransformerPretrainedModel computes it:
- patches (channels x 2 frames x 14 x 14 values, as the image processor cut them) through a linear embedding (the
  checkpoint's Conv3d, whose stride equals its kernel);
- 2-D rotary: half of each head's frequencies rotate by the patch's row, half by its column;
- blocks of RMSNorm, attention and a gated SiLU MLP; most attend within windows of window_size pixels (the patches
  reordered window by window), those in fullatt_block_indexes over the whole image;
- the merger: each 2x2 group of patches (spatial_merge_size) concatenated, RMSNorm'ed and through an MLP into one
  embedding of the language model's width. The image's tokens are these embeddings, in the processor's order.

Qwen3-VL's tower differs (transformers' Qwen3VLVisionModel): the patch embedding has a bias; a learned table of
positions (a square grid) is resampled bilinearly to the image's grid and added; LayerNorm and a plain GELU MLP in
the blocks; every block attends over the whole image; and DeepStack: the outputs of a few blocks
(deepstack_visual_indexes) go through mergers of their own and are added to the image tokens' hidden states after
the decoder's first layers.

M-RoPE: each token's position has a time, a row and a column stream (backend/engine/image_inputs.py builds them);
mrope_section splits a head's rotary frequencies among the three streams: in three runs (Qwen2.5-VL), or interleaved
time, row, column, time, ... (Qwen3-VL). Text tokens carry the same position in all three, which is plain RoPE.

Tensor parallel: the language model is sharded as ever; the vision tower is small and replicated on every rank.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from backend.distributed import SINGLE, TensorParallel
from backend.models.layers import Linear
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
    def __init__(self, hidden: int, num_heads: int, ops: ModuleType):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv = Linear(hidden, 3 * hidden, True, ops)
        self.proj = Linear(hidden, hidden, True, ops)
        self.ops = ops

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """Each window (or frame) attends within itself (the platform's vision_attention: on the NPU its fused
        attention in TND layout)."""
        q, k, v = self.qkv(x).reshape(len(x), 3, self.num_heads, self.head_dim).unbind(1)
        q, k = self.ops.vision_rotary(q, cos, sin), self.ops.vision_rotary(k, cos, sin)
        out = self.ops.vision_attention(q, k, v.contiguous(), cu_seqlens, self.head_dim**-0.5)
        return self.proj(out.reshape(len(x), -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, ops: ModuleType):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, True, ops)
        self.up_proj = Linear(hidden, intermediate, True, ops)
        self.down_proj = Linear(intermediate, hidden, True, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class PlainVisionMLP(nn.Module):
    """Qwen3-VL's: fc1, the activation, fc2."""

    def __init__(self, config, ops: ModuleType):
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[config.hidden_act]
        self.linear_fc1 = Linear(config.hidden_size, config.intermediate_size, True, ops)
        self.linear_fc2 = Linear(config.intermediate_size, config.hidden_size, True, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config, ops: ModuleType, qwen3: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=VISION_EPS) if qwen3 else VisionRMSNorm(config.hidden_size)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=VISION_EPS) if qwen3 else VisionRMSNorm(config.hidden_size)
        self.attn = VisionAttention(config.hidden_size, config.num_heads, ops)
        self.mlp = PlainVisionMLP(config, ops) if qwen3 else \
            VisionMLP(config.hidden_size, config.intermediate_size, ops)

    def forward(self, x, cos, sin, cu_seqlens):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config, bias: bool = False):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.reshape(len(weight), -1), self.proj.bias)


class PatchMerger(nn.Module):
    def __init__(self, config, ops: ModuleType):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(Linear(merged, merged, True, ops), nn.GELU(),
                                 Linear(merged, config.out_hidden_size, True, ops))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.mlp[0].in_features))


class Qwen3PatchMerger(nn.Module):
    """Qwen3-VL's merger: LayerNorm over each patch (after_shuffle: over each 2x2 group, as DeepStack's), fc1, GELU,
    fc2."""

    def __init__(self, config, ops: ModuleType, after_shuffle: bool = False):
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.after_shuffle = after_shuffle
        self.norm = nn.LayerNorm(merged if after_shuffle else config.hidden_size, eps=VISION_EPS)
        self.linear_fc1 = Linear(merged, merged, True, ops)
        self.linear_fc2 = Linear(merged, config.out_hidden_size, True, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.linear_fc1.in_features
        x = self.norm(x.reshape(-1, merged)) if self.after_shuffle else self.norm(x).reshape(-1, merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def merge_order(a: np.ndarray, merge: int) -> np.ndarray:
    """A frame's [h, w] values in the processor's patch order: 2x2 merge groups together, row-major in each."""
    h, w = a.shape
    return a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).ravel()


def vision_rotary(t: int, h: int, w: int, merge: int, head_dim: int, theta: float, device):
    """cos, sin [patches, head_dim] fp32: row frequencies then column frequencies (head_dim / 4 each), each twice
    (neox halves), with the patches in the processor's order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    positions = torch.from_numpy(np.tile(np.stack((merge_order(rows, merge), merge_order(cols, merge)), -1), (t, 1)))
    quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device="cpu") / (head_dim // 2)
    freqs = (positions[:, :, None].float() * (1.0 / theta**quarter)).flatten(1)  # [patches, rows' | columns']
    emb = torch.cat((freqs, freqs), dim=-1).to(device)
    return emb.cos(), emb.sin()


class VisionTransformer(nn.Module):
    """Qwen2.5-VL's vision tower: one image's patches [patches, C*T*P*P] and grid (t, h, w) -> its token
    embeddings [t*h*w / merge^2, out_hidden_size]."""

    def __init__(self, config, ops: ModuleType):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.window_patches = config.window_size // self.merge // config.patch_size  # a window's side, merged
        self.full_attention = set(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config, ops) for _ in range(config.depth))
        self.merger = PatchMerger(config, ops)
        self.head_dim = config.hidden_size // config.num_heads
        self.rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid_thw
        x = self.patch_embed(pixel_values)
        cos, sin = vision_rotary(t, h, w, self.merge, self.head_dim, self.rope_theta, x.device)
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


class Qwen3VisionTransformer(nn.Module):
    """Qwen3-VL's vision tower: one image's patches and grid -> its token embeddings [tokens, out_hidden_size], and
    DeepStack's beside them: [tokens, out_hidden_size * (1 + len(deepstack_visual_indexes))]."""

    def __init__(self, config, ops: ModuleType):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.side = int(config.num_position_embeddings**0.5)  # the learned positions' square grid
        self.blocks = nn.ModuleList(VisionBlock(config, ops, qwen3=True) for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config, ops)
        self.deepstack_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(config, ops, after_shuffle=True)
                                                   for _ in self.deepstack_indexes)
        self.head_dim = config.hidden_size // config.num_heads
        self.rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid_thw
        x = self.patch_embed(pixel_values) + self._positions(h, w).repeat(t, 1).to(pixel_values.device)
        cos, sin = vision_rotary(t, h, w, self.merge, self.head_dim, self.rope_theta, x.device)
        frames, deepstack = [i * h * w for i in range(t + 1)], []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)

    def _positions(self, h: int, w: int) -> torch.Tensor:
        """The learned position table resampled to an h x w grid (bilinear, corners aligned), in patch order."""
        table = self.pos_embed.weight.reshape(self.side, self.side, -1).permute(2, 0, 1)[None]
        grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)[0]
        order = torch.from_numpy(merge_order(np.arange(h * w).reshape(h, w), self.merge))
        return grid.flatten(1).t()[order].to(self.pos_embed.weight.dtype)


def mrope_streams(section: list[int], interleaved: bool) -> np.ndarray:
    """Which stream (0 time, 1 row, 2 column) rotates each rotary frequency: runs of section[0], [1] and [2]
    frequencies, or interleaved (Qwen3-VL: t, h, w, t, h, w, ..., time alone once rows' and columns' run out)."""
    if not interleaved:
        return np.repeat([0, 1, 2], section)
    streams = np.zeros(sum(section), dtype=np.int64)
    for stream in (1, 2):
        streams[stream:3 * section[stream]:3] = stream
    return streams


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """The language model (a Qwen2 decoder; Qwen3-VL's: a Qwen3 one) with the vision tower beside it. `config` is the
    language model's config with `vision_language` set to the whole config (backend/models/loader.py's load_config)."""

    is_multimodal = True

    def __init__(self, config, ops: ModuleType, tp: TensorParallel = SINGLE, expert_parallel: bool = False):
        super().__init__(config, ops, tp, expert_parallel)
        qwen3 = config.model_type == "qwen3_vl_text"
        vision = config.vision_language.vision_config
        self.visual = (Qwen3VisionTransformer if qwen3 else VisionTransformer)(vision, ops)
        self.num_deepstack = len(vision.deepstack_visual_indexes) if qwen3 else 0
        section = list(config.rope_parameters["mrope_section"])
        if 2 * sum(section) != self.model.layers[0].self_attn.rotary_dim:
            raise ValueError(f"mrope_section {section} must split the heads' "
                             f"{self.model.layers[0].self_attn.rotary_dim // 2} rotary frequencies")
        streams = mrope_streams(section, interleaved=qwen3)
        self.stream_of_column = np.concatenate((streams, streams))  # (the table's columns: cos | sin)

    def encode_image(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's token embeddings [tokens, hidden] (Qwen3-VL: and DeepStack's beside them), in the language
        model's dtype, on its device."""
        return self.visual(pixel_values.to(self.visual.patch_embed.proj.weight.device), grid_thw).to(self.dtype)

    def forward(self, input_ids, positions, kv_caches, metadata: AttentionMetadata, image_embeds=None) -> torch.Tensor:
        """positions: [3, tokens] M-RoPE streams; image_embeds: (rows of the batch, their embeddings) or None."""
        x, deepstack = self.model.embed_tokens(input_ids), None
        if image_embeds is not None:
            rows, embeddings = image_embeds
            parts = embeddings.chunk(1 + self.num_deepstack, dim=-1)
            x[rows] = parts[0]
            deepstack = [(rows, part) for part in parts[1:]]  # added after the first layers (Qwen3-VL)
        # each token's own cos | sin row, its columns from the streams mrope_section assigns them
        table = self.cos_sin_cache[positions]  # [3, tokens, rotary_dim]
        streams = torch.as_tensor(self.stream_of_column, device=table.device)
        rows = table.gather(0, streams.expand(1, table.shape[1], -1)).squeeze(0)
        return self.model(None, None, rows, kv_caches, metadata, inputs_embeds=x, after_layers=deepstack)
