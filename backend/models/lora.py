"""Batched LoRA: every adapter-capable Linear of a model gets `max_loras` slots, and one step mixes rows of
different adapters and of the base model, as vLLM's punica kernels do (SGMV: grouped by adapter).

The runner orders a step's sequences so that each adapter's rows are contiguous (decodes first, then prefills, each
group sorted by slot), and hands the layers the step's segments: (slot, first row, end row). A layer then adds, per
segment, `x[rows] @ A^T @ B^T` to its output: one shrink and one expand, on views, with the adapter's scale folded
into B and a fused layer's parts packed into one of each (backend/models/lora_adapter.py). Rows of the base model are
in no segment and pay nothing. Under tensor parallelism a row-parallel layer adds its partial product before the
all-reduce, so the sum carries the adapter once.

The shrink and expand are the platform's `lora_add` (npu_llm_kernels): on the CPU one call of a C++ kernel per layer
for all the step's segments (two library GEMMs per segment cost 50-100 us each there, whatever their size: a decode
step of four adapters took twice the base model's time; docs/lora.md), on CUDA and the NPU torch's matmuls (vllm-ascend's
punica ops are AscendC kernels of its own, not torch_npu's).
"""
from __future__ import annotations

import torch

from backend.models.lora_adapter import TARGET_LAYER, PackedLoRA
from npu_llm_kernels.timing import scope

Segment = tuple[int, int, int]  # (slot, first row, end row)
# How many checkpoint projections each fused layer stacks (each may carry its own A and B).
PARTS = {"qkv_proj": 3, "gate_up_proj": 2, "o_proj": 1, "down_proj": 1}


class LoRASlots:
    """One Linear's adapters, slot by slot (in the kernels' layout), and the step's segments (shared by all layers)."""

    def __init__(self, linear, max_loras: int, step: "LoRALayers"):
        self.ops, self.device = linear.ops, linear.weight.device
        self.weights: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_loras  # None: left alone
        self.step = step

    def load(self, slot: int, packed: PackedLoRA | None) -> None:
        self.weights[slot] = None if packed is None else \
            self.ops.pack_lora_weights(packed.a.to(self.device), packed.b.to(self.device))

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x) plus each segment's adapter, in place."""
        segments = [(start, end, *self.weights[slot]) for slot, start, end in self.step.segments
                    if self.weights[slot] is not None]
        if segments:
            with scope("lora"):
                self.ops.lora_add(y, x, segments)
        return y


class LoRALayers:
    """The model's adapter-capable layers, each given slots; what the runner loads slots and sets segments through."""

    def __init__(self, model, max_loras: int, max_rank: int):
        if getattr(model, "latent_kv", False):
            raise ValueError("enable_lora: latent attention (DeepSeek's MLA) takes no adapters yet")
        self.max_loras, self.max_rank, self.itemsize = max_loras, max_rank, model.dtype.itemsize
        self.segments: list[Segment] = []
        self.layers: dict[str, LoRASlots] = {}
        for name, module in model.named_modules():
            if TARGET_LAYER.fullmatch(name):
                module.lora = self.layers[name] = LoRASlots(module, max_loras, self)

    def slot_bytes(self, model) -> int:
        """What max_loras adapters of max_lora_rank on every layer take on the device, at most (each slot is filled
        when a step first needs it: an accelerator's memory split sets this aside for them)."""
        total = 0
        for name in self.layers:
            linear = model.get_submodule(name)
            width = PARTS[name.rpartition(".")[2]] * self.max_rank
            total += width * (linear.in_features + linear.out_features)
        return total * self.max_loras * self.itemsize

    def load(self, slot: int, adapter: dict[str, PackedLoRA]) -> None:
        for name, layer in self.layers.items():
            layer.load(slot, adapter.get(name))

    def set_segments(self, slots: list[int], query_lens: list[int]) -> None:
        """The step's sequences in the order they run, with their slots (-1: the base model) and token counts."""
        self.segments, row = [], 0
        for slot, length in zip(slots, query_lens):
            if slot >= 0 and self.segments and self.segments[-1][0] == slot and self.segments[-1][2] == row:
                self.segments[-1] = (slot, self.segments[-1][1], row + length)
            elif slot >= 0:
                self.segments.append((slot, row, row + length))
            row += length
