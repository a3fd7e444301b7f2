"""SamplingParams: what a request asks of the sampler, validated where it enters (no torch here: the
gateway and the Triton contract use it without loading torch)."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing by less overflows fp32 logits.
GREEDY_TEMPERATURE = 1e-5

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class SamplingParams(BaseModel):
    """vLLM's sampling parameters. Unknown fields and out-of-range values raise ValueError naming them.

    Every number is bounded here (int64, no NaN or infinity), so none can overflow a tensor; the bounds
    that depend on the model (vocabulary, max_model_len, max_num_seqs) are checked by the engine's
    add_request. Numbers given as strings ("0.7") are accepted, as Triton clients send them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    n: int = Field(1, ge=1, le=INT64_MAX)  # the engine caps it at max_num_seqs
    temperature: float = Field(1.0, ge=0)  # 0: greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=INT64_MAX)  # -1 or 0: off; above the vocabulary size: off
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)  # None: up to max_model_len
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)  # top-k alternatives per token, besides the sampled one
    skip_special_tokens: bool = True

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value):
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value):
        if any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @model_validator(mode="after")
    def _min_below_max(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def for_child(self, index: int) -> "SamplingParams":
        """The params of the index-th of n samples: one sequence each, distinct seeds (as vLLM)."""
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN  # stays int64
        return self.model_copy(update={"n": 1, "seed": seed})
