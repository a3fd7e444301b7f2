"""One decoder for the Llama family: Llama, Qwen2, Mistral and SmolLM2 differ only in config.

Tokens arrive flattened ([num_tokens]) with their positions; there is no padding and no
batch dimension. Attention reads and writes the paged KV cache through the platform's
kernels. q/k/v and gate/up are fused into single matmuls (their checkpoint tensors are
loaded into row ranges, see `stacked_params`).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
import torch.nn.functional as F

from kernels import AttentionMetadata
from kernels.timing import scope

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

KVCache = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_theta_of(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", 10000.0))


def rope_type_of(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def build_cos_sin_cache(config, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] fp32 table of cos | sin, computed as transformers computes it."""
    rope_type = rope_type_of(config)
    if rope_type == "default":
        dim = head_dim_of(config)
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


class Linear(nn.Linear):
    """nn.Linear whose matmul and weight layout come from the platform's kernels (see pack)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: ModuleType):
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with scope("matmul"):
            return self.ops.linear(x, self.weight, self.bias)

    def pack(self) -> None:
        """Swap the loaded weight for the kernels' preferred layout (inference only; weights are final)."""
        packed = self.ops.pack_linear_weight(self.weight.data)
        if packed is not self.weight.data:
            del self.weight
            self.register_buffer("weight", packed, persistent=False)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: ModuleType):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config, ops: ModuleType):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # Qwen2 has q/k/v biases and no o bias; Llama's attention_bias covers all four.
        qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        o_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, ops)
        self.o_proj = Linear(self.q_size, config.hidden_size, o_bias, ops)
        self.ops = ops

    def forward(self, x, positions, cos_sin_cache, kv_cache: KVCache, metadata: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary_embedding(positions, q, k, cos_sin_cache)
        key_cache, value_cache = kv_cache
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, metadata.slot_mapping)
        o = self.ops.paged_attention(q, k, v, key_cache, value_cache, metadata, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config, ops: ModuleType):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (expected silu)")
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias, ops)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias, ops)
        self.ops = ops

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, ops: ModuleType):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(self, x, residual, positions, cos_sin_cache, kv_cache, metadata):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin_cache, kv_cache, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, ops: ModuleType):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, input_ids, positions, cos_sin_cache, kv_caches, metadata):
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, cos_sin_cache, kv_cache, metadata)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint tensor name part -> (our fused parameter name part, which shard)
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, ops: ModuleType):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, ops)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.ops = ops
        self.lm_head_weight = None  # the output projection in the kernels' layout, set by pack_weights
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.cos_sin_cache = None  # built by init_rope once the model sits on its device and dtype

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights, activations and KV cache are in."""
        return self.model.embed_tokens.weight.dtype

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def shard_sizes(self, fused_name: str) -> list[int]:
        """Row sizes of the checkpoint tensors stacked into a fused parameter."""
        attn = self.model.layers[0].self_attn
        if fused_name == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.config.intermediate_size] * 2

    def init_rope(self, max_positions: int) -> None:
        weight = self.model.embed_tokens.weight
        table = build_cos_sin_cache(self.config, max_positions)
        self.cos_sin_cache = table.to(device=weight.device, dtype=weight.dtype)

    def forward(self, input_ids, positions, kv_caches: list[KVCache], metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a flat batch; its K/V land in kv_caches."""
        return self.model(input_ids, positions, self.cos_sin_cache, kv_caches, metadata)

    def pack_weights(self) -> None:
        """After loading: every matmul weight into the kernels' layout (the embedding keeps its own for lookups)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head_weight = self.ops.pack_linear_weight(head.data)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with scope("matmul"):
            if self.lm_head_weight is not None:
                return self.ops.linear(hidden, self.lm_head_weight)
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            return F.linear(hidden, weight)
