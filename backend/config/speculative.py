"""speculative_config: vLLM's engine argument for speculative decoding (docs/speculative-decoding.md). Pydantic only,
no torch: the config and the CLI check it without loading the engine.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 3}
    {"method": "eagle3", "model": "/models/eagle3-head", "num_speculative_tokens": 3}   (or "eagle")
    {"method": "deepseek_mtp", "num_speculative_tokens": 2}   (or "mtp": the checkpoint's own MTP layer)
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MTP_METHODS = ("deepseek_mtp", "mtp")  # vLLM's names for drafting with the checkpoint's MTP layer
EAGLE_METHODS = ("eagle", "eagle3")  # a draft head from its own folder (speculative_config.model)
SPECULATIVE_METHODS = ("ngram", "draft_model", *EAGLE_METHODS, *MTP_METHODS)
# A verification runs num_speculative_tokens + 1 query tokens per request, through the attention that chunked prefill
# takes; beyond a few the drafts' acceptance falls off and a verification costs more than it yields (vLLM's rejection
# sampler takes at most 32). npu-llm's bound.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's defaults when neither prompt_lookup bound is given ("arbitrarily chosen", its comment says)
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(BaseModel):
    """vLLM's keys, as its SpeculativeConfig reads them; keys it has that npu-llm does not honour are refused by
    name (extra="forbid"), so that a config never silently means something else here."""

    model_config = ConfigDict(extra="forbid")

    method: str | None = None  # None with a model: "draft_model", as vLLM infers it
    num_speculative_tokens: int | None = Field(None, ge=1, le=MAX_SPECULATIVE_TOKENS)
    model: str | None = None  # draft_model: the drafting model's folder (or GGUF file); eagle, eagle3: the head's
    prompt_lookup_max: int | None = Field(None, ge=1)  # ngram: the longest suffix matched
    prompt_lookup_min: int | None = Field(None, ge=1)  # ngram: the shortest

    @model_validator(mode="after")
    def _complete(self) -> "SpeculativeConfig":
        if self.method is None and self.model is not None:
            self.method = "draft_model"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"method {self.method!r}: must be one of {', '.join(SPECULATIVE_METHODS)}")
        if self.method in MTP_METHODS:
            # vLLM's default: as many tokens as the checkpoint has MTP layers (DeepSeek's have one)
            self.num_speculative_tokens = self.num_speculative_tokens or 1
        elif self.num_speculative_tokens is None:
            raise ValueError(f"num_speculative_tokens: method {self.method!r} needs it")
        if self.takes_model and not self.model:
            raise ValueError(f"model: method {self.method!r} needs the drafting model's (or head's) folder")
        if not self.takes_model and self.model is not None:
            raise ValueError(f"model: method {self.method!r} takes no model (draft_model, eagle and eagle3 do)")
        lookups = self.prompt_lookup_max is not None or self.prompt_lookup_min is not None
        if self.method != "ngram" and lookups:
            raise ValueError(f"prompt_lookup_max/min: only method 'ngram' takes them, not {self.method!r}")
        if self.method == "ngram":
            self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP
            self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} is above "
                                 f"prompt_lookup_max={self.prompt_lookup_max}")
        return self

    @property
    def takes_model(self) -> bool:
        return self.method == "draft_model" or self.method in EAGLE_METHODS

    @property
    def uses_mtp(self) -> bool:
        return self.method in MTP_METHODS

    @property
    def uses_eagle(self) -> bool:
        return self.method in EAGLE_METHODS

    @property
    def drafts_from_hidden_states(self) -> bool:
        """The draft head reads the target's hidden state at each position, so its KV at a block's last position
        depends on the token after the block, which a prefix-cache hit does not match."""
        return self.uses_mtp or self.uses_eagle


def describe_errors(error: ValidationError) -> str:
    """pydantic's errors as one line, each naming its key: "num_speculative_tokens: Input should be ..."."""
    parts = []
    for e in error.errors():
        where = ".".join(map(str, e["loc"]))
        what = "unknown key (not one npu-llm honours)" if e["type"] == "extra_forbidden" else \
            e["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {what}" if where else what)
    return "; ".join(parts)
