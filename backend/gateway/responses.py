"""OpenAI response shapes (pydantic): chat completions, text completions, their stream chunks, the model list."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def chunk_json(chunk: BaseModel) -> str:
    """A stream chunk as sent: its usage only in the stream's own last chunk (when the client asked for it)."""
    return chunk.model_dump_json(exclude=None if chunk.usage else {"usage"})


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # a thinking model's reasoning (backend/gateway/reasoning.py), under vLLM's older and newer names
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when its prompt_logprobs extra asks
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: a prefill's hand-over to a decode engine


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # only the keys that changed (role, content, reasoning, tool_calls), as OpenAI sends them
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when its prompt_logprobs extra asks


class CompletionResponse(BaseModel):
    """A text completion; its stream chunks have the same shape (usage only in the last, if asked)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: a prefill's hand-over to a decode engine


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "npu-llm"
    root: str | None = None  # an adapter's folder (vLLM's field)
    parent: str | None = None  # an adapter's base model
    # what a request may send it (OpenRouter's name): ["text"], or ["text", "image"] for a vision-language model
    input_modalities: list[str] = Field(default_factory=lambda: ["text"])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
