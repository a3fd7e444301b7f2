"""npu-llm: LLM serving on Ascend NPUs (and CUDA, CPU) behind NVIDIA Triton."""
from __future__ import annotations

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "LoRARequest"]


def __getattr__(name):
    # Lazy, so `import backend.platform` (or the Triton stub) does not pay for torch + transformers.
    if name == "LLM":
        from backend.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from backend.engine.engine import LLMEngine

        return LLMEngine
    if name == "SamplingParams":
        from backend.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from backend.config import EngineConfig

        return EngineConfig
    if name == "LoRARequest":
        from backend.engine.lora_request import LoRARequest

        return LoRARequest
    raise AttributeError(name)
