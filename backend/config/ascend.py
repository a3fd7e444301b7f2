"""additional_config: vllm-ascend's engine argument, read as vllm-ascend reads it (ascend_config.py), each key mapped
to what it means here (docs/npu.md section 17). Any other key, a typo or a key of vllm-ascend's npu-llm does not
serve, is refused by name (extra="forbid"), where vllm-ascend ignores unknown keys, so that none silently changes
nothing. Pydantic only, no torch.

    {"torchair_graph_config": {"enabled": true}, "chunked_prefill_for_mla": true}

- torchair_graph_config.enabled: graph mode. vllm-ascend dropped torchair in December 2025 (#4814) for ACL graphs,
  which npu-llm captures for decode steps: enabled means enforce_eager=False, whatever enforce_eager says (vllm-ascend
  refuses the two together). Its other keys tune torchair's compiler (cached graphs, multistream, super kernels,
  view and frozen-parameter passes): accepted, with no effect.
- chunked_prefill_for_mla: true turns enable_chunked_prefill on; false changes nothing (npu-llm's chunked prefill is
  one switch for every model, MLA's included: enable_chunked_prefill turns it off).
- enable_weight_nz_layout: npu-llm casts W8A8 weights to FRACTAL_NZ always (vllm-ascend's weight_nz_mode 1); W8A16's
  stay ND, which an eager call needs (docs/npu.md section 13). true is what happens; false is refused.
- ascend_scheduler_config: vllm-ascend's scheduler, gone upstream since v0.12: npu-llm schedules as vLLM's v1 does
  (chunked prefill under a token budget). Accepted, with no effect.
"""
from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, ValidationError

log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TorchairGraphConfig(_Strict):
    """vllm-ascend v0.11's TorchairGraphConfig (its last release with torchair), and v0.9's enable_multistream_moe."""

    enabled: bool = False
    mode: str = ""
    use_cached_graph: bool = False
    use_cached_kv_cache_bytes: bool = False
    graph_batch_sizes: list[int] = []
    graph_batch_sizes_init: bool = False
    enable_multistream_mla: bool = False
    enable_multistream_moe: bool = False
    enable_view_optimize: bool = True
    enable_frozen_parameter: bool = True
    enable_kv_nz: bool = False
    enable_super_kernel: bool = False


class AscendSchedulerConfig(_Strict):
    enabled: bool = False


class AdditionalConfig(_Strict):
    torchair_graph_config: TorchairGraphConfig | None = None
    ascend_scheduler_config: AscendSchedulerConfig | None = None
    chunked_prefill_for_mla: bool | None = None
    enable_weight_nz_layout: bool | None = None

    @property
    def sets_graph_mode(self) -> bool:
        """torchair_graph_config.enabled: graph mode, over enforce_eager."""
        return self.torchair_graph_config is not None and self.torchair_graph_config.enabled


def _reason(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "not a key npu-llm serves of vllm-ascend's additional_config (docs/npu.md section 17)"
    return error["msg"]


def parse(additional_config: dict) -> AdditionalConfig:
    """additional_config read (ValueError naming a key that is unknown or not served)."""
    try:
        return AdditionalConfig.model_validate(additional_config)
    except ValidationError as e:
        raise ValueError("; ".join(f"{'.'.join(map(str, err['loc']))}: {_reason(err)}" for err in e.errors())) from None


def engine_settings(additional_config: dict) -> dict:
    """The EngineConfig fields additional_config sets (ValueError naming a key that is unknown or not served)."""
    config = parse(additional_config)
    settings = {}
    torchair = config.torchair_graph_config
    if config.sets_graph_mode:
        log.info("additional_config: torchair_graph_config.enabled: torchair is gone from vllm-ascend (#4814); "
                 "npu-llm captures ACL graphs of decode steps instead (enforce_eager=False)")
        settings["enforce_eager"] = False
    tuned = sorted(torchair.model_fields_set - {"enabled"}) if torchair is not None else []
    if tuned:
        log.info("additional_config: torchair_graph_config %s tune torchair's compiler, which npu-llm does not run: "
                 "no effect", ", ".join(tuned))
    if config.ascend_scheduler_config is not None:
        log.info("additional_config: ascend_scheduler_config: npu-llm schedules as vLLM's v1 does: no effect")
    if config.chunked_prefill_for_mla:
        settings["enable_chunked_prefill"] = True
    if config.enable_weight_nz_layout is False:
        raise ValueError("enable_weight_nz_layout: false is not served: npu-llm casts W8A8 weights to FRACTAL_NZ "
                         "always (vllm-ascend's default), and keeps W8A16's in ND")
    return settings
