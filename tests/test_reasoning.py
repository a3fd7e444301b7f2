"""Reasoning output (--reasoning-parser): `<think>…</think>` split into reasoning_content/reasoning and content.

The parsers on hand-made outputs, split at every chunk boundary; the choice `auto` makes and chat_template_kwargs on
the real default tokenizer with thinking models' templates; then the real stack (openai SDK -> gateway ->
tritonserver) and the chat UI in Chromium. The default model does not think on its own: a regex makes it write a
think block, so what is tested is the split."""
from __future__ import annotations

import copy
import json
import re

import openai
import pytest
from pydantic import ValidationError

from backend.engine.tokenizer import chat_prompt_ids, load_template_tokenizer, load_tokenizer
from backend.gateway.protocol import ChatCompletionRequest
from backend.gateway.reasoning import reasoning_parser, reasoning_split
from backend.gateway.serving_chat import ChoiceDeltas
from backend.gateway.tools import ToolDeltas, render_prompt
from backend.models.registry import DEFAULT_MODEL, resolve_model
from tests.conftest import GATEWAY_API_KEY, free_port, start_gateway

MODEL = DEFAULT_MODEL

# The generation prompts of thinking models' chat templates, as they write them (the rest of each template is
# SmolLM2's turn format, which the default tokenizer can render).
TURNS = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
QWEN3 = TURNS + ("{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
                 "{% endif %}{% endif %}")
QWEN3_5 = TURNS + ("{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
                   "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")
DEEPSEEK_R1 = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
               "{% else %}{% set content = m['content'] %}{% if '</think>' in content %}"
               "{% set content = content.split('</think>')[-1] %}{% endif %}{{ '<｜Assistant｜>' + content }}"
               "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")


def _split(parser: str, text: str, step: int, prompt: str = "", constrained: bool = False) -> tuple[str, str, list]:
    split = reasoning_split(parser, prompt, constrained)
    parts = [p for i in range(0, len(text), step) for p in split.feed(text[i:i + step])] + split.finish()
    assert all(p["reasoning"] == p["reasoning_content"] for p in parts if "reasoning" in p)  # both names, same text
    return "".join(p.get("reasoning", "") for p in parts), "".join(p.get("content", "") for p in parts), parts


STEPS = [1, 2, 3, 5, 1000]  # 1: every tag split at each of its characters, e.g. "<thi" then "nk>"


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("parser, prompt, text, reasoning, content", [
    ("qwen3", "", "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n", "\n\nHello!"),
    ("qwen3", "", "  \n<think>x</think>y", "x", "y"),  # whitespace before the block
    ("qwen3", "", "<think>cut short in thought", "cut short in thought", ""),  # no end tag: all reasoning
    ("qwen3", "", "<think>ends in a tag </thi", "ends in a tag </thi", ""),
    ("qwen3", "", "Hello, no thinking.", "", "Hello, no thinking."),
    ("qwen3", "", "A </think> or <think> in the answer stays.", "", "A </think> or <think> in the answer stays."),
    ("qwen3", "", "<thi", "", "<thi"),  # a tag that never completed
    ("qwen3", "<|im_start|>assistant\n<think>\n", "opened by the prompt</think>answer", "opened by the prompt",
     "answer"),
    ("deepseek_r1", "", "No start tag.</think>The answer.", "No start tag.", "The answer."),
    ("deepseek_r1", "", "<think>\nA start tag.\n</think>\n\nThe answer.", "\nA start tag.\n", "\n\nThe answer."),
    ("deepseek_r1", "", "Cut short, no end tag", "Cut short, no end tag", ""),
    ("deepseek_r1", "", "</think>only an answer", "", "only an answer"),
    ("deepseek_r1", "", "first</think>then <think>text</think>", "first", "then <think>text</think>"),
])
def test_the_split_is_the_same_however_the_text_is_chunked(parser, prompt, text, reasoning, content, step):
    got_reasoning, got_content, parts = _split(parser, text, step, prompt)
    assert (got_reasoning, got_content) == (reasoning, content)
    kinds = ["reasoning" if "reasoning" in p else "content" for p in parts]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all the reasoning comes before the answer


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_constrained_output_is_the_answer_unless_the_grammar_writes_a_think_block(parser):
    """The grammar applies from the first token: JSON it forces is content, even for deepseek_r1."""
    assert _split(parser, '{"a": 1}', 2, constrained=True)[:2] == ("", '{"a": 1}')
    assert _split(parser, "<think>abc</think>def", 2, constrained=True)[:2] == ("abc", "def")


