"""What differs between the architectures we serve, read from their transformers config classes.

All of them are one decoder (backend/models/llama.py): attention with rotary positions, RMSNorm, and a gated
SiLU MLP, which some layers replace by a mixture of experts (backend/models/moe.py). The differences are
flags: which projections carry a bias, whether q and k are RMS-normalised per head (Qwen3, optionally
GLM-4.5), how many of a head's dimensions rotate (GLM-4 and GLM-4.5: half) and whether they rotate in interleaved
pairs (GLM-4), whether the attention and MLP outputs are normalised again (GLM-4-0414), whether attention is
DeepSeek's multi-head latent attention (backend/models/mla.py), and how the experts are routed.
"""
from __future__ import annotations

from dataclasses import dataclass

DENSE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "GlmForCausalLM",
         "Glm4ForCausalLM", "QWenLMHeadModel")  # (the last: Qwen v1, read as Qwen2: backend/models/remote_code.py)
MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM")
LATENT_ATTENTION = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")  # (and their experts)
VISION_LANGUAGE = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")  # (models/qwen_vl.py)
SUPPORTED_ARCHITECTURES = DENSE + MOE + LATENT_ATTENTION + VISION_LANGUAGE


def language_config_of(config):
    """The config the decoder is built from: a vision-language model's text_config, which keeps the whole config as
    `vision_language` (its vision_config and image token), its architectures and its tied embeddings; any other
    model's own."""
    if getattr(config, "architectures", None) and config.architectures[0] in VISION_LANGUAGE:
        text = config.text_config
        text.vision_language, text.architectures = config, config.architectures
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        return text
    return config


def is_mla(config) -> bool:
    """Whether attention is multi-head latent attention (DeepSeek V2/V3), with its latent KV cache."""
    return config.model_type in ("deepseek_v2", "deepseek_v3")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters_of(config) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; 4.x in `rope_scaling` and plain attributes."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def rotary_dim_of(config) -> int:
    """How many leading dimensions of each head rotate: all of them, or partial_rotary_factor of them."""
    factor = rope_parameters_of(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim_of(config) * factor)


def rotates_interleaved(config) -> bool:
    """Whether rotary pairs are adjacent dimensions (2i, 2i + 1: GLM-4's, GPT-J's style) rather than a half apart
    (i, i + d/2: Llama's, which the kernels compute). The loader turns the first into the second by reordering the
    rows of q_proj and k_proj (neox_rows in backend/models/llama.py): q . k is the same under one reordering of both."""
    return config.model_type in ("glm", "glm4")


def has_post_norms(config) -> bool:
    """GLM-4-0414: the attention's and the MLP's outputs are RMS-normalised again before joining the residual."""
    return config.model_type == "glm4"


@dataclass(frozen=True)
class AttentionSpec:
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # RMSNorm over each head of q and k, before rotary


def attention_spec(config) -> AttentionSpec:
    bias = bool(getattr(config, "attention_bias", False))
    if config.model_type in ("qwen2", "qwen2_5_vl_text"):  # q/k/v biases always, no o bias
        return AttentionSpec(qkv_bias=True, o_bias=False, qk_norm=False)
    if config.model_type == "glm4_moe":  # attention_bias covers q/k/v only
        return AttentionSpec(qkv_bias=bias, o_bias=False, qk_norm=bool(config.use_qk_norm))
    if config.model_type in ("glm", "glm4"):  # likewise
        return AttentionSpec(qkv_bias=bias, o_bias=False, qk_norm=False)
    return AttentionSpec(qkv_bias=bias, o_bias=bias, qk_norm=config.model_type in ("qwen3", "qwen3_moe", "qwen3_vl_text"))


@dataclass(frozen=True)
class MoeSpec:
    """One architecture's mixture of experts, in vLLM's FusedMoE terms."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the chosen experts' weights are divided by their sum
    scoring_func: str = "softmax"
    num_expert_group: int | None = None  # group-limited routing: experts in this many groups...
    topk_group: int | None = None  # ...of which the best this many are chosen from
    correction_bias: bool = False  # e_score_correction_bias steers the choice (not the weights)
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # shared experts, run on every token (0: none)

    def check(self) -> None:
        """The routing must be possible: raises ValueError naming the config key that makes it impossible."""
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be between 1 and the {self.num_experts} experts")
        if self.num_expert_group and self.num_expert_group > 1:
            if self.num_experts % self.num_expert_group:
                raise ValueError(f"n_group={self.num_expert_group} must divide the {self.num_experts} experts")
            if not 0 < (self.topk_group or 0) <= self.num_expert_group:
                raise ValueError(f"topk_group={self.topk_group} must be between 1 and n_group={self.num_expert_group}")
            if self.top_k > self.topk_group * self.num_experts // self.num_expert_group:
                raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the experts of topk_group={self.topk_group}"
                                 " groups")


def moe_spec(config) -> MoeSpec | None:
    """The model's mixture of experts, or None for a dense model."""
    if config.model_type == "qwen3_moe":
        return MoeSpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       renormalize=bool(config.norm_topk_prob))
    if config.model_type == "mixtral":
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, renormalize=True)
    if config.model_type == "glm4_moe":
        return MoeSpec(
            config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob), scoring_func="sigmoid", num_expert_group=config.n_group,
            topk_group=config.topk_group, correction_bias=True, routed_scaling_factor=float(config.routed_scaling_factor),
            shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
        )
    if config.model_type == "deepseek_v2":  # softmax; greedy, or group_limited_greedy (groups ranked by their best)
        grouped = getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        return MoeSpec(
            config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob), num_expert_group=config.n_group if grouped else None,
            topk_group=config.topk_group if grouped else None,
            routed_scaling_factor=float(config.routed_scaling_factor),
            shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
        )
    if config.model_type == "deepseek_v3":  # noaux_tc: as GLM-4.5 (which took it from V3)
        return MoeSpec(
            config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob), scoring_func="sigmoid", num_expert_group=config.n_group,
            topk_group=config.topk_group, correction_bias=True, routed_scaling_factor=float(config.routed_scaling_factor),
            shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
        )
    return None


def is_moe_layer(config, index: int) -> bool:
    """Whether decoder layer `index` has experts (else the dense MLP of intermediate_size)."""
    if config.model_type == "qwen3_moe":
        return (index not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (index + 1) % config.decoder_sparse_step == 0)
    if config.model_type == "glm4_moe":
        return index >= config.first_k_dense_replace
    if is_mla(config):  # dense before first_k_dense_replace, then every moe_layer_freq-th layer
        return (config.n_routed_experts is not None and index >= config.first_k_dense_replace
                and index % (getattr(config, "moe_layer_freq", 1) or 1) == 0)
    return config.model_type == "mixtral"


def extra_layers_of(config) -> int:
    """Decoder layers a checkpoint carries beyond num_hidden_layers that the model does not run: GLM-4.5's
    and DeepSeek V3's multi-token-prediction layer (num_nextn_predict_layers), used only for speculative decoding."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)
