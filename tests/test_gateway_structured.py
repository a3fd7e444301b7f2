"""Structured outputs and tool calls through the real stack: the openai SDK -> gateway -> tritonserver -> engine,
and a Triton client with no gateway in between. Outputs are checked against their spec (jsonschema, re, the
choice list, the tools' own schemas), never against fixed strings."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from backend.engine.tokenizer import load_tokenizer
from backend.gateway.protocol import ChatMessage, Tool
from backend.gateway.tools import render_prompt
from backend.models.registry import DEFAULT_MODEL, resolve_model
from tests.conftest import GATEWAY_API_KEY
from tests.test_triton import _grpc_generate, _http_post

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 30}}, "required": ["age"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"price": {"type": "number"}}, "required": ["price"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 10}, "maxItems": 4}},
     "required": ["scores"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {"first": NAME, "last": NAME},
                                                 "required": ["first", "last"]}}, "required": ["person"]},
    {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city"]},  # one optional
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900,
                                                              "maximum": 2030}}, "required": ["title", "year"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 1}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"level": {"type": "string", "enum": ["low", "mid", "high"]},
                                      "note": NAME}, "required": ["level"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
     "required": ["a", "b", "c"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}},
     "required": ["answer"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["nickname"]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {
        "version": {"type": "integer", "minimum": 0, "maximum": 99}, "stable": {"type": "boolean"}},
        "required": ["version", "stable"]}, "name": NAME}, "required": ["meta", "name"]},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=GATEWAY_API_KEY, max_retries=0, timeout=180)


def _ask_json(client, schema):
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=160,
        messages=[{"role": "user", "content": "Reply with an example JSON value for this schema: "
                                              + json.dumps(schema)}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    return reply.choices[0]


def test_json_schema_output_validates_for_twenty_schemas(client):
    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(lambda s: _ask_json(client, s), SCHEMAS))
    for schema, choice in zip(SCHEMAS, choices):
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_mode_streams_a_json_object(client):
    chunks = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=200, stream=True, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object with just the name and age of a cat."}])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_choice_and_regex_are_always_matched(client):
    choices = ["positive", "negative", "neutral"]
    for text in ("I love it!", "This is awful.", "It is a chair."):
        reply = client.chat.completions.create(
            model=MODEL, temperature=1.0, seed=1, n=3, max_tokens=8, extra_body={"guided_choice": choices},
            messages=[{"role": "user", "content": f"Sentiment of: {text}"}])
        assert all(c.message.content in choices for c in reply.choices)
    pattern = r"\d{3}-\d{3}-\d{4}"
    reply = client.completions.create(model=MODEL, prompt="Call me at", temperature=1.0, seed=2, n=4, max_tokens=20,
                                      extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.text) for c in reply.choices)


def _call_arguments(call, tool) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_tool_choice_always_call(client, stream):
    for tool_choice, expected in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, TIME)):
        reply = _chat(client, stream, messages=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                      max_tokens=100)
        # the model chose to call (required): "tool_calls"; a function forced on it: "stop", as OpenAI's
        assert reply["finish_reason"] == ("stop" if expected else "tool_calls") and reply["content"] in (None, "")
        assert reply["tool_calls"]
        for call in reply["tool_calls"]:
            tool = expected or next(t for t in TOOLS if t["function"]["name"] == call.function.name)
            assert call.function.name == tool["function"]["name"]
            _call_arguments(call, tool)


HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,10}", "unit": "celsius"\}\}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_the_models_own_tool_call_format(client, stream):
    """auto: whatever the model writes in its format (Hermes for SmolLM2) comes back as tool_calls. A regex makes
    this small model write a call, so the parser is what is tested; plain text stays content."""
    reply = _chat(client, stream, messages=ASK_WEATHER, tools=TOOLS, tool_choice="auto", temperature=0,
                  max_tokens=60, extra_body={"guided_regex": r"Let me check\. " + HERMES_CALL})
    assert reply["finish_reason"] == "tool_calls"
    assert reply["content"] == "Let me check. "
    [call] = reply["tool_calls"]
    assert call.function.name == "get_weather" and _call_arguments(call, WEATHER)["unit"] == "celsius"

    text = _chat(client, stream, messages=ASK_WEATHER, tools=TOOLS, temperature=0, max_tokens=20,
                 extra_body={"guided_regex": "I cannot say <tool [a-z]{1,5}"})
    assert text["finish_reason"] == "stop" and not text["tool_calls"]
    assert text["content"].startswith("I cannot say <tool ")


def test_logprobs_of_tokens_a_grammar_forbids_are_clamped_not_infinite(client):
    """-inf (a forbidden token) is not JSON: it is sent as vLLM sends it, -9999.0."""
    for stream in (False, True):
        reply = _chat(client, stream, messages=ASK_WEATHER, temperature=0, max_tokens=4, logprobs=True,
                      top_logprobs=3, extra_body={"guided_choice": ["yes", "no"]})
        assert reply["content"] in ("yes", "no")
        values = [t.logprob for item in reply["logprobs"].content for t in [item, *item.top_logprobs]]
        assert values and all(-9999.0 <= v <= 0 for v in values)
        assert -9999.0 in values  # the alternatives beyond the choice are forbidden


def test_a_conversation_sends_the_tool_result_back(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    history = ASK_WEATHER + [first.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=30)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.content
    # the prompt the server built holds the call and its result
    tokenizer = load_tokenizer(resolve_model(MODEL))
    messages = [ChatMessage.model_validate(m).for_template() for m in history]
    prompt = render_prompt(tokenizer, messages, [Tool.model_validate(t) for t in TOOLS])
    assert '{"temperature": 21}' in prompt and call.function.name in prompt
    assert second.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     'structured_outputs.json: Unsupported type "nonsense"'),
    ({"extra": {"guided_regex": "(unclosed"}}, "structured_outputs.regex: Regex parsing error"),
    ({"extra": {"logit_bias": {"42": 5}}}, "logit_bias is not supported"),
    ({"extra": {"reasoning_effort": "high"}}, "reasoning_effort is not supported"),
    ({"extra": {"modalities": ["text", "audio"]}}, 'only ["text"] is supported'),
    ({"extra": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs: the server sets tokenize itself"),
    ({"extra": {"guided_regex": "a", "guided_choice": ["a"]}}, "give one of guided_regex, guided_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(client, body, message):
    extra = body.pop("extra", None)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=8, extra_body=extra, **body)
    assert message in error.value.message
    ok = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=4)  # the server is fine
    assert ok.choices[0].message.content is not None


def test_a_triton_client_gets_constrained_output_without_the_gateway(triton_server):
    schema = SCHEMAS[0]
    for key, spec in (("structured_outputs", json.dumps({"json": schema})),  # vllm_backend passes JSON text
                      ("guided_decoding", {"json": schema, "backend": "xgrammar"})):
        result = _grpc_generate(triton_server, "A person as JSON:", {"temperature": 0, "max_tokens": 80, key: spec},
                                stream=True)
        assert not result.errors
        jsonschema.validate(json.loads("".join(result.texts)), schema)
    body = {"text_input": "A person as JSON:", "parameters": {"temperature": 0, "max_tokens": 80,
                                                              "structured_outputs": json.dumps({"json": schema})}}
    text = json.loads(_http_post(triton_server, "/v2/models/llm/generate", body))["text_output"]
    jsonschema.validate(json.loads(text.removeprefix(body["text_input"])), schema)  # HTTP generate, as in docs/serving.md
    bad = _grpc_generate(triton_server, "x", {"structured_outputs": json.dumps({"regex": "(ab"})})
    assert bad.errors and "structured_outputs.regex" in bad.errors[0]


def _chat(client, stream: bool, **kwargs) -> dict:
    """One choice's content, tool calls and finish reason, from a whole reply or from its stream's deltas."""
    if not stream:
        choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
    else:
        with client.chat.completions.stream(model=MODEL, **kwargs) as events:  # the SDK's own delta accumulation
            choice = events.get_final_completion().choices[0]
    return {"content": choice.message.content, "tool_calls": choice.message.tool_calls,
            "finish_reason": choice.finish_reason, "logprobs": choice.logprobs}



def test_none_and_one_call_at_a_time_are_honoured(client):
    """tool_choice none: no call, and the tools are left out of the prompt (as vLLM does); parallel_tool_calls
    false with required: exactly one call, though the model is asked for two."""
    none = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=12)
    plain = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=12)
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason in ("stop", "length")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    both = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]
    reply = client.chat.completions.create(model=MODEL, messages=both, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=100)
    [call] = reply.choices[0].message.tool_calls
    _call_arguments(call, next(t for t in TOOLS if t["function"]["name"] == call.function.name))


def test_vllm_guided_json_and_grammar_extras(client):
    schema = SCHEMAS[2]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a colour."}],
                                           temperature=0, max_tokens=30, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    grammar = 'root ::= "The answer is " [0-9] [0-9]? "."'
    reply = client.completions.create(model=MODEL, prompt="Six times seven:", temperature=1.0, seed=4, n=3,
                                      max_tokens=12, extra_body={"guided_grammar": grammar})
    assert all(re.fullmatch(r"The answer is [0-9][0-9]?\.", c.text) for c in reply.choices)


def test_completions_refuse_tools_and_both_endpoints_accept_openai_metadata(client):
    with pytest.raises(openai.BadRequestError, match="tools: unknown field"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"tools": TOOLS})
    metadata = {"user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
                "logit_bias": None, "functions": []}  # (unsupported fields that ask for nothing pass too)
    chat = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2, extra_body=metadata)
    text = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={**metadata, "best_of": 1})
    assert chat.usage.completion_tokens >= 1 and text.usage.completion_tokens >= 1
