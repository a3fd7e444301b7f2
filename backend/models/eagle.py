"""EAGLE and EAGLE-3 draft heads (speculative_config methods "eagle" and "eagle3"), in the checkpoint layouts vLLM
loads (its llama_eagle.py and llama_eagle3.py): a folder with a config.json and safetensors, one decoder layer.

Like the MTP layer (mtp.py), a head at position p reads the target's hidden state there and the embedding of the
token at p + 1, and predicts the token at p + 2; it is attached after the target's decoder layers
(model.layers.{num_hidden_layers}), so that it has a layer of the paged KV cache under the same block tables, and it
drafts k tokens by reading its own output back (its hidden state before any final norm), as vLLM recurses it.

    EAGLE:   x = fc([embed(t) | h]);  one decoder layer without its input norm;  logits = the target's lm_head(x)
    EAGLE-3: h = fc([h_a | h_b | h_c]) on the first draft (three target layers' inputs, the "auxiliary" hidden
             states); attention over [input_layernorm(embed(t)) | hidden_norm(h)] (2 x hidden wide), the MLP, then
             norm and the head's own lm_head over a draft vocabulary, whose ids d2t maps to the target's (t = d + d2t[d])

Both share the target's embedding unless the checkpoint carries its own (EAGLE-3 may; vLLM skips EAGLE's).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch
from safetensors import safe_open
from torch import nn

from backend.distributed import SINGLE, TensorParallel
from backend.models.architectures import head_dim_of
from backend.models.layers import MLP, Linear, RMSNorm, VocabParallelEmbedding
from backend.models.llama import Attention, DecoderLayer

def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's three target layers whose inputs EAGLE-3 fuses, unless the head's config names them."""
    return 2, num_layers // 2, num_layers - 3


