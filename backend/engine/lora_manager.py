"""The adapters a rank holds, as vLLM's LRU LoRA managers keep them: up to max_cpu_loras read and packed in host
memory (least recently used dropped beyond that), and max_loras of them in the model's slots for the steps that use
them (the least recently used slot no sequence of the step needs is reloaded). Each rank keeps its own, reading the
adapter's files itself: its shards differ from the others'."""
from __future__ import annotations

from collections import OrderedDict

from backend.engine.lora_request import LoRARequest
from backend.models.lora import LoRALayers
from backend.models.lora_adapter import PackedLoRA, read_adapter


class LoRAManager:
    @classmethod
    def for_config(cls, model, config) -> "LoRAManager | None":
        """The manager an engine config asks for (enable_lora), or None."""
        if not config.enable_lora:
            return None
        return cls(model, config.max_loras, config.max_lora_rank, config.lora_cpu_capacity)

    def __init__(self, model, max_loras: int, max_rank: int, cpu_capacity: int):
        self.model, self.max_rank, self.cpu_capacity = model, max_rank, cpu_capacity
        self.layers = LoRALayers(model, max_loras, max_rank)
        self.cpu: OrderedDict[int, dict[str, PackedLoRA]] = OrderedDict()  # lora_int_id -> packed, LRU first
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first

    def add(self, lora: LoRARequest) -> dict[str, PackedLoRA]:
        """The adapter read (ValueError naming what is wrong) and kept in host memory; the packed weights."""
        packed = self.cpu.get(lora.lora_int_id)
        if packed is None:
            packed = read_adapter(lora.lora_path, self.model, self.max_rank, self.model.dtype)
            self.cpu[lora.lora_int_id] = packed
            while len(self.cpu) > self.cpu_capacity:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(lora.lora_int_id)
        return packed

    def remove(self, lora_int_id: int) -> None:
        """Forget the adapter: its host copy and its slot (freed for the next one)."""
        self.cpu.pop(lora_int_id, None)
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            self.layers.load(slot, {})

    def activate(self, loras: list[LoRARequest | None]) -> list[int]:
        """Each sequence's slot (-1: the base model), loading the adapters not in one yet; the scheduler never puts
        more than max_loras adapters in a step."""
        needed = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if len(needed) > self.layers.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one step; max_loras is {self.layers.max_loras}")
        for lora_int_id, lora in needed.items():
            if lora_int_id in self.slots:
                self.slots.move_to_end(lora_int_id)
            else:
                self._load(lora, needed)
        return [-1 if lora is None else self.slots[lora.lora_int_id] for lora in loras]

    def _load(self, lora: LoRARequest, needed: dict) -> None:
        used = set(self.slots.values())
        free = [slot for slot in range(self.layers.max_loras) if slot not in used]
        if free:
            slot = free[0]
        else:  # the least recently used adapter this step does not need gives up its slot
            evicted = next(i for i in self.slots if i not in needed)
            slot = self.slots.pop(evicted)
        self.layers.load(slot, self.add(lora))
        self.slots[lora.lora_int_id] = slot
