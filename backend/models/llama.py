"""One decoder for the Llama family and its descendants: Llama, Qwen2, Mistral, SmolLM2, Qwen3, and the
mixtures of experts Qwen3-MoE, Mixtral and GLM-4.5 differ only in config (backend/models/architectures.py;
the experts are backend/models/moe.py).

Tokens arrive flattened ([num_tokens]) with their positions; there is no padding and no
batch dimension. Attention reads and writes the paged KV cache through the platform's
kernels. q/k/v and gate/up are fused into single matmuls (their checkpoint tensors are
loaded into row ranges, see `stacked_params`).

Tensor parallel (Megatron-style, as vLLM shards these models): q/k/v and gate/up are column-parallel
(each rank holds its heads and its share of the intermediate size), o_proj and down_proj row-parallel
(one all-reduce each), the embedding and lm_head vocab-parallel. KV heads are split across ranks, or
replicated when there are fewer of them than ranks. Each rank's slice of a checkpoint tensor is named
by `checkpoint_shard`.
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
import torch.nn.functional as F

from backend.distributed import SINGLE, TensorParallel
from backend.models.architectures import (
    attention_spec, has_post_norms, head_dim_of, is_mla, is_moe_layer, moe_spec, rope_parameters_of, rotary_dim_of,
    rotates_interleaved,
)
from backend.models.layers import MLP, Linear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from backend.models.mla import MLAttention
from backend.models.moe import FusedMoE, SparseMoeBlock
from npu_llm_kernels import AttentionMetadata, torch_ref
from npu_llm_kernels.timing import scope

KVCache = tuple[torch.Tensor, torch.Tensor]


def rope_theta_of(config) -> float:
    return rope_parameters_of(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))


def rope_type_of(config) -> str:
    params = rope_parameters_of(config)
    return params.get("rope_type", params.get("type", "default"))


def build_cos_sin_cache(config, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32 table of cos | sin, computed as transformers computes it."""
    rope_type = rope_type_of(config)
    if rope_type == "default":
        dim = rotary_dim_of(config)
        inv_freq = 1.0 / (rope_theta_of(config) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    elif rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' changes with sequence length and is not supported")
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


def kv_heads_per_rank(config, tp: TensorParallel) -> int:
    """KV heads split across ranks; fewer heads than ranks: one per rank, each replicated on size / heads ranks."""
    total = config.num_key_value_heads
    if total >= tp.size:
        return tp.split(total, "num_key_value_heads")
    if tp.size % total:
        raise ValueError(f"tensor_parallel_size={tp.size} must be a multiple of num_key_value_heads ({total}) "
                         "when it exceeds it")
    return 1


def check_model(config, size: int = 1, expert_parallel: bool = False) -> None:
    """Whether the model can be built, and sharded over `size` ranks, before any worker starts: its modules are
    built on the meta device with that split, so their own checks raise (no tensor is allocated)."""
    with torch.device("meta"):
        LlamaForCausalLM(config, ops=None, tp=TensorParallel(0, size), expert_parallel=expert_parallel)


class Attention(nn.Module):
    def __init__(self, config, ops: ModuleType, tp: TensorParallel = SINGLE):
        super().__init__()
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(config, tp)
        self.head_dim = head_dim_of(config)
        self.rotary_dim = rotary_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        spec = attention_spec(config)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, ops)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, spec.o_bias, ops, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if spec.qk_norm else None
        self.ops = ops

    def forward(self, x, positions, cos_sin_cache, kv_cache: KVCache, metadata: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # per head (Qwen3): rows of head_dim
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self._rotate(positions, q, k, cos_sin_cache)
        key_cache, value_cache = kv_cache
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        o = self.ops.paged_attention(q, k, v, key_cache, value_cache, metadata, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))

    def _rotate(self, positions, q, k, cos_sin_cache):
        """positions None: cos_sin_cache holds each token's own row (M-RoPE: backend/models/qwen_vl.py), applied in
        torch (the platforms' rotary kernels look rows up by position)."""
        rotary = self.ops.rotary_embedding if positions is not None else _rotate_by_rows
        if self.rotary_dim == self.head_dim:
            return rotary(positions, q, k, cos_sin_cache)
        # Partial rotary (GLM-4, GLM-4.5): the leading rotary_dim dimensions of each head rotate, the rest pass through.
        d = self.rotary_dim
        q_rot, k_rot = rotary(positions, q[..., :d].contiguous(), k[..., :d].contiguous(), cos_sin_cache)
        return torch.cat((q_rot, q[..., d:]), dim=-1), torch.cat((k_rot, k[..., d:]), dim=-1)


