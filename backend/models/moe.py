"""Mixture of experts, built as the serving engines build it: a router, then one FusedMoE layer.

The router (`Router`, in fp32) scores the experts; the platform's `select_experts` picks each token's top-k
(softmax with renormalisation, or sigmoid with a correction bias and expert groups). `FusedMoE` holds the
layer's routed experts stacked, w13 [E, 2 * I, H] (gate rows, then up rows) and w2 [E, H, I], and the
platform's `fused_experts` sorts the tokens by expert, runs the experts' matmuls and combines the results
weighted per token. Shared experts (GLM-4.5) are a plain MLP beside them.

Parallelism, as vLLM shards FusedMoE:
- tensor parallel (default): every rank holds every expert, its share of the intermediate size (w13's rows,
  w2's columns), like the dense MLP;
- expert parallel (`enable_expert_parallel`): rank r holds experts [r * E / N, (r + 1) * E / N) whole.
Either way each rank's output is a partial sum over experts or intermediate columns, and one all-reduce
(with the shared experts' partial sum) completes it. Under tensor parallelism every rank already holds every
token, so the all-reduce is the dispatch and the combine at once.
"""
from __future__ import annotations

import re
from types import ModuleType

import torch
from torch import nn
import torch.nn.functional as F

from backend.distributed import TensorParallel
from backend.models.architectures import MoeSpec
from backend.models.layers import MLP
from npu_llm_kernels.timing import scope

