"""OpenAI's Responses API request (pydantic), read as the chat request it amounts to: the input items become chat
messages (function calls and their outputs included), `instructions` the system message, the flat function tools
chat's tools, `text.format` the response format. One path serves both (backend/gateway/serving_chat.py)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator, model_validator

from backend.engine.sampling_params import INT64_MAX, INT64_MIN, StructuredOutputsParams
from backend.gateway.protocol import (
    FunctionDefinition,
    JsonSchemaFormat,
    Metadata,
    NamedFunction,
    NamedToolChoice,
    OpenAIModel,
    ResponseFormat,
    Tool,
    without_refused,
)

# Fields of the Responses API this server does not honour: refused by name (400), never silently dropped. A field
# sent with its default (null, false, 0, empty) asks for nothing, and is accepted.
UNSUPPORTED = {
    "background": "background responses are not supported",
    "conversation": "conversations are not supported; send previous_response_id or the whole input",
    "prompt": "prompt templates are not supported",
    "include": "include is not supported (but for reasoning.encrypted_content: reasoning items come as text)",
    "top_logprobs": "top_logprobs is not supported on the Responses API; use chat completions' logprobs",
    "max_tool_calls": "max_tool_calls is not supported",
    "reasoning": "reasoning settings are not supported; a thinking model's own switch is its chat template's "
                 "(Qwen3's enable_thinking, through chat completions' chat_template_kwargs)",
    "prompt_cache_retention": "prompt_cache_retention is not supported",
}
# Asks for encrypted reasoning, to send back with store false: reasoning items sent back are not shown to the model
# again anyway, so there is nothing to encrypt.
HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content"})
# What changes nothing about the output: accepted and dropped.
IGNORED = frozenset({"user", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options"})


def _asks_for_something(name: str, value) -> bool:
    if name == "include" and isinstance(value, list) and set(value) <= HARMLESS_INCLUDES:
        return False
    if isinstance(value, dict):
        return any(_asks_for_something(name, v) for v in value.values())
    return bool(value)


class ContentText(OpenAIModel):
    """A text part of a message: the user's input_text, or an earlier answer's output_text sent back."""

    type: Literal["input_text", "output_text"]
    text: str


class Refusal(OpenAIModel):
    """An earlier answer's refusal part, sent back: it is not text the model wrote to continue from."""

    type: Literal["refusal"]


def _joined(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content if isinstance(p, ContentText))


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentText | Refusal]


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentText]


class ReasoningItem(OpenAIModel):
    """An earlier turn's reasoning, sent back: not shown to the model again (chat templates drop it too)."""

    type: Literal["reasoning"]


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(item) -> str | None:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


# (the tags name no field: "-" keeps them out of an error's parameter, backend/gateway/request_body.py)
InputItem = Annotated[
    Annotated[MessageItem, Tag("item-message")] | Annotated[FunctionCallItem, Tag("item-function_call")]
    | Annotated[FunctionCallOutputItem, Tag("item-function_call_output")]
    | Annotated[ReasoningItem, Tag("item-reasoning")],
    Discriminator(lambda item: f"item-{_item_type(item)}"),
]
INPUT_ITEMS = TypeAdapter(list[InputItem])


def as_messages(items: list) -> list[dict]:
    """Input items (or a response's output items, which have the same shapes) as chat messages: a turn's text and
    the calls it made are one assistant message, as the model wrote them."""
    messages = []
    for item in INPUT_ITEMS.validate_python(items):  # (items already validated are taken as they are)
        if isinstance(item, MessageItem):
            if item.role == "assistant" and messages and messages[-1]["role"] == "assistant":
                messages[-1]["content"] = (messages[-1]["content"] or "") + _joined(item.content)
            else:
                messages.append({"role": item.role, "content": _joined(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)})
    return messages


class FunctionTool(OpenAIModel):
    """The Responses API's function tool: chat's function definition, flat."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict))


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    """`text.format`: the Responses API's response_format, with the schema's fields beside its type."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self):
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("a json_schema format needs its name and schema")
        return self

    def as_response_format(self) -> ResponseFormat:
        schema = None
        if self.type == "json_schema":
            schema = JsonSchemaFormat(name=self.name, description=self.description, schema=self.schema_,
                                      strict=self.strict)
        return ResponseFormat(type=self.type, json_schema=schema)


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # (the one verbosity the model has)


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses. A field this server does not know is refused (400, "unknown field"), as are those it
    cannot honour (UNSUPPORTED)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str
    input: list[InputItem] = Field(min_length=1)  # (a string is one user message)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None  # (none: true)
    stream: bool | None = None
    store: bool | None = None  # kept for previous_response_id (backend/gateway/response_store.py); none: true
    previous_response_id: str | None = None
    metadata: Metadata | None = None  # kept with the response: bounded as OpenAI bounds it
    truncation: Literal["disabled"] | None = None  # ("auto" would drop input the client sent)
    # vLLM's extras (the openai SDK sends them through extra_body), as on chat completions
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    structured_outputs: StructuredOutputsParams | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if not isinstance(data, dict):
            return data
        return without_refused(data, UNSUPPORTED, IGNORED, _asks_for_something)

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value):
        if isinstance(value, str):
            if not value:
                raise ValueError("input must not be empty")
            return [{"type": "message", "role": "user", "content": value}]
        for i, item in enumerate(value if isinstance(value, list) else []):
            if _item_type(item) not in ITEM_TYPES:
                raise ValueError(f"item {i} is of type {_item_type(item)!r}; this server takes "
                                 f"{', '.join(ITEM_TYPES)} items")
        return value

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [t.name for t in self.tools or []]
        if isinstance(self.tool_choice, FunctionChoice) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not among the tools")
        return self

    def input_messages(self) -> list[dict]:
        """This request's input as chat messages, without the instructions: what a later response continues from,
        with its own output."""
        return as_messages(self.input)

    def as_chat(self, history: list[dict]) -> dict:
        """The chat request this response is (to validate as one): `history`, an earlier response's messages, before
        this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        return {
            "model": self.model, "messages": system + history + self.input_messages(),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "tools": [t.as_chat_tool() for t in self.tools] if self.tools else None, "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls is not False, "seed": self.seed,
            "top_k": self.top_k, "structured_outputs": self.structured_outputs,
            "response_format": self.text.format.as_response_format() if self.text and self.text.format else None,
        }
