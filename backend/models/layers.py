"""The layers every decoder here is built of, tensor-parallel as vLLM shards them: linear layers whose matmul and
weight layout come from the platform's kernels (column-parallel is a plain Linear over this rank's rows;
RowParallelLinear sums partial products with one all-reduce), the vocab-parallel embedding, RMSNorm, and the gated
SiLU MLP."""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
import torch.nn.functional as F

from backend.distributed import SINGLE, TensorParallel
from npu_llm_kernels.timing import scope


class Linear(nn.Linear):
    """nn.Linear whose matmul and weight layout come from the platform's kernels (see pack); or, once quantized
    (backend/models/quantization.py), an int8 matmul of int8 weights with per-channel scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: ModuleType):
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops
        self.scheme = None  # an Int8Scheme once quantized
        self.input_scale = None  # static activation scale: one per checkpoint layer fused here, then their max
        self.input_offset = None  # msModelSlim's static activation offset (an integer), likewise
        self.weight_offset = None  # msModelSlim's W8A16 weight offset [N, 1] where not zero: w = (q + offset) * scale
        self.lora = None  # with enable_lora: the adapters' slots, added to the output (backend/models/lora.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_lora(self._matmul(x, self.bias), x)

    def _with_lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y if self.lora is None else self.lora.add_to(y, x)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        with scope("matmul"):
            if self.scheme is None:
                return self.ops.linear(x, self.weight, bias)
            if self.scheme.weight_only:
                return self.ops.w8a16_linear(x, self.weight, self.weight_scale, self.weight_offset, bias)
            return self.ops.int8_linear(x, self.weight, self.weight_scale, self.input_scale, bias, self.input_offset)

    def quantize(self, scheme, parts: int) -> None:
        """Hold int8 weights [N, K] and their fp32 scales [N, 1] (and a static input scale per fused part), to be
        loaded from the checkpoint; before loading, on the meta device. Grouped W8A16 scales are [N, K / G], and
        pack-quantized weights arrive as `weight_packed` int32 [N, K / 4] (unpacked after loading). msModelSlim's
        layers hold its tensors too (backend/models/quantization.py folds them after loading): weight_offset [N, 1],
        and for static activations input_offset per part, quant_bias [N] and deq_scale [N], which take the place of
        the float bias."""
        device, n, k = self.weight.device, self.out_features, self.in_features
        if scheme.group_size and k % scheme.group_size:
            raise ValueError(f"{scheme.name}: this layer's {k} input features are not whole groups")
        if scheme.packed and k % 4:
            raise ValueError(f"{scheme.name}: {k} input features do not pack four to an int32 word")
        self.scheme = scheme
        if scheme.packed:
            del self.weight
            self.weight_packed = nn.Parameter(torch.empty(n, k // 4, dtype=torch.int32, device=device),
                                              requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty_like(self.weight, dtype=torch.int8), requires_grad=False)
        groups = k // scheme.group_size if scheme.group_size else 1
        self.weight_scale = nn.Parameter(torch.empty(n, groups, device=device), requires_grad=False)
        if scheme.static:
            self.input_scale = nn.Parameter(torch.empty(parts, device=device), requires_grad=False)
        if scheme.modelslim:
            self.weight_offset = nn.Parameter(torch.empty(n, 1, device=device), requires_grad=False)
        if scheme.modelslim and scheme.static:
            self.input_offset = nn.Parameter(torch.empty(parts, device=device), requires_grad=False)
            self.quant_bias = nn.Parameter(torch.empty(n, dtype=torch.int32, device=device), requires_grad=False)
            self.deq_scale = nn.Parameter(torch.empty(n, device=device), requires_grad=False)
            self.bias = None

    def pack(self) -> None:
        """Swap the loaded weight for the kernels' preferred layout (inference only; weights are final)."""
        if self.scheme is None:
            packed = self.ops.pack_linear_weight(self.weight.data)
        elif self.scheme.weight_only:
            offset = None if self.weight_offset is None else self.weight_offset.data
            packed, scale, offset = self.ops.pack_w8a16_weight(self.weight.data, self.weight_scale.data, offset)
            for name, tensor in (("weight_scale", scale), ("weight_offset", offset)):
                delattr(self, name)
                self.register_buffer(name, tensor, persistent=False)
        else:
            if self.input_scale is not None:  # the parts of a fused layer see one input: one scale covers them all
                self.input_scale = nn.Parameter(self.input_scale.max().reshape(1), requires_grad=False)
            if self.input_offset is not None:  # (msModelSlim's parts agree: checked at load)
                self.input_offset = nn.Parameter(self.input_offset[:1].clone(), requires_grad=False)
            packed = self.ops.pack_int8_weight(self.weight.data)
        if packed is not self.weight.data:
            del self.weight
            self.register_buffer("weight", packed, persistent=False)


class RowParallelLinear(Linear):
    """A Linear whose input features are split across ranks: partial products, summed by one all-reduce;
    the bias is added once, by rank 0's matmul, as vLLM adds it (an msModelSlim layer's folded bias is fp32, which the
    int8 matmul adds in fp32: backend/models/quantization.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: ModuleType, tp: TensorParallel,
                 reduce_results: bool = True):
        super().__init__(in_features, out_features, bias, ops)
        self.tp = tp
        self.reduce_results = reduce_results  # False: the caller sums this partial result with others, once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self._with_lora(self._matmul(x, None if self.tp.rank else self.bias), x)  # (a partial sum, as y is)
        return self.tp.all_reduce(y) if self.reduce_results else y


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds a contiguous range of the vocabulary's rows; a token's row comes from the rank
    that holds it (the others contribute zeros to the all-reduce)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__(tp.split(vocab_size, "vocab_size"), hidden_size)
        self.tp = tp
        self.start = tp.rank * self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.start
        held = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(rows * held.unsqueeze(-1).to(rows.dtype))


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


class MLP(nn.Module):
    def __init__(self, config, ops: ModuleType, tp: TensorParallel = SINGLE, intermediate_size: int | None = None,
                 reduce_results: bool = True):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (expected silu)")
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = tp.split(intermediate_size or config.intermediate_size, "intermediate_size")
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias, ops)
        self.down_proj = RowParallelLinear(self.intermediate_size, config.hidden_size, bias, ops, tp, reduce_results)
        self.ops = ops

    def forward(self, x):
        return self.down_proj(self._activated(x))

    def _activated(self, x):
        """silu(gate) * up: in one pass where the platform's matmul fuses the two (a quantized or adapted gate_up
        has a matmul of its own)."""
        gate_up = self.gate_up_proj
        if gate_up.scheme is None and gate_up.lora is None:
            return self.ops.linear_silu_and_mul(x, gate_up.weight, gate_up.bias)
        return self.ops.silu_and_mul(gate_up(x))
