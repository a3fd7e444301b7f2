"""OpenAI's Responses API and vLLM's utility endpoints through the real stack: the official openai SDK (its
`responses.create`, `responses.stream`, `responses.parse` and `responses.retrieve`) -> gateway -> tritonserver.
Answers are checked against the engine itself (greedy), the tools' and formats' own schemas, and the tokenizer."""
from __future__ import annotations

import json
import re
from importlib.metadata import version

import httpx
import jsonschema
import openai
import pydantic
import pytest

from backend import SamplingParams
from backend.engine.tokenizer import chat_prompt_ids
from backend.models.registry import DEFAULT_MODEL
from tests.conftest import GATEWAY_API_KEY

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL
INSTRUCTIONS, QUESTION = "You are terse.", "Name two planets."
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,10}", "unit": "celsius"\}\}\n</tool_call>'
AUTH = {"Authorization": f"Bearer {GATEWAY_API_KEY}"}


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=GATEWAY_API_KEY, max_retries=0, timeout=180)


def _expected(reference_llm, messages, max_tokens: int):
    [out] = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens))
    return out.outputs[0]


def test_a_response_is_the_engines_answer_whole_and_streamed(client, reference_llm):
    expected = _expected(reference_llm, MESSAGES, 24)
    kwargs = dict(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, temperature=0, max_output_tokens=24)
    whole = client.responses.create(**kwargs)
    assert whole.output_text == expected.text
    assert whole.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant" and message.status == whole.status
    assert whole.usage.input_tokens == len(chat_prompt_ids(reference_llm.get_tokenizer(), MESSAGES))
    assert whole.usage.output_tokens == len(expected.token_ids)
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.instructions == INSTRUCTIONS and whole.max_output_tokens == 24 and whole.temperature == 0

    with client.responses.stream(**{**kwargs, "max_output_tokens": 200}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    longer = _expected(reference_llm, MESSAGES, 200)
    assert longer.finish_reason == "stop"  # (so that the stream ends in response.completed)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == longer.text
    assert final.output_text == longer.text and final.status == "completed"
    assert final.usage.output_tokens == len(longer.token_ids)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


class Planet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    moons: int = pydantic.Field(ge=0, le=200)


def test_text_format_json_schema_and_json_object(client):
    parsed = client.responses.parse(model=MODEL, input="Describe a planet as JSON.", temperature=0,
                                    max_output_tokens=60, text_format=Planet)
    assert isinstance(parsed.output_parsed, Planet)  # the SDK sent json_schema (strict) and read it back
    assert parsed.text.format.type == "json_schema"
    schema = Planet.model_json_schema()
    with client.responses.stream(model=MODEL, input="Describe a planet as JSON.", temperature=0,
                                 max_output_tokens=60, text={"format": {"type": "json_schema", "name": "planet",
                                                                        "schema": schema}}) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), schema)
    anything = client.responses.create(model=MODEL, input="Give me a JSON object with just the name and age of a cat.",
                                       temperature=0, max_output_tokens=200, text={"format": {"type": "json_object"}})
    assert anything.status == "completed" and isinstance(json.loads(anything.output_text), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_calls_and_their_outputs(client, stream):
    """A named tool_choice is a function_call item whose arguments match the tool's schema; sent back with its
    output, the model answers in text. auto reads the model's own call format (a regex makes SmolLM2 write one)."""
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]

    def respond(**kwargs):
        if not stream:
            return client.responses.create(model=MODEL, temperature=0, **kwargs), []
        with client.responses.stream(model=MODEL, temperature=0, **kwargs) as events:
            seen = list(events)
            return events.get_final_response(), seen

    forced, events = respond(input=ask, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                             max_output_tokens=80)
    [call] = forced.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    if stream:
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert deltas == done.arguments == call.arguments

    answered, _ = respond(input=ask + [call.model_dump(exclude_none=True),
                                       {"type": "function_call_output", "call_id": call.call_id,
                                        "output": json.dumps({"temperature": 21, "unit": "celsius"})}],
                          tools=[WEATHER], max_output_tokens=30)
    assert answered.output[0].type == "message" and answered.output_text

    auto, _ = respond(input=ask, tools=[WEATHER], max_output_tokens=60,
                      extra_body={"structured_outputs": {"regex": r"Let me check\. " + HERMES_CALL}})
    assert [item.type for item in auto.output] == ["message", "function_call"]
    assert auto.output_text == "Let me check. "
    assert json.loads(auto.output[1].arguments)["unit"] == "celsius"


