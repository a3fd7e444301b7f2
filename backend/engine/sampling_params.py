"""SamplingParams: what a request asks of the sampler, validated where it enters (no torch here: the
gateway and the Triton contract use it without loading torch)."""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backend.engine.kv_transfer.params import KVTransferParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing by less overflows fp32 logits.
GREEDY_TEMPERATURE = 1e-5

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(BaseModel):
    """What the output must match (vLLM's StructuredOutputsParams): exactly one of a JSON schema, any JSON
    object, a regular expression, one of a list of strings, or an EBNF grammar (xgrammar's dialect).

    Checked for shape here; whether the schema, regex or grammar compiles is learnt when the engine compiles
    it (backend/engine/structured_outputs.py), which fails the request with the compiler's message.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # a schema, or its JSON text
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    # vLLM's switch: True keeps JSON compact (no free whitespace between tokens)
    disable_any_whitespace: bool = False

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_text(cls, value):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if value is not None and not isinstance(value, (dict, bool)):
            raise ValueError("the JSON schema must be a JSON object")
        return {} if value is True else value

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in _KINDS if self.spec_value(name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice or grammar"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self

    def spec_value(self, kind: str):
        return self.json_schema if kind == "json" else getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if self.spec_value(k) not in (None, False))

    @property
    def key(self) -> tuple:
        """One key per distinct grammar (the compile cache's)."""
        return self.kind, json.dumps(self.spec_value(self.kind), sort_keys=True), self.disable_any_whitespace


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
    # the prompt tokens' logprobs (the first has none), each with this many top alternatives; vLLM's field
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # disaggregated prefill (docs/disaggregation.md): set by the proxy, vLLM's keys
    kv_transfer_params: KVTransferParams | None = None

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

    @model_validator(mode="after")
    def _grammar_ends_with_eos(self):
        if self.structured_outputs is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be used with structured_outputs: the grammar ends the output at EOS")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def for_child(self, index: int) -> "SamplingParams":
        """The params of the index-th of n samples: one sequence each, distinct seeds (as vLLM)."""
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN  # stays int64
        # one sequence scores the prompt the n samples share
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return self.model_copy(update={"n": 1, "seed": seed, "prompt_logprobs": prompt_logprobs})
