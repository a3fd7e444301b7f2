"""vLLM's utility requests: POST /tokenize (a prompt, or messages through the chat template) and POST /detokenize."""
from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from backend.engine.sampling_params import TokenId
from backend.gateway.protocol import RESERVED_TEMPLATE_KWARGS, ChatMessage, OpenAIModel, Tool


class UtilityRequest(OpenAIModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None  # (optional, as vLLM's; when given it must be the served one)


class TokenizeRequest(UtilityRequest):
    """Either `prompt` or `messages` (through the chat template, with tools and its variables). Unless
    add_special_tokens says otherwise, the text is encoded as the engine encodes a prompt (special tokens added,
    but no second BOS where the text starts with one), so `count` is what a completion's prompt_tokens would be."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # (none: true)
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages, one of them")
        chat_only = [name for name in ("tools", "chat_template_kwargs", "add_generation_prompt")
                     if getattr(self, name) is not None]
        if self.prompt is not None and chat_only:
            raise ValueError(f"{', '.join(chat_only)}: only with messages (they go to the chat template)")
        reserved = sorted(set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs: the server sets {', '.join(reserved)} itself")
        return self


class DetokenizeRequest(UtilityRequest):
    tokens: list[TokenId]
