"""SamplingParams, Request (one sequence's state) and the outputs the engine hands back."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Annotated

import torch
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


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """One sequence: its tokens, how many of them sit in the KV cache, and when it stops.

    Its block table belongs to the KVCacheManager; its text and logprobs to the OutputProcessor.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int, eos_ids):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # resolved: params.max_tokens or what max_model_len leaves
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_hashes: list[int] = []  # prefix-cache hash chain over its full blocks of tokens
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.eos_token_ids = frozenset(eos_ids)
        self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.arrival_time = time.time()
        self.scheduled_time: float | None = None  # first admitted to a step
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def can_stop(self) -> bool:
        """The output is longer than min_tokens: only now do stop strings count (as in vLLM), and stop tokens
        (vLLM checks >= min_tokens, which is the same since the sampler masks stop tokens until then)."""
        return self.num_output_tokens > self.params.min_tokens

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token_time = time.time()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.time()


@dataclass
class Logprob:
    """One token's log-probability at one position, as vLLM's: the value, its rank (1 = the most likely token)
    and the token's own text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything generated so far (stop string cut unless asked for)
    delta: str  # the text new since the previous output of this request
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    # per generated token: token id -> Logprob, the sampled token first, then the top `logprobs` alternatives
    logprobs: list[dict[int, Logprob]] | None = None
    last_token_time: float | None = None  # when the engine produced this sequence's latest token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_cached_tokens: int
    scheduled_time: float | None = None  # first admitted to a step: queue time ends, prefill begins


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)
