"""Batched LoRA: every adapter-capable Linear of a model gets `max_loras` slots, and one step mixes rows of
different adapters and of the base model, as vLLM's punica kernels do (SGMV: grouped by adapter).

The runner orders a step's sequences so that each adapter's rows are contiguous (decodes first, then prefills, each
group sorted by slot), and hands the layers the step's segments: (slot, first row, end row). A layer then adds, per
segment, `x[rows] @ A_slot^T @ B_slot^T` to its output: one shrink and one expand, on views, with the adapter's
scale folded into B and a fused layer's parts packed into one of each (backend/models/lora_adapter.py). Rows of the
base model are in no segment and pay nothing. Under tensor parallelism a row-parallel layer adds its partial
product before the all-reduce, so the sum carries the adapter once.

A slot holds its adapter's A^T [in, w] and B^T [w, out] in the first w = parts x rank columns / rows of tensors
sized for max_lora_rank, so an adapter of a smaller rank costs only its own width.
"""
from __future__ import annotations

import torch

from backend.models.lora_adapter import TARGET_LAYER, PackedLoRA

# How many checkpoint projections each fused layer stacks (each may carry its own A and B).
PARTS = {"qkv_proj": 3, "gate_up_proj": 2, "o_proj": 1, "down_proj": 1}

Segment = tuple[int, int, int]  # (slot, first row, end row)


class LoRASlots:
    """One Linear's adapters, slot by slot, and the segments of the step being run (shared by all layers)."""

    def __init__(self, linear, max_loras: int, max_width: int, step: "LoRALayers"):
        weight = linear.weight
        self.a_t = torch.zeros(max_loras, linear.in_features, max_width, dtype=step.dtype, device=weight.device)
        self.b_t = torch.zeros(max_loras, max_width, linear.out_features, dtype=step.dtype, device=weight.device)
        self.widths = [0] * max_loras  # 0: the slot's adapter leaves this layer alone
        self.step = step

    def load(self, slot: int, packed: PackedLoRA | None) -> None:
        width = 0 if packed is None else packed.a_t.shape[1]
        if width:
            self.a_t[slot, :, :width].copy_(packed.a_t)
            self.b_t[slot, :width].copy_(packed.b_t)
        self.widths[slot] = width

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x) plus each segment's adapter, in place."""
        for slot, start, end in self.step.segments:
            width = self.widths[slot]
            if width:
                shrunk = x[start:end] @ self.a_t[slot, :, :width]
                y[start:end].addmm_(shrunk, self.b_t[slot, :width])
        return y


class LoRALayers:
    """The model's adapter-capable layers, each given slots; what the runner loads slots and sets segments through."""

    def __init__(self, model, max_loras: int, max_rank: int):
        if getattr(model, "latent_kv", False):
            raise ValueError("enable_lora: latent attention (DeepSeek's MLA) takes no adapters yet")
        self.dtype = model.dtype
        self.max_loras = max_loras
        self.segments: list[Segment] = []
        self.layers: dict[str, LoRASlots] = {}
        for name, module in model.named_modules():
            if TARGET_LAYER.fullmatch(name):
                module.lora = self.layers[name] = LoRASlots(module, max_loras, PARTS[name.rpartition(".")[2]] *
                                                            max_rank, self)

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
