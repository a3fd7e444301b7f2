"""Multi-token prediction (DeepSeek V3, GLM-4.5): the checkpoint's extra decoder layer (num_nextn_predict_layers),
run as a speculative drafter, as vLLM's DeepSeekMTP runs it (for k tokens: applied again to its own output).

At position p it takes the target model's final hidden state h_p and the embedding of the token at p + 1, and
predicts the token at p + 2:
    x = eh_proj([enorm(embed(t_{p+1})) | hnorm(h_p)]);  x = decoder_layer(x);  logits = head(norm(x))
It is a decoder layer with its own KV cache (one more layer in the paged cache, indexed by the same block
tables), so it runs over every position the target computes, prompt and generated, and its draft for a sequence
costs one layer's step. The checkpoint names its tensors model.layers.{num_hidden_layers}.*: the decoder layer's,
plus enorm, hnorm, eh_proj and shared_head.{norm, head}; its embed_tokens is the model's own (shared, and skipped).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from backend.distributed import SINGLE, TensorParallel
from backend.models.layers import Linear, RMSNorm
from backend.models.llama import DecoderLayer
from npu_llm_kernels import AttentionMetadata


class SharedHead(nn.Module):
    def __init__(self, config, ops: ModuleType):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.head = Linear(config.hidden_size, config.vocab_size, False, ops)


class MultiTokenPredictor(DecoderLayer):
    def __init__(self, config, ops: ModuleType, tp: TensorParallel = SINGLE, expert_parallel: bool = False):
        super().__init__(config, config.num_hidden_layers, ops, tp, expert_parallel)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, ops)
        self.hnorm = RMSNorm(hidden, eps, ops)
        self.eh_proj = Linear(2 * hidden, hidden, False, ops)
        self.shared_head = SharedHead(config, ops)

    def predict(self, embeds, target_hidden, positions, cos_sin_cache, kv_cache, metadata: AttentionMetadata):
        """The draft's hidden states [T, hidden] at the given positions: embeds are the next tokens' embeddings,
        target_hidden the target model's final hidden states there. Its K/V land in kv_cache."""
        embeds = embeds.masked_fill((positions == 0)[:, None], 0)  # (vLLM: position 0 has no previous token)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(target_hidden)), dim=-1))
        x, residual = self.forward(x, None, positions, cos_sin_cache, kv_cache, metadata)
        return x + residual  # (before the shared head's norm: what the layer reads back when it drafts on)

    embed_tokens = None  # (the model's own serves: the checkpoint's copy is skipped)

    def greedy_tokens(self, hidden: torch.Tensor, target_logits) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden)).argmax(-1)


def attach_mtp(model) -> None:
    """Give a model (still on the meta device) its checkpoint's multi-token-prediction layer, after its decoder
    layers: model.layers.{num_hidden_layers}, as the checkpoint names it."""
    if not int(getattr(model.config, "num_nextn_predict_layers", 0) or 0):
        raise ValueError("speculative decoding with MTP needs a checkpoint with a multi-token-prediction layer "
                         "(num_nextn_predict_layers >= 1, as DeepSeek V3/R1 and GLM-4.5 have); this one has none")
    model.model.layers.append(MultiTokenPredictor(model.config, model.ops, model.tp, model.expert_parallel))
