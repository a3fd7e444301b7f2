"""The engine's configuration, at the bottom of the library: it imports nothing else of backend (vLLM keeps its
configs in vllm/config/ likewise). engine.py: EngineConfig, every engine knob; kv_transfer.py: kv_transfer_config;
speculative.py: speculative_config; control_key.py: the deployment's shared secret; addresses.py: loopback or not."""
from backend.config.engine import (
    DEFAULT_MODEL,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    NPU_BLOCK_SIZE,
    QUANTIZATION_CHOICES,
    EngineConfig,
    parse_engine_args,
)
from backend.config.kv_transfer import KVTransferConfig
from backend.config.speculative import MTP_METHODS, SpeculativeConfig

__all__ = ["DEFAULT_MODEL", "DEVICE_CHOICES", "DTYPE_CHOICES", "MTP_METHODS", "NPU_BLOCK_SIZE", "QUANTIZATION_CHOICES",
           "EngineConfig", "KVTransferConfig", "SpeculativeConfig", "parse_engine_args"]
