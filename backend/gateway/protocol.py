"""OpenAI request shapes (pydantic), and their mapping to engine sampling parameters."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from backend.engine.sampling_params import INT64_MAX, INT64_MIN, StructuredOutputsParams, TokenId

# Fields a client may send that this server cannot honour: refused by name (400), never silently dropped.
UNSUPPORTED = {
    "logit_bias": "logit_bias is not supported",
    "functions": "functions (deprecated) is not supported; use tools",
    "function_call": "function_call (deprecated) is not supported; use tool_choice",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "suffix": "suffix is not supported",
    "best_of": "best_of is not supported; use n",
    "web_search_options": "web search is not supported",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported (xgrammar has no such option)",
    "reasoning_effort": "reasoning_effort is not supported; a thinking model's own switch goes in chat_template_kwargs "
                        "(Qwen3's enable_thinking)",
    "verbosity": "verbosity is not supported",
}
# OpenAI's metadata fields: they change nothing about the output, so they are accepted and have no effect.
METADATA = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})
# A metadata field within OpenAI's limits: 16 pairs, keys of up to 64 characters, values of up to 512.
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
                     Field(max_length=16)]
# What the server passes to apply_chat_template itself, or what would change what it returns: not the request's.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens",
})


def without_refused(data: dict, unsupported: dict[str, str], dropped: frozenset[str],
                    asks: Callable[[str, Any], bool]) -> dict:
    """A request's top level with the fields it may not use: each of `unsupported` that `asks` for something is
    refused (ValueError, with its reason); those that ask for nothing, and the `dropped` ones, are left out."""
    for name, why in unsupported.items():
        if asks(name, data.get(name)):
            raise ValueError(why)
    return {key: value for key, value in data.items() if key not in dropped and key not in unsupported}


class OpenAIModel(BaseModel):
    # Unknown fields inside a request's parts (messages, tools) are ignored. NaN and Infinity (which Python's JSON
    # parser accepts) are refused: no parameter means anything with them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self

    def structured_outputs(self) -> StructuredOutputsParams:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=self.json_schema.schema_)


class SamplingFields(OpenAIModel):
    """A request's top level: a field this server does not know is refused (400, "unknown field"), as are the
    fields it cannot honour (UNSUPPORTED), so a client never gets output that silently ignored what it asked.
    OpenAI's metadata fields (METADATA) are accepted and change nothing."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
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
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # the prompt tokens' logprobs, with this many alternatives
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* extras
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: disaggregated prefill's hand-over, set by a proxy; honoured only by a gateway started with
    # --allow-kv-transfer-params (backend/gateway/serving.py), else dropped
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if not isinstance(data, dict):
            return data
        kept = without_refused(data, UNSUPPORTED, METADATA | {"modalities"},  # (empty: nothing asked)
                               lambda name, value: value not in (None, {}, []) and not (name == "best_of" and value == 1))
        if data.get("modalities") not in (None, ["text"]):
            raise ValueError("modalities: only [\"text\"] is supported")
        # what is left of them asks for nothing (null, empty, best_of 1, text): no field of the request's
        return kept

    @model_validator(mode="after")
    def _one_constraint(self):
        self.constraint()  # raises (a 400 naming the fields) when several are given
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        """What the output must match, from whichever of the fields names it (at most one may)."""
        given = {}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self.response_format.structured_outputs()
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        for kind, value in guided.items():
            if value is not None:
                given[f"guided_{kind}"] = StructuredOutputsParams.model_validate({kind: value})
        if len(given) > 1:
            raise ValueError(f"give one of {', '.join(given)}, not several")
        return next(iter(given.values()), None)

    def sampling_parameters(self, max_tokens: int | None, logprobs: int | None,
                            constraint: StructuredOutputsParams | None = None) -> dict:
        """The engine's SamplingParams fields for this request (unset OpenAI fields keep engine defaults)."""
        values = {
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "n": self.n,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "stop": self.stop, "logprobs": logprobs, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            "prompt_logprobs": self.prompt_logprobs,
            "structured_outputs": constraint,
            "kv_transfer_params": self.kv_transfer_params,
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


class ImageUrl(OpenAIModel):
    url: str = Field(min_length=1)  # data:image/...;base64,..., file://... or http(s)://... (backend/gateway/media.py)
    detail: Literal["auto", "low", "high"] | None = None  # (accepted, as vLLM accepts it: the model sees every pixel)


class ImageUrlPart(OpenAIModel):
    """An image in a user's message (a vision-language model's)."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(OpenAIModel):
    """A tool call of an earlier assistant turn, sent back in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this is the result of
    name: str | None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    @model_validator(mode="after")
    def _images_from_users(self):
        if self.role != "user" and self.image_urls:
            raise ValueError(f"a {self.role} message cannot carry images (only user messages do)")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else \
            "".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def image_urls(self) -> list[str]:
        return [] if isinstance(self.content, (str, type(None))) else \
            [p.image_url.url for p in self.content if isinstance(p, ImageUrlPart)]

    def for_template(self) -> dict:
        """The message as chat templates read it: its text, or with images its parts in order (an image part as
        {"type": "image"}, for which a vision-language model's template writes its placeholder); tool call arguments
        as objects (as vLLM passes them)."""
        content = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                   for p in self.content] if self.image_urls else self.text
        message = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's extra: variables for the chat template (e.g. Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value):
        reserved = sorted(set(value or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"the server sets {', '.join(reserved)} itself")
        return value

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        choice, names = self.tool_choice, [t.function.name for t in self.tools or []]
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct names")
        return self

    @property
    def tool_mode(self) -> str | NamedToolChoice:
        """none, auto, required or the named function: OpenAI's default is auto when tools are given."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    def engine_parameters(self, constraint: StructuredOutputsParams | None = None) -> dict:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_parameters(self.max_completion_tokens or self.max_tokens, logprobs, constraint)


class CompletionRequest(SamplingFields):
    # one prompt (text or token ids, which go to the engine as they are), or OpenAI's batch: a list of either
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(min_length=1)
    echo: bool = False
    # the completions API's default; 0 only with echo: the prompt scored, nothing generated (OpenAI's recipe)
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=5)

    @model_validator(mode="after")
    def _nothing_to_generate_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is allowed only with echo (the prompt's logprobs, nothing generated)")
        if self.max_tokens == 0 and self.min_tokens:
            raise ValueError("min_tokens: with max_tokens 0 nothing is generated")
        return self

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, value):
        if isinstance(value, str) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(isinstance(p, (str, list)) and not p for p in value):
            raise ValueError("prompt: no prompt of the batch may be empty")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or a batch's."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def engine_parameters(self, constraint: StructuredOutputsParams | None = None) -> dict:
        # max_tokens 0: the engine samples one token (its prefill's), which the answer leaves out
        values = self.sampling_parameters(1 if self.max_tokens == 0 else self.max_tokens, self.logprobs, constraint)
        if self.echo and self.logprobs is not None:
            values["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return values
