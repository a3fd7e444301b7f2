"""Tool calling: tools into the prompt, grammars for `required` and named choices, tool calls out of the text.

- `auto`: the model decides, in its own format, which a parser reads back: Hermes-style
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2, SmolLM2, Hermes) or
  Llama 3.1/3.2's JSON (`{"name": ..., "parameters": {...}}`, several joined by `;`).
- `required` and a named function: the output is grammar-constrained (vLLM's approach), so it
  always parses: a JSON array of `{"name", "parameters"}` objects, or the named function's arguments.

A chat template that knows nothing of tools (SmolLM2's) gets them the Hermes way: a system message
listing them, earlier calls as `<tool_call>` blocks and results as `<tool_response>` blocks.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from backend.engine.sampling_params import StructuredOutputsParams
from backend.gateway.protocol import NamedToolChoice, Tool

TOOL_CALL_PARSERS = ("hermes", "llama3_json")

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
HERMES_SYSTEM = """# Tools

You may call one or more functions to help with the user's request. The functions you can call are
described within <tools></tools> XML tags:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object of its name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""
NO_ARGUMENTS = {"type": "object", "properties": {}}


def tool_call_parser(tokenizer, setting: str = "auto") -> str:
    """The model's tool-call format: the setting when it names one, else read off the chat template."""
    if setting != "auto":
        return setting
    template = getattr(tokenizer, "chat_template", None) or ""
    if PYTHON_TAG in template or ('"parameters"' in template and HERMES_START not in template):
        return "llama3_json"
    return "hermes"


def render_prompt(tokenizer, messages: list[dict], tools: list[Tool] | None,
                  template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> str:
    """The conversation through the model's chat template (tools= as transformers passes them to it), with the
    request's chat_template_kwargs as the template's variables."""
    template = getattr(tokenizer, "chat_template", None) or ""
    specs = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    if "tool" not in template:  # the template would drop tools, calls and results: write them the Hermes way
        messages = _hermes_messages(messages, specs)
        specs = None
    return tokenizer.apply_chat_template(messages, tools=specs, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **(template_kwargs or {}))


def _hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            blocks = [f"{HERMES_START}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                      f"\n{HERMES_END}" for c in message.pop("tool_calls")]
            message["content"] = "\n".join(filter(None, [message["content"], *blocks]))
        if message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        out.append(message)
    if tools:
        listing = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def constraint_for(mode: str | NamedToolChoice, tools: list[Tool], parallel: bool) -> StructuredOutputsParams | None:
    """The grammar a tool choice imposes: none for none and auto."""
    if isinstance(mode, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == mode.function.name)
        return StructuredOutputsParams(json=tool.function.parameters or NO_ARGUMENTS)
    if mode != "required":
        return None
    call = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                              "parameters": t.function.parameters or NO_ARGUMENTS},
             "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolDeltas:
    """One choice's text deltas as OpenAI chat deltas, for the request's tool mode.

    Content streams as it comes. Once a tool call begins (auto), or for the whole output (required),
    text is held back and read as tool calls at the end; text that turns out not to be a call is
    given back as content. A named function's arguments stream as they come.
    """

    mode: str | NamedToolChoice
    parser: str = "hermes"
    names: set[str] | None = None  # the tools' names: a "call" of anything else is not a call
    parallel: bool = True  # False: the first call only (parallel_tool_calls)
    made_calls: bool = False
    _held: str = ""
    _holding: bool = False
    _named_started: bool = False
    _calls: list = field(default_factory=list)

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        if isinstance(self.mode, NamedToolChoice):
            return [self._named(text)]
        if self.mode == "required" or self._holding:
            self._held += text
            return []
        if self.mode == "auto":
            return self._auto(text)
        return [{"content": text}]

    def finish(self) -> list[dict]:
        """The deltas left at the end of the output (tool calls, or held text as content)."""
        held, self._held = self._held, ""
        if not held:
            return []
        calls = parse_required(held) if self.mode == "required" else parse_tool_calls(held, self.parser, self.names)
        if calls is None:
            return [{"content": held}]
        self.made_calls = True
        calls = calls if self.parallel else calls[:1]
        return [{"tool_calls": [{"index": i, "id": call_id(), "type": "function",
                                 "function": {"name": name, "arguments": arguments}}]}
                for i, (name, arguments) in enumerate(calls)]

    def _named(self, text: str) -> dict:
        self.made_calls = True
        if self._named_started:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        self._named_started = True
        return {"tool_calls": [{"index": 0, "id": call_id(), "type": "function",
                                "function": {"name": self.mode.function.name, "arguments": text}}]}

    def _auto(self, text: str) -> list[dict]:
        text = self._held + text
        self._held = ""
        if self.parser == "llama3_json":  # a call is the whole output, or there is none
            head = text.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._holding, self._held = True, text
                return []
            if PYTHON_TAG.startswith(head):  # undecided yet
                self._held = text
                return []
            self.mode = "none"  # plain text from its first character on
            return [{"content": text}]
        start = text.find(HERMES_START)
        if start >= 0:
            self._holding, self._held, text = True, text[start:], text[:start]
        else:  # keep back a tail that may be the start of the marker
            keep = next((k for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1)
                         if HERMES_START.startswith(text[-k:])), 0)
            if keep:
                text, self._held = text[:-keep], text[-keep:]
        return [{"content": text}] if text else []


def parse_tool_calls(text: str, parser: str, names: set[str] | None = None) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in a model's own format; None when the text is not calls, or calls a
    function that is not among `names` (then it is JSON the model wrote, not a call)."""
    try:
        if parser == "llama3_json":
            objects = _json_objects(text.strip().removeprefix(PYTHON_TAG), separator=";")
            calls = [(o["name"], o["parameters"] if "parameters" in o else o["arguments"]) for o in objects]
        else:
            blocks = re.findall(rf"{re.escape(HERMES_START)}(.*?)(?:{re.escape(HERMES_END)}|$)", text, re.DOTALL)
            calls = [(o["name"], o["arguments"]) for o in map(json.loads, blocks)]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    if not calls or not all(isinstance(n, str) and isinstance(a, dict) for n, a in calls):
        return None
    if names is not None and any(n not in names for n, _ in calls):
        return None
    return [(name, json.dumps(arguments)) for name, arguments in calls]


def _json_objects(text: str, separator: str) -> list[dict]:
    """The JSON values of `text`, one after another, between separators (a separator inside a string is
    part of that string, which splitting the text would not know)."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while True:
        at = len(text) - len(text[at:].lstrip())
        value, at = decoder.raw_decode(text, at)
        objects.append(value)
        rest = text[at:].lstrip()
        if not rest:
            return objects
        if not rest.startswith(separator):
            raise json.JSONDecodeError(f"expected {separator!r} between calls", text, at)
        at = len(text) - len(rest) + len(separator)


def parse_required(text: str) -> list[tuple[str, str]] | None:
    """The calls of a `required` output (a JSON array of {"name", "parameters"}); None if cut short."""
    try:
        return [(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