def test_tool_calls_are_read_after_the_reasoning_only():
    """A call the model only thought about is reasoning; the one after </think> is the call."""
    text = ('<think>Maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>? Yes.</think>\n'
            '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    for step in STEPS:
        deltas = ChoiceDeltas(ToolDeltas("auto", "hermes", {"f"}), reasoning_split("qwen3", "", constrained=False))
        parts = [p for i in range(0, len(text), step) for p in deltas.feed(text[i:i + step])] + deltas.finish()
        assert "".join(p.get("reasoning", "") for p in parts) == 'Maybe <tool_call>{"name": "f", "arguments": {}}' \
                                                                  '</tool_call>? Yes.'
        assert "".join(p.get("content", "") for p in parts) == "\n"
        [call] = [c for p in parts for c in p.get("tool_calls", [])]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("f", {"x": 1})
        assert deltas.tools.made_calls


@pytest.fixture(scope="module")
def tokenizer():
    return load_template_tokenizer(DEFAULT_MODEL)


def _with_template(tokenizer, template: str, name: str | None = None):
    """The default tokenizer with another model's chat template (and, if given, its name)."""
    other = copy.copy(tokenizer)  # (its own attributes; the vocabulary shared)
    other.chat_template = template
    if name is not None:
        other.name_or_path = name
    return other


def test_auto_reads_the_parser_off_the_tokenizer(tokenizer):
    assert reasoning_parser(tokenizer) is None  # SmolLM2 does not think: no parser, all content
    assert reasoning_parser(_with_template(tokenizer, QWEN3)) == "qwen3"
    assert reasoning_parser(_with_template(tokenizer, QWEN3_5)) == "qwen3"
    assert reasoning_parser(_with_template(tokenizer, DEEPSEEK_R1)) == "deepseek_r1"
    # a DeepSeek-R1 distill with a template that says nothing of thinking: its name tells
    assert reasoning_parser(_with_template(tokenizer, TURNS, "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")) == \
        "deepseek_r1"
    assert reasoning_parser(_with_template(tokenizer, QWEN3), "none") is None
    assert reasoning_parser(tokenizer, "deepseek_r1") == "deepseek_r1"
    assert reasoning_parser(tokenizer) is None  # (the copies left the default tokenizer as it was)


def test_chat_template_kwargs_reach_the_template_and_its_prompt_decides_the_split(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    qwen3_5 = _with_template(tokenizer, QWEN3_5)
    thinking = render_prompt(qwen3_5, messages, None)
    assert thinking.endswith("<think>\n")  # the template opened the block: the output starts inside it
    assert _split("qwen3", "hmm</think>Hello", 3, thinking)[:2] == ("hmm", "Hello")
    off = render_prompt(qwen3_5, messages, None, {"enable_thinking": False})
    assert off.endswith("<think>\n\n</think>\n\n")  # Qwen3's switch: the block is closed before the model starts
    assert _split("qwen3", "Hello", 3, off)[:2] == ("", "Hello")
    assert render_prompt(_with_template(tokenizer, QWEN3), messages, None, {"enable_thinking": True}) == \
        render_prompt(_with_template(tokenizer, QWEN3), messages, None)


def test_chat_template_kwargs_cannot_set_what_the_server_sets():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    assert ChatCompletionRequest.model_validate({**body, "chat_template_kwargs": {"enable_thinking": False}})
    with pytest.raises(ValidationError, match="the server sets add_generation_prompt, tokenize itself"):
        ChatCompletionRequest.model_validate({**body, "chat_template_kwargs": {"tokenize": True,
                                                                              "add_generation_prompt": False}})


# The real stack. --------------------------------------------------------------------------------------------------

ASK = [{"role": "user", "content": "Say hello."}]
THINK_THEN_ANSWER = r"<think>[a-z ]{3,20}</think>[a-z ]{1,20}"


def _gateway(triton_server, tmp_path_factory, parser: str):
    port = free_port()
    process = start_gateway(triton_server.grpc_url, port, tmp_path_factory.mktemp(f"gateway-{parser}") / "gateway.log",
                            extra_args=("--reasoning-parser", parser))
    return process, f"http://127.0.0.1:{port}"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=GATEWAY_API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def qwen3_gateway(triton_server, tmp_path_factory):
    process, url = _gateway(triton_server, tmp_path_factory, "qwen3")
    yield url
    process.terminate()
    process.wait(15)


@pytest.fixture(scope="module")
def deepseek_gateway(triton_server, tmp_path_factory):
    process, url = _gateway(triton_server, tmp_path_factory, "deepseek_r1")
    yield url
    process.terminate()
    process.wait(15)


def _reply(client, stream: bool, **kwargs) -> dict:
    """reasoning_content, reasoning, content, finish reason and tool calls: of a whole reply, or put together from its
    stream's deltas (each delta checked: reasoning deltas carry both names, and all of them come before content)."""
    if not stream:
        choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
        message = choice.message
        return {"reasoning_content": message.reasoning_content, "reasoning": message.reasoning,
                "content": message.content, "finish_reason": choice.finish_reason, "tool_calls": message.tool_calls}
    got = {"reasoning_content": "", "reasoning": "", "content": "", "finish_reason": None, "tool_calls": []}
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        thought = getattr(delta, "reasoning_content", None)
        assert thought == getattr(delta, "reasoning", None)
        if thought:
            assert not got["content"] and not delta.content, "reasoning after the answer began"
        got["reasoning_content"] += thought or ""
        got["reasoning"] += thought or ""
        got["content"] += delta.content or ""
        got["tool_calls"] += delta.tool_calls or []
        got["finish_reason"] = chunk.choices[0].finish_reason or got["finish_reason"]
    return got


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_is_split_from_the_answer(qwen3_gateway, gateway, stream):
    """The same greedy output with and without the parser: split at the tags, nothing lost, no tag in content."""
    kwargs = dict(messages=ASK, temperature=0, max_tokens=40, extra_body={"guided_regex": THINK_THEN_ANSWER})
    plain = _reply(_client(gateway), stream, **kwargs)  # the session's gateway: auto finds no parser for SmolLM2
    assert not plain["reasoning_content"] and re.fullmatch(THINK_THEN_ANSWER, plain["content"])
    thought, answer = re.fullmatch(r"<think>(.*)</think>(.*)", plain["content"]).groups()
    got = _reply(_client(qwen3_gateway), stream, **kwargs)
    assert got["reasoning_content"] == got["reasoning"] == thought
    assert got["content"] == answer and got["finish_reason"] == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_responses_api_gives_the_reasoning_its_own_output_item(qwen3_gateway, gateway, stream):
    kwargs = dict(model=MODEL, input=ASK, temperature=0, max_output_tokens=40,
                  extra_body={"structured_outputs": {"regex": THINK_THEN_ANSWER}})
    plain = _client(gateway).responses.create(**kwargs)  # no parser: one message, the tags in its text
    assert [item.type for item in plain.output] == ["message"]
    thought, answer = re.fullmatch(r"<think>(.*)</think>(.*)", plain.output_text).groups()
    client = _client(qwen3_gateway)
    if stream:
        with client.responses.stream(**kwargs) as events:
            seen = list(events)
            got = events.get_final_response()
        assert "".join(e.delta for e in seen if e.type == "response.reasoning_text.delta") == thought
        assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == answer
    else:
        got = client.responses.create(**kwargs)
    reasoning, message = got.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thought
    assert message.type == "message" and got.output_text == answer
    assert 0 < got.usage.output_tokens_details.reasoning_tokens < got.usage.output_tokens


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_after_the_reasoning_is_a_call(qwen3_gateway, stream):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,10}"\}\}\n</tool_call>'
    got = _reply(_client(qwen3_gateway), stream, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                 tools=tools, temperature=0, max_tokens=60,
                 extra_body={"guided_regex": r"<think>[a-z ]{3,20}</think>" + call})
    assert re.fullmatch(r"[a-z ]{3,20}", got["reasoning_content"]) and got["finish_reason"] == "tool_calls"
    assert got["content"] in (None, "")
    [made] = got["tool_calls"]
    assert made.function.name == "get_weather" and set(json.loads(made.function.arguments)) == {"city"}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_deepseek_r1_thinks_from_the_first_token(deepseek_gateway, gateway, stream):
    """Without a start tag, and cut short before any </think>: the whole output is reasoning."""
    kwargs = dict(messages=[{"role": "user", "content": "Write a long story about the sea."}], temperature=0,
                  max_tokens=12)
    plain = _reply(_client(gateway), stream, **kwargs)["content"]
    got = _reply(_client(deepseek_gateway), stream, **kwargs)
    assert "</think>" not in plain and got["reasoning_content"] == got["reasoning"] == plain
    assert got["content"] in (None, "") and got["finish_reason"] == "length"
    # a constraint makes the output the answer (the grammar applies from its first token)
    forced = _reply(_client(deepseek_gateway), stream, **kwargs, extra_body={"guided_choice": ["yes", "no"]})
    assert forced["content"] in ("yes", "no") and not forced["reasoning_content"]


@pytest.mark.slow
def test_chat_template_kwargs_are_taken_and_what_the_server_sets_is_a_400(qwen3_gateway):
    client = _client(qwen3_gateway)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.usage.prompt_tokens == len(chat_prompt_ids(load_tokenizer(resolve_model(MODEL)), ASK))
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs: the server sets tokenize itself"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})


# The chat UI. -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def page(triton_server, deepseek_gateway, tmp_path_factory):
    """The chat UI, a client of the deepseek_r1 gateway, in headless Chromium."""
    from tests.ui_browser import chromium_page, open_ui, running_ui

    with running_ui(deepseek_gateway, triton_server.metrics_url, tmp_path_factory.mktemp("ui-reasoning")) as url:
        with chromium_page() as page:
            open_ui(page, url)
            yield page


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.slow
def test_the_ui_streams_the_reasoning_into_a_thought_that_folds_away(page, deepseek_gateway):
    from tests.ui_browser import ask, exported, reply_done, set_field

    set_field(page, "#temperature input[type=number]", "0")
    set_field(page, "#max-tokens input[type=number]", "24")
    page.evaluate("""() => { window.titles = []; new MutationObserver(() => {
        for (const t of document.querySelectorAll('#chatbot .thought-group .title')) window.titles.push(t.innerText);
    }).observe(document.querySelector('#chatbot'), {childList: true, subtree: true, characterData: true}); }""")
    ask(page, "Say hello.")
    reply_done(page)
    assert any("Thinking" in t for t in page.evaluate("window.titles"))  # streamed as a pending thought
    thought = page.locator("#chatbot .thought-group").last
    assert "Thought" in thought.locator(".title").inner_text()
    thought.locator(".content").wait_for(state="detached", timeout=10000)  # folded away once done (it slides shut)
    thought.locator(".title").click()  # opened, it holds what the model thought (all of it: deepseek_r1, cut short)
    expected = _client(deepseek_gateway).chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, top_p=0.95, max_tokens=24).choices[0].message.reasoning_content
    assert _words(thought.locator(".content").inner_text()) == _words(expected)

    # the next turn sends the conversation without the thought: the prompt Triton counted says so
    before = page.locator("#reply-stats").inner_text()
    ask(page, "And goodbye.")
    # this reply's own complete stats (while Gradio queues it, the line still ends with the first reply's)
    page.wait_for_function("before => (s => s !== before && s.startsWith('TTFT') && !s.includes('streaming'))"
                           "(document.querySelector('#reply-stats').innerText)", arg=before, timeout=120000)
    prompt = chat_prompt_ids(load_tokenizer(resolve_model(MODEL)),
                             ASK + [{"role": "user", "content": "And goodbye."}])
    assert f"prompt {len(prompt)} tokens" in page.locator("#reply-stats").inner_text()

    # an export leaves the thoughts out too
    messages = json.loads(exported(page, "#export-json", ".json"))["messages"]
    assert [m for m in messages if m["role"] == "user"] == ASK + [{"role": "user", "content": "And goodbye."}]
    assert not any(_words(expected) in _words(m["content"]) for m in messages)
