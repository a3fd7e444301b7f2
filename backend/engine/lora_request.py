"""LoRARequest: which adapter a request runs with, as vLLM's (`vllm.lora.request.LoRARequest`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive id the engine keys its loaded copies by, and the PEFT folder it is read from.
    Two requests are the same adapter when their names and ids are (as vLLM compares them)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = field(compare=False)

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must name the adapter's folder")

    @property
    def cache_key(self) -> tuple[str, str, str]:
        """What the prefix cache's hash chain starts from (vLLM's LoRA extra key: name and path)."""
        return "lora", self.lora_name, self.lora_path