# A checkpoint's expert tensors: one per expert (`experts.3.gate_proj.weight`; Mixtral's w1 / w3 / w2; a quantized
# checkpoint's weight_scale beside them, and zero offsets), or transformers 5's stacked layout per layer
# (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]).
EXPERT_TENSOR = re.compile(
    r"^(?P<block>.+)\.experts\.(?:(?P<expert>\d+)\.(?P<name>gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.(?P<tensor>weight|weight_scale|weight_offset|weight_zero_point)|(?P<stacked>gate_up_proj|down_proj))$"
)
ZERO_OFFSETS = ("weight_offset", "weight_zero_point")  # symmetric int8 weights' offsets: read, checked zero, dropped
PART_OF = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class Router(nn.Module):
    """The gate: one logit per expert, computed in fp32 whatever the model's dtype (the loader keeps its weights
    in fp32, as GLM-4.5's reference does; bf16 logits would round close experts' scores together), with its
    correction bias where it has one."""

    def __init__(self, hidden_size: int, spec: MoeSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.correction_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class FusedMoE(nn.Module):
    def __init__(self, hidden_size: int, spec: MoeSpec, ops: ModuleType, tp: TensorParallel, expert_parallel: bool):
        super().__init__()
        if expert_parallel:
            self.num_local_experts = tp.split(spec.num_experts, "the experts (expert parallel)")
            self.first_expert = tp.rank * self.num_local_experts
            self.intermediate_size = spec.intermediate_size
        else:
            self.num_local_experts, self.first_expert = spec.num_experts, 0
            self.intermediate_size = tp.split(spec.intermediate_size, "the experts' intermediate size")
        self.tp, self.expert_parallel, self.ops = tp, expert_parallel, ops
        shape13 = (self.num_local_experts, 2 * self.intermediate_size, hidden_size)
        self.w13_weight = nn.Parameter(torch.empty(shape13))
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.intermediate_size))
        self.scheme = None  # an Int8Scheme once quantized (backend/models/quantization.py): W8A8 dynamic only
        # (local expert, "gate" | "up" | "down", "weight" | "weight_scale") read from the checkpoint
        self.loaded: set[tuple[int, str, str]] = set()

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.scheme is None:
            return self.ops.fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                          self.first_expert)
        return self.ops.fused_experts_int8(x, self.w13_weight, self.w2_weight, self.w13_weight_scale,
                                           self.w2_weight_scale, topk_weights, topk_ids, self.first_expert)

    def quantize(self, scheme) -> None:
        """Hold int8 expert weights and their fp32 scales per output channel ([E, N, 1]), to be loaded from the
        checkpoint; before loading, on the meta device."""
        self.scheme = scheme
        for name in ("w13", "w2"):
            weight = getattr(self, f"{name}_weight")
            setattr(self, f"{name}_weight", nn.Parameter(torch.empty_like(weight, dtype=torch.int8),
                                                          requires_grad=False))
            setattr(self, f"{name}_weight_scale", nn.Parameter(
                torch.empty(*weight.shape[:2], 1, device=weight.device), requires_grad=False))

    def pack(self) -> None:
        pack = self.ops.pack_expert_weights if self.scheme is None else self.ops.pack_int8_expert_weights
        w13, w2 = pack(self.w13_weight.data, self.w2_weight.data)
        for name, packed in (("w13_weight", w13), ("w2_weight", w2)):
            if packed is not getattr(self, name).data:
                delattr(self, name)
                self.register_buffer(name, packed, persistent=False)

    # -- loading ---------------------------------------------------------------------------------------------

    def load(self, match: re.Match, read) -> None:
        """Copy one checkpoint expert tensor (EXPERT_TENSOR's `match`) into this rank's stacked weights.
        `read(index)` reads the tensor, or the part of it `index` selects, from the file."""
        if match["stacked"]:
            if self.scheme is not None:
                raise ValueError(f"tensor {match.string!r}: quantized experts are read one expert at a time "
                                 "(experts.N.gate_proj.weight and its weight_scale), not stacked")
            last = self.first_expert + self.num_local_experts
            stacked = read((slice(self.first_expert, last),))
            parts = ("gate", "up") if match["stacked"] == "gate_up_proj" else ("down",)
            width = stacked.shape[1] // 2 if parts == ("gate", "up") else None
            for local in range(self.num_local_experts):
                for i, part in enumerate(parts):
                    whole = stacked[local] if width is None else stacked[local, i * width:(i + 1) * width]
                    self._copy(local, part, "weight", self._shard(whole, part), match.string)
            return
        local = int(match["expert"]) - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert (expert parallel): not even read
        part, tensor = PART_OF[match["name"]], match["tensor"]
        if tensor in ZERO_OFFSETS:
            if read(()).any():
                raise ValueError(f"tensor {match.string!r} is not zero: asymmetric int8 weights are not served")
            return
        if tensor == "weight_scale" and self.scheme is None:
            raise ValueError(f"unexpected tensor {match.string!r}: config.json does not quantize these experts")
        self._copy(local, part, tensor, read(self._shard_index(part, tensor)), match.string)

    def _shard_index(self, part: str, tensor: str = "weight"):
        """Which slice of one expert's tensor this rank holds: all of it, or its intermediate columns (of a
        down projection's weight; the rows of the gate and up projections' weights and scales)."""
        if self.expert_parallel or self.tp.size == 1:
            return ()
        cols = slice(self.tp.rank * self.intermediate_size, (self.tp.rank + 1) * self.intermediate_size)
        if part == "down":
            return (slice(None), cols) if tensor == "weight" else ()
        return (cols,)

    def _shard(self, whole: torch.Tensor, part: str) -> torch.Tensor:
        index = self._shard_index(part)
        return whole[index] if index else whole

    def _copy(self, local: int, part: str, tensor: str, value: torch.Tensor, key: str) -> None:
        size = self.intermediate_size
        w13, w2 = getattr(self, f"w13_{tensor}").data, getattr(self, f"w2_{tensor}").data
        dest = {"gate": w13[local, :size], "up": w13[local, size:], "down": w2[local]}[part]
        if tuple(value.shape) != tuple(dest.shape):
            raise ValueError(f"tensor {key!r} has shape {tuple(value.shape)}, expected {tuple(dest.shape)} for "
                             f"expert {self.first_expert + local}'s {part} projection")
        if (dest.dtype == torch.int8) != (value.dtype == torch.int8):
            raise ValueError(f"tensor {key!r} is {str(value.dtype).removeprefix('torch.')}, where the checkpoint's "
                             f"quantization (or its absence) makes it {str(dest.dtype).removeprefix('torch.')}")
        dest.copy_(value)
        self.loaded.add((local, part, tensor))

    def missing(self) -> list[str]:
        """The experts' tensors the checkpoint did not hold, as `expert 3 up` (or `expert 3 up weight_scale`)."""
        tensors = ("weight",) if self.scheme is None else ("weight", "weight_scale")
        return [f"expert {self.first_expert + local} {part}" + ("" if tensor == "weight" else f" {tensor}")
                for local in range(self.num_local_experts) for part in ("gate", "up", "down") for tensor in tensors
                if (local, part, tensor) not in self.loaded]


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP when it has experts: routed experts, plus shared experts where the model has them."""

    def __init__(self, config, spec: MoeSpec, ops: ModuleType, tp: TensorParallel, expert_parallel: bool):
        super().__init__()
        spec.check()
        self.spec, self.ops, self.tp = spec, ops, tp
        self.gate = Router(config.hidden_size, spec)
        self.experts = FusedMoE(config.hidden_size, spec, ops, tp, expert_parallel)
        self.shared_experts = (MLP(config, ops, tp, spec.shared_intermediate_size, reduce_results=False)
                               if spec.shared_intermediate_size else None)
        # (token, expert) pairs each rank has served, counted from the router's choice, which every rank makes
        # alike: under expert parallel a pair goes to the rank holding its expert; under tensor parallel, to all.
        # One counter for the whole model (set by LlamaForCausalLM.init_expert_load), so reading it is one copy.
        self.experts_per_rank = self.experts.num_local_experts if expert_parallel else spec.num_experts
        self.num_load_ranks = tp.size if expert_parallel else 1
        self.expert_load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        with scope("moe.router"):
            topk_weights, topk_ids = self.ops.select_experts(
                self.gate(x), spec.top_k, spec.renormalize, spec.scoring_func, spec.num_expert_group,
                spec.topk_group, self.gate.e_score_correction_bias, spec.routed_scaling_factor)
        if self.expert_load is not None:
            ranks = topk_ids.reshape(-1).long() // self.experts_per_rank  # (fixed shapes: fine under graph capture)
            self.expert_load.index_add_(0, ranks, torch.ones_like(ranks))
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)