def head_layer_config(target, head):
    """The head's decoder layer as vLLM builds it: a dense Llama layer at the target's dimensions, whatever the
    target's family (no q/k norms, no experts), with the head's own MLP width and attention bias."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=target.hidden_size, num_attention_heads=target.num_attention_heads,
                       num_key_value_heads=target.num_key_value_heads, head_dim=head_dim_of(target),
                       intermediate_size=getattr(head, "intermediate_size", None) or target.intermediate_size,
                       rms_norm_eps=getattr(head, "rms_norm_eps", target.rms_norm_eps), vocab_size=target.vocab_size,
                       attention_bias=bool(getattr(head, "attention_bias", False)), num_hidden_layers=1,
                       max_position_embeddings=target.max_position_embeddings)


class EagleHead(DecoderLayer):
    """Under tensor parallel its attention and MLP are sharded as the target's layers are; fc is whole on each rank
    (it reads the embedding and hidden state every rank holds)."""

    def __init__(self, config, head_config, index: int, ops: ModuleType, tp: TensorParallel = SINGLE):
        super().__init__(head_layer_config(config, head_config), index, ops, tp)
        hidden = config.hidden_size
        self.fc = Linear(2 * hidden, hidden, False, ops)
        self.input_layernorm = nn.Identity()  # (EAGLE's first layer has none: vLLM and the EAGLE code skip it)
        self.embed_tokens = None  # the target's serves

    def predict(self, embeds, target_hidden, positions, cos_sin_cache, kv_cache, metadata):
        x = self.fc(torch.cat((embeds, target_hidden), dim=-1))
        x, residual = self.forward(x, None, positions, cos_sin_cache, kv_cache, metadata)
        return x + residual

    def greedy_tokens(self, hidden: torch.Tensor, target_logits) -> torch.Tensor:
        return target_logits(hidden).argmax(-1)


class Eagle3Head(nn.Module):
    """Under tensor parallel its attention and MLP are sharded as the target's layers are (and its own embedding by
    vocabulary); fc, the norms, lm_head and d2t are whole on each rank."""

    def __init__(self, config, head_config, ops: ModuleType, own_embedding: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        layer = head_layer_config(config, head_config)
        hidden, eps = layer.hidden_size, layer.rms_norm_eps
        self.fc = Linear(3 * hidden, hidden, False, ops)
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.hidden_norm = RMSNorm(hidden, eps, ops)
        self.self_attn = Attention(layer, ops, tp)
        # the attention reads the embedding and the hidden state side by side
        self.self_attn.qkv_proj = Linear(2 * hidden, self.self_attn.qkv_proj.out_features, layer.attention_bias, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.mlp = MLP(layer, ops, tp)
        self.norm = RMSNorm(hidden, eps, ops)
        draft_vocab = int(getattr(head_config, "draft_vocab_size", None) or config.vocab_size)
        self.lm_head = Linear(hidden, draft_vocab, False, ops)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp) if own_embedding else None

    def predict(self, embeds, target_hidden, positions, cos_sin_cache, kv_cache, metadata):
        if target_hidden.shape[-1] != embeds.shape[-1]:  # the first draft: the three target layers' states, fused
            target_hidden = self.fc(target_hidden)
        residual = target_hidden
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(target_hidden)), dim=-1)
        x = self.self_attn(x, positions, cos_sin_cache, kv_cache, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual

    def greedy_tokens(self, hidden: torch.Tensor, target_logits) -> torch.Tensor:
        draft_ids = self.lm_head(self.norm(hidden)).argmax(-1)
        return draft_ids + self.d2t[draft_ids]


class HeadCheckpoint:
    """An EAGLE / EAGLE-3 folder: its config and its tensors' names, in our model's namespace (the head is
    model.layers.{index}), with what the checkpoint must match checked by name."""

    def __init__(self, method: str, folder: str | Path, target_config):
        self.method, self.folder = method, Path(folder)
        if not (self.folder / "config.json").is_file():
            raise ValueError(f"speculative_config.model={str(folder)!r}: no config.json there (an {method} head's "
                             "folder holds its config.json and safetensors)")
        self.config = _Config(json.loads((self.folder / "config.json").read_text()))
        self.files = sorted(self.folder.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"speculative_config.model={str(folder)!r}: no safetensors files there")
        self.keys = {key for path in self.files for key in safe_open(str(path), framework="pt").keys()}
        self._check(target_config)

    def _check(self, target):
        c, where = self.config, f"speculative_config.model={str(self.folder)!r}"
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(c, name, getattr(target, name)) != getattr(target, name):
                raise ValueError(f"{where}: {name} {getattr(c, name)} is not the target's {getattr(target, name)}")
        if getattr(c, "num_hidden_layers", 1) != 1:
            raise ValueError(f"{where}: heads of one decoder layer are served; this one has {c.num_hidden_layers}")
        if getattr(c, "vocab_size", target.vocab_size) != target.vocab_size:
            raise ValueError(f"{where}: vocab_size {c.vocab_size} is not the target's {target.vocab_size}")
        if getattr(c, "norm_before_residual", False) or getattr(c, "add_para_norm", False):
            raise ValueError(f"{where}: norm_before_residual / add_para_norm heads are not served yet")
        if self.method == "eagle3":
            layers = self.aux_layers(target.num_hidden_layers)
            if len(set(layers)) != 3 or not all(1 <= i < target.num_hidden_layers for i in layers):
                raise ValueError(f"{where}: EAGLE-3 reads three distinct target layers of 1..{target.num_hidden_layers - 1}"
                                 f"; these are {list(layers)}")

    def aux_layers(self, num_layers: int) -> tuple[int, ...]:
        ids = (getattr(self.config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        return tuple(ids) if ids else default_aux_layers(num_layers)

    @property
    def own_embedding(self) -> bool:
        return self.method == "eagle3" and any(k.endswith("embed_tokens.weight") for k in self.keys)

    def our_key(self, stored: str, index: int) -> str | None:
        """The name a stored tensor has in our model, or None for one it does not use (EAGLE's copy of the
        embedding, the reverse map t2d)."""
        key = stored.removeprefix("model.")
        for prefix in ("midlayer.", "layers.0."):
            key = key.removeprefix(prefix)
        if key == "t2d" or (self.method == "eagle" and key.endswith("embed_tokens.weight")):
            return None
        return f"model.layers.{index}.{key}"


class _Config:
    """A head's config.json, read as attributes."""

    def __init__(self, values: dict):
        self.__dict__.update(values)
