"""OpenAI request and response shapes (pydantic), and their mapping to engine sampling parameters."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backend.engine.sampling_params import INT64_MAX, INT64_MIN, TokenId


class OpenAIModel(BaseModel):
    # Clients send fields we do not use (user, tools, ...): accept and ignore them, as vLLM does.
    # NaN and Infinity (which Python's JSON parser accepts) are refused: no parameter means anything with them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields (the openai SDK sends them through extra_body)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    ignore_eos: bool | None = None

    def sampling_parameters(self, max_tokens: int | None, logprobs: int | None) -> dict:
        """The engine's SamplingParams fields for this request (unset OpenAI fields keep engine defaults)."""
        values = {
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "n": self.n,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "stop": self.stop, "logprobs": logprobs, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
        }
        values = {k: v for k, v in values.items() if v is not None}
        values["max_tokens"] = max_tokens  # None: until max_model_len
        return values

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def engine_parameters(self) -> dict:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_parameters(self.max_completion_tokens or self.max_tokens, logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] = Field(min_length=1)  # token ids go to the engine as they are
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)  # the completions API's default
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, value):
        if isinstance(value, str) and not value:
            raise ValueError("prompt must not be empty")
        return value

    def engine_parameters(self) -> dict:
        return self.sampling_parameters(self.max_tokens, self.logprobs)


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