def _rotate_by_rows(_positions, q, k, rows: torch.Tensor):
    """Neox rotary of q and k [tokens, heads, dim] by one cos | sin row per token."""
    return torch_ref.rotary_embedding(torch.arange(len(rows), device=rows.device), q, k, rows)


class DecoderLayer(nn.Module):
    def __init__(self, config, index: int, ops: ModuleType, tp: TensorParallel = SINGLE, expert_parallel: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = MLAttention(config, ops, tp) if is_mla(config) else Attention(config, ops, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        if is_moe_layer(config, index):
            self.mlp = SparseMoeBlock(config, moe_spec(config), ops, tp, expert_parallel)
        else:
            self.mlp = MLP(config, ops, tp)
        if has_post_norms(config):
            self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
            self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        else:
            self.post_self_attn_layernorm = self.post_mlp_layernorm = None

    def forward(self, x, residual, positions, cos_sin_cache, kv_cache, metadata):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin_cache, kv_cache, metadata)
        if self.post_self_attn_layernorm is not None:
            x = self.post_self_attn_layernorm(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.post_mlp_layernorm is not None:
            x = self.post_mlp_layernorm(x)
        return x, residual


class LlamaModel(nn.Module):
    def __init__(self, config, ops: ModuleType, tp: TensorParallel = SINGLE, expert_parallel: bool = False):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.num_hidden_layers = config.num_hidden_layers
        self.layers = nn.ModuleList(DecoderLayer(config, i, ops, tp, expert_parallel)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        # EAGLE-3 (backend/models/eagle.py): the layers whose inputs its head fuses, kept by each forward pass
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids, positions, cos_sin_cache, kv_caches, metadata, inputs_embeds=None, after_layers=None):
        """after_layers: (rows, values) added to the hidden states of those rows after the first layers, one per
        layer (Qwen3-VL's DeepStack: backend/models/qwen_vl.py)."""
        x, residual = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds, None
        aux = []
        # (a draft head after them, with its own cache, runs apart: backend/models/mtp.py, eagle.py)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches[:self.num_hidden_layers])):
            if i in self.aux_layers:  # (vLLM's: the layer's input, residual included; never layer 0's)
                aux.append(x + residual)
            x, residual = layer(x, residual, positions, cos_sin_cache, kv_cache, metadata)
            if after_layers and i < len(after_layers):
                rows, values = after_layers[i]
                x[rows] += values  # (x + residual is the hidden state: adding to x adds to it)
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        x, _ = self.norm(x, residual)
        return x


def neox_rows(tensor: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A q or k projection's rows (weight, bias or per-row scales) reordered, within each head, from interleaved
    rotary pairs (2i, 2i + 1) to pairs a half apart (i, rotary_dim/2 + i); the dimensions that do not rotate stay."""
    heads = tensor.reshape(-1, head_dim, *tensor.shape[1:])
    rotating = heads[:, :rotary_dim]
    reordered = torch.cat((rotating[:, 0::2], rotating[:, 1::2], heads[:, rotary_dim:]), dim=1)
    return reordered.reshape(tensor.shape)


# checkpoint tensor name part -> (our fused parameter name part, which shard)
STACKED_MLP = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
STACKED_QKV = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}


class LlamaForCausalLM(nn.Module):
    is_multimodal = False  # (a vision-language model takes images: backend/models/qwen_vl.py)

    def __init__(self, config, ops: ModuleType, tp: TensorParallel = SINGLE, expert_parallel: bool = False):
        super().__init__()
        self.config = config
        self.tp = tp
        self.expert_parallel = expert_parallel
        self.model = LlamaModel(config, ops, tp, expert_parallel)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        vocab_rows = self.model.embed_tokens.num_embeddings  # this rank's share of the vocabulary
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, vocab_rows, bias=False)
        self.ops = ops
        self.lm_head_weight = None  # the output projection in the kernels' layout, set by pack_weights
        attn = self.model.layers[0].self_attn
        # the KV cache: this rank's KV heads; with latent attention one latent row a token (kv_c | k_pe)
        self.latent_kv = isinstance(attn, MLAttention)
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.cache_dim if self.latent_kv else head_dim_of(config)
        self.kv_lora_rank = attn.kv_lora_rank if self.latent_kv else None  # where a latent row's rope part starts
        self.stacked_params = STACKED_MLP if self.latent_kv else {**STACKED_QKV, **STACKED_MLP}
        self.interleaved_rotary = rotates_interleaved(config)
        self.cos_sin_cache = None  # built by init_rope once the model sits on its device and dtype

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights, activations and KV cache are in."""
        return self.model.embed_tokens.weight.dtype

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def shard_sizes(self, key: str, fused_name: str) -> list[int]:
        """Row sizes of the checkpoint tensors stacked into a fused parameter (`key` names the layer's one)."""
        attn = self.model.layers[0].self_attn
        if fused_name == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self._mlp_of(key).intermediate_size] * 2

    def _mlp_of(self, key: str) -> MLP:
        """The dense MLP a checkpoint tensor belongs to: a layer's own, or a MoE layer's shared experts."""
        layer = self.model.layers[int(key.split(".layers.")[1].split(".")[0])]
        return layer.mlp.shared_experts if isinstance(layer.mlp, SparseMoeBlock) else layer.mlp

    def checkpoint_shard(self, key: str) -> tuple[int, int, int] | None:
        """This rank's slice of a checkpoint tensor, as (dimension, start, length); None: the whole tensor."""
        if self.tp.size == 1:
            return None
        attn, rank = self.model.layers[0].self_attn, self.tp.rank
        if self.latent_kv and ".self_attn." in key:
            return _latent_attention_shard(key, attn, rank)
        if ".q_proj." in key:
            return 0, rank * attn.q_size, attn.q_size
        if ".k_proj." in key or ".v_proj." in key:
            first_head = rank * self.config.num_key_value_heads // self.tp.size  # (replicated heads repeat)
            return 0, first_head * attn.head_dim, attn.kv_size
        if ".mlp." not in key:
            return self._checkpoint_shard_outside_mlp(key, attn, rank)
        if ".mlp.gate." in key:
            return None  # the router: replicated
        intermediate = self._mlp_of(key).intermediate_size
        if ".gate_proj." in key or ".up_proj." in key:
            return 0, rank * intermediate, intermediate
        if ".down_proj.weight" in key:  # (and its weight_packed, scales, offsets: _read sizes their columns)
            return 1, rank * intermediate, intermediate
        return None  # the row-parallel bias (added once, by rank 0)

    def _checkpoint_shard_outside_mlp(self, key: str, attn: Attention, rank: int):
        if ".o_proj.weight" in key:
            return 1, rank * attn.q_size, attn.q_size
        # (an EAGLE-3 head's lm_head, model.layers.{n}.lm_head, is over its own draft vocabulary: whole on each rank)
        if key.endswith("embed_tokens.weight") or (key.endswith("lm_head.weight") and ".layers." not in key):
            return 0, self.model.embed_tokens.start, self.model.embed_tokens.num_embeddings
        return None  # norms, and the row-parallel biases (added once, by rank 0)

    def as_our_rows(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor (this rank's slice) in the row order our layers compute in: q and k rows reordered
        for interleaved rotary (architectures.rotates_interleaved)."""
        if self.interleaved_rotary and (".q_proj." in key or ".k_proj." in key) and tensor.dim() and len(tensor) > 1:
            attn = self.model.layers[0].self_attn
            return neox_rows(tensor, attn.head_dim, attn.rotary_dim)
        return tensor

    def init_rope(self, max_positions: int) -> None:
        weight = self.model.embed_tokens.weight
        table = build_cos_sin_cache(self.config, max_positions)
        self.cos_sin_cache = table.to(device=weight.device, dtype=weight.dtype)

    def forward(self, input_ids, positions, kv_caches: list[KVCache], metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a flat batch; its K/V land in kv_caches."""
        return self.model(input_ids, positions, self.cos_sin_cache, kv_caches, metadata)

    @property
    def draft_head(self):
        """The draft head after the decoder layers, where one was attached: the checkpoint's multi-token-prediction
        layer (mtp.py) or an EAGLE / EAGLE-3 head (eagle.py)."""
        layers, n = self.model.layers, self.config.num_hidden_layers
        return layers[n] if len(layers) > n else None

    def draft_inputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the draft head reads of a forward pass: its final hidden states, or EAGLE-3's fused layers' inputs."""
        return self.model.aux_hidden if self.model.aux_layers else hidden

    def draft_hidden(self, next_ids, positions, target_hidden, kv_caches: list[KVCache], metadata: AttentionMetadata):
        """The draft head's hidden states at `positions`, given the tokens after them and the target's hidden states
        there (draft_inputs); its K/V land in the last of kv_caches."""
        head = self.draft_head
        embeds = (head.embed_tokens or self.model.embed_tokens)(next_ids)
        return head.predict(embeds, target_hidden, positions, self.cos_sin_cache, kv_caches[-1], metadata)

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft head's greedy token after each row of its hidden states, in the target's vocabulary."""
        return self.draft_head.greedy_tokens(hidden, self.compute_logits)

    def pack_weights(self) -> None:
        """After loading: every matmul weight into the kernels' layout (the embedding keeps its own for lookups)."""
        for layer in self.model.layers:
            if self.latent_kv:
                layer.self_attn.absorb_weights()
        for module in self.modules():
            if isinstance(module, (Linear, FusedMoE)):
                module.pack()
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head_weight = self.ops.pack_linear_weight(head.data)

    def init_expert_load(self) -> None:
        """One counter, on the model's device, that every MoE layer adds its pairs to (again: from zero). Zeroed in
        place once it exists: captured decode graphs add to the tensor they were captured with."""
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
        if blocks and blocks[0].expert_load is not None:
            blocks[0].expert_load.zero_()
        elif blocks:
            counts = torch.zeros(blocks[0].num_load_ranks, dtype=torch.long, device=self.model.embed_tokens.weight.device)
            for block in blocks:
                block.expert_load = counts

    def expert_load(self) -> list[int]:
        """(token, expert) pairs served per rank since the start, over all MoE layers (empty for a dense model);
        under tensor parallel without expert parallel one entry: every rank serves every pair."""
        block = next((layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)), None)
        return [] if block is None or block.expert_load is None else block.expert_load.tolist()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with scope("matmul"):
            if self.lm_head_weight is not None:
                logits = self.ops.linear(hidden, self.lm_head_weight)
            else:
                weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
                logits = F.linear(hidden, weight)
        return self.tp.all_gather(logits)  # each rank's vocabulary range, in rank order


def _latent_attention_shard(key: str, attn: MLAttention, rank: int) -> tuple[int, int, int] | None:
    """This rank's heads of a latent attention tensor: rows of the query and kv_b projections, columns of o_proj;
    the latent's own projections and norms are replicated."""
    if ".q_b_proj." in key or ".q_proj." in key:
        return 0, rank * attn.num_heads * attn.qk_head_dim, attn.num_heads * attn.qk_head_dim
    if ".kv_b_proj." in key:
        rows = attn.num_heads * (attn.nope_dim + attn.v_head_dim)
        return 0, rank * rows, rows
    if key.endswith("o_proj.weight"):
        return 1, rank * attn.num_heads * attn.v_head_dim, attn.num_heads * attn.v_head_dim
    return None

