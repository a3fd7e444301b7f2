"""Tool-call parsing on hand-made model outputs: whole or split anywhere, the same deltas come out."""
import json

import pytest

from backend.gateway.protocol import NamedToolChoice
from backend.gateway.tools import ToolDeltas, parse_tool_calls

HERMES = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
LLAMA = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'


def _run(mode, parser, text, step):
    deltas = ToolDeltas(mode, parser, names={"f", "g"})
    parts = [p for i in range(0, len(text), step) for p in deltas.feed(text[i:i + step])] + deltas.finish()
    content = "".join(p.get("content", "") for p in parts)
    calls = [c for p in parts for c in p.get("tool_calls", [])]
    return content, calls, deltas.made_calls


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("parser, text, content", [("hermes", HERMES, "Sure. "), ("llama3_json", LLAMA, "")])
def test_calls_come_out_however_the_text_is_split(parser, text, content, step):
    got, calls, made = _run("auto", parser, text, step)
    assert made and got == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1}),
                                                                                                ("g", {})]
    assert [c["index"] for c in calls] == [0, 1] and all(c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize("text", ["a <tool_cal and more", "ends with <tool_c", "x < y", "<tool_call>{not json"])
def test_text_that_is_not_a_call_stays_content(text, step):
    got, calls, made = _run("auto", "hermes", text, step)
    assert (got, calls, made) == (text, [], False)


def test_named_arguments_stream_as_they_come():
    mode = NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}})
    deltas = ToolDeltas(mode)
    first, second = deltas.feed('{"x": '), deltas.feed("1}")
    assert first == [{"tool_calls": [{"index": 0, "id": first[0]["tool_calls"][0]["id"], "type": "function",
                                      "function": {"name": "f", "arguments": '{"x": '}}]}]
    assert second == [{"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]


def test_required_output_cut_short_is_returned_as_content():
    got, calls, made = _run("required", "hermes", '[{"name": "f", "parameters": {"x"', 5)
    assert (got, calls, made) == ('[{"name": "f", "parameters": {"x"', [], False)


def test_parsers_refuse_what_is_not_calls():
    assert parse_tool_calls('<tool_call>["a"]</tool_call>', "hermes") is None
    assert parse_tool_calls('{"name": "f", "parameters": 3}', "llama3_json") is None
    assert parse_tool_calls("hello", "llama3_json") is None


def test_llama3_calls_split_on_semicolons_outside_strings_only():
    text = '{"name": "run", "parameters": {"code": "x = 1; {y}"}} ; {"name": "g", "parameters": {}}'
    assert parse_tool_calls(text, "llama3_json") == [("run", '{"code": "x = 1; {y}"}'), ("g", "{}")]


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", '{"name": "Alice", "age": 30}'),  # JSON the model wrote: no parameters, and no such tool
    ("llama3_json", '{"name": "f", "parameters": {}}; and some words'),
    ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'),
])
def test_json_that_is_not_a_call_of_a_declared_tool_is_not_a_call(parser, text):
    assert parse_tool_calls(text, parser, names={"f", "g"}) is None
    got, calls, made = _run("auto", parser, text, 1)
    assert not calls and not made


def test_without_parallel_calls_only_the_first_is_kept():
    deltas = ToolDeltas("auto", "hermes", names={"f", "g"}, parallel=False)
    parts = deltas.feed(HERMES) + deltas.finish()
    assert [c["function"]["name"] for p in parts for c in p.get("tool_calls", [])] == ["f"]
