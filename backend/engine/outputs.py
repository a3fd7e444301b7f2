"""What the engine hands back: RequestOutput, with one CompletionOutput per sample (no torch here)."""
from __future__ import annotations

from dataclasses import dataclass, field

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
    # with SamplingParams.prompt_logprobs, once the prompt has run: per prompt token (None for the first) its
    # token id -> Logprob, the token itself first, then the top alternatives
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # a finished prefill on a kv_producer: what a decode engine needs to pull its KV (backend/engine/kv_transfer/)
    kv_transfer_params: dict | None = None
    max_tokens: int | None = None  # resolved: SamplingParams.max_tokens, or what max_model_len leaves the prompt