def test_previous_response_id_continues_the_conversation(client, reference_llm):
    first = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=12)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow_up = "And one more?"
    second = client.responses.create(model=MODEL, input=follow_up, previous_response_id=first.id, temperature=0,
                                     max_output_tokens=12)
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": follow_up}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == len(chat_prompt_ids(reference_llm.get_tokenizer(), conversation))
    assert second.output_text == _expected(reference_llm, conversation, 12).text

    # a turn that wrote text and called a tool, continued from its id or sent back as items: the same prompt
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    called = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], temperature=0, max_output_tokens=60,
                                     extra_body={"structured_outputs": {"regex": r"Let me check\. " + HERMES_CALL}})
    result = {"type": "function_call_output", "call_id": called.output[1].call_id, "output": "21 degrees"}
    by_id = client.responses.create(model=MODEL, input=[result], previous_response_id=called.id, tools=[WEATHER],
                                    temperature=0, max_output_tokens=12)
    by_items = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=12,
                                       input=ask + [i.model_dump(exclude_none=True) for i in called.output] + [result])
    assert by_id.usage.input_tokens == by_items.usage.input_tokens and by_id.output_text == by_items.output_text

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)

    unkept = client.responses.create(model=MODEL, input=QUESTION, store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="x", previous_response_id=unkept.id, max_output_tokens=2)
    assert refused.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param, message", [
    ({"input": "hi", "modalities": ["text"]}, "modalities", "unknown field"),
    ({"input": "hi", "background": True}, None, "background"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, None, "reasoning"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, None, "include"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"input": "hi", "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"input": ""}, "input", "empty"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "input_image"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", "required"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type", "function"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, None, "nope"),
    ({"input": "hi", "tool_choice": "required"}, None, "tool_choice needs tools"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, None,
     "not several"),
])
def test_what_the_responses_api_cannot_honour_is_a_400_naming_it(gateway, body, param, message):
    response = httpx.post(f"{gateway}/v1/responses", json={"model": MODEL, **body}, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


@pytest.mark.parametrize("metadata, message", [
    ({f"k{i}": "v" for i in range(17)}, "at most 16 items"),
    ({"k" * 65: "v"}, "at most 64 characters"),
    ({"k": "v" * 513}, "at most 512 characters"),
])
def test_metadata_beyond_openais_limits_is_a_400_naming_it(gateway, metadata, message):
    """A response keeps its metadata: bounded as OpenAI bounds it, so that stored responses cannot fill memory."""
    response = httpx.post(f"{gateway}/v1/responses", json={"model": MODEL, "input": "hi", "metadata": metadata},
                          headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"].startswith("metadata"), error
    at_limit = {f"k{i:02d}" + "k" * 61: "v" * 512 for i in range(16)}
    kept = httpx.post(f"{gateway}/v1/responses", json={"model": MODEL, "input": "hi", "metadata": at_limit,
                                                       "max_output_tokens": 1}, headers=AUTH, timeout=60)
    assert kept.status_code == 200 and kept.json()["metadata"] == at_limit


def test_what_asks_for_nothing_is_accepted(gateway):
    """Fields sent at their defaults (as SDKs and agent frameworks send them) ask for nothing the server refuses."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "background": False, "top_logprobs": 0,
            "reasoning": {"effort": None, "summary": None}, "include": ["reasoning.encrypted_content"],
            "parallel_tool_calls": None, "store": None, "stream": None, "truncation": "disabled", "user": "u1"}
    response = httpx.post(f"{gateway}/v1/responses", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["store"] is True and response.json()["parallel_tool_calls"] is True


def test_a_streamed_request_the_engine_refuses_is_a_400_not_a_broken_stream(gateway):
    """The engine's verdict (here, a prompt over max_model_len) comes before the 200, streamed or not."""
    response = httpx.post(f"{gateway}/v1/responses", headers=AUTH, timeout=60,
                          json={"model": MODEL, "input": "word " * 9000, "stream": True})
    assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"]


def test_tokenize_detokenize_and_version(gateway, client, reference_llm):
    tokenizer = reference_llm.get_tokenizer()
    prompt = "The four seasons are"
    tokens = httpx.post(f"{gateway}/tokenize", json={"model": MODEL, "prompt": prompt}, headers=AUTH).json()
    assert tokens["tokens"] == tokenizer.encode(prompt) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == reference_llm.engine.config.max_model_len
    assert tokens["token_strs"] is None
    strs = httpx.post(f"{gateway}/tokenize", json={"prompt": prompt, "return_token_strs": True, "add_special_tokens":
                                                  False}, headers=AUTH).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode(prompt, add_special_tokens=False))

    chat = httpx.post(f"{gateway}/tokenize", json={"model": MODEL, "messages": MESSAGES}, headers=AUTH).json()
    assert chat["tokens"] == chat_prompt_ids(tokenizer, MESSAGES)
    served = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert chat["count"] == served.usage.prompt_tokens  # what a chat completion of it counts

    back = httpx.post(f"{gateway}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}, headers=AUTH)
    assert back.json() == {"prompt": tokenizer.decode(tokens["tokens"])}
    assert httpx.get(f"{gateway}/version", headers=AUTH).json() == {"version": version("npu-llm")}

    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(f"{gateway}{path}", json=body).status_code == 401  # behind the API key
    assert httpx.get(f"{gateway}/version").status_code == 401
    both = httpx.post(f"{gateway}/tokenize", json={"prompt": "x", "messages": MESSAGES}, headers=AUTH)
    assert both.status_code == 400 and "one of them" in both.json()["error"]["message"]
    unused = httpx.post(f"{gateway}/tokenize", json={"prompt": "x", "add_generation_prompt": False}, headers=AUTH)
    assert unused.status_code == 400 and "only with messages" in unused.json()["error"]["message"]
    outside = httpx.post(f"{gateway}/detokenize", json={"tokens": [1, len(tokenizer)]}, headers=AUTH)
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens.1"
    other = httpx.post(f"{gateway}/tokenize", json={"model": "gpt-9", "prompt": "x"}, headers=AUTH)
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"


def test_the_responses_endpoint_is_counted(gateway, client):
    client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    text = httpx.get(f"{gateway}/metrics", headers=AUTH).text
    assert re.search(r'npu_llm_gateway_requests_total\{endpoint="responses",status="200"\} [1-9]', text)
    assert re.search(r'npu_llm_gateway_time_to_first_token_seconds_count\{endpoint="responses"\} [1-9]', text)
