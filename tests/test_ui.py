"""The chat UI (`npu-llm ui`) on the session's Triton and gateway, driven in a real headless Chromium."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.ui_browser import (ARTIFACTS, ask, bot_text, chromium_page, open_ui, reply_done, running_ui,
                              set_field, watch_stats)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ui(triton_server, gateway, tmp_path_factory):
    """The UI: a client of the session's gateway, showing its Triton's metrics."""
    with running_ui(gateway, triton_server.metrics_url, tmp_path_factory.mktemp("ui")) as url:
        yield url


@pytest.fixture(scope="module")
def page(ui):
    with chromium_page() as page:
        open_ui(page, ui)
        yield page


def test_reply_streams_with_stats_and_panel(page, triton_server):
    ask(page, "Write three sentences about the sea.")
    page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('TTFT')", timeout=60000)
    # (the stats line and the chatbot are two outputs of one update; the chatbot's markdown may render after)
    page.wait_for_function("""(() => { const bots = document.querySelectorAll('#chatbot .message.bot');
                                      return bots.length && bots[bots.length - 1].innerText.trim().length > 0; })()""",
                           timeout=30000)
    first = len(bot_text(page))
    # the reply grows while the stats line still says it is streaming
    page.wait_for_function(
        f"""(() => {{ const bots = document.querySelectorAll('#chatbot .message.bot');
                     return bots.length && bots[bots.length - 1].innerText.length > {first}
                        && document.querySelector('#reply-stats').innerText.includes('streaming'); }})()""",
        timeout=60000)
    page.wait_for_function("!document.querySelector('#reply-stats').innerText.includes('streaming')", timeout=120000)
    stats = page.locator("#reply-stats").inner_text()
    assert "TTFT" in stats and "tokens/s" in stats, stats
    page.wait_for_function("document.querySelector('#server-panel').innerText.includes('smollm2-135m-instruct')",
                           timeout=15000)
    assert "Layout 1 engine x TP 1 on cpu" in page.locator("#server-panel").inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "ui-chat.png"))


def test_stop_ends_the_reply_and_the_server_request(page, triton_server):
    set_field(page, "#max-tokens input[type=number]", "1500")
    ask(page, "Tell me a very long story about a dragon and a knight, with many chapters.")
    page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('streaming')", timeout=60000)
    # the gauges refresh twice a second
    assert triton_server.wait_metric("vllm:num_requests_running", lambda v: v >= 1, timeout=15) >= 1
    page.locator("#stop").click()
    page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('stopped')", timeout=10000)
    assert "streaming" not in page.locator("#reply-stats").inner_text()
    stopped_at = bot_text(page)
    # cancelled on the server
    assert triton_server.wait_metric("vllm:num_requests_running", lambda v: v == 0, timeout=15) == 0
    assert triton_server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v == 0, timeout=15) == 0
    assert 0 < len(stopped_at) and bot_text(page) == stopped_at  # the reply stopped growing where Stop cut it


def test_gateway_error_shows_as_a_message(page):
    set_field(page, "#max-tokens input[type=number]", "512")
    ask(page, "word " * 9000)  # longer than max_model_len: the gateway answers 400
    page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('failed')", timeout=60000)
    text = bot_text(page)
    assert "max_model_len" in text and "Traceback" not in text


PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 30}},
       "required": ["name", "age"]}
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]


def _clear(page) -> None:
    page.locator("#clear").click()
    page.wait_for_function("document.querySelector('#reply-stats').innerText.trim() === ''", timeout=15000)


def _reset(page, temperature: str = "0.7") -> None:
    """The chat cleared and the settings at their defaults (whatever an earlier test left), at this temperature."""
    _clear(page)
    page.locator("#json-mode input[type=checkbox]").uncheck()
    for box in ("#json-schema textarea", "#tools textarea", "#system-prompt textarea"):
        page.locator(box).fill("")
    page.locator("#tool-choice").get_by_text("auto").click()
    set_field(page, "#seed input", "-1")
    set_field(page, "#max-tokens input[type=number]", "512")
    set_field(page, "#temperature input[type=number]", temperature)


def test_json_mode_and_tool_calls_show_readably(page):
    _reset(page, temperature="0")  # greedy: a sampled 135M model may list calls until max_tokens
    page.locator("#json-mode input[type=checkbox]").check()
    page.locator("#json-schema textarea").fill(json.dumps(PET))
    ask(page, "Describe my pet.")
    jsonschema.validate(json.loads(reply_done(page)), PET)

    page.locator("#json-mode input[type=checkbox]").uncheck()
    page.locator("#json-schema textarea").fill("")
    page.locator("#tools textarea").fill(json.dumps(WEATHER_TOOL))
    page.locator("#tool-choice").get_by_text("required").click()
    _clear(page)
    ask(page, "What is the weather in Oslo?")
    reply_done(page)
    page.wait_for_function("(bots => bots.length && bots[bots.length - 1].innerText.includes('get_weather'))"
                           "(document.querySelectorAll('#chatbot .message.bot'))", timeout=15000)  # rendered
    assert "🔧" in bot_text(page)
    arguments = json.loads(page.locator("#chatbot .message.bot").last.locator("code").last.inner_text())
    jsonschema.validate(arguments, WEATHER_TOOL[0]["function"]["parameters"])


def test_seed_regenerate_clear_and_the_system_prompt(page):
    from backend.engine.tokenizer import chat_prompt_ids, load_tokenizer
    from backend.models.registry import DEFAULT_MODEL, resolve_model

    _reset(page)
    set_field(page, "#seed input", "42")
    set_field(page, "#max-tokens input[type=number]", "24")
    system, question = "You are a pirate. Answer in one sentence.", "Tell me about the sea."
    page.locator("#system-prompt textarea").fill(system)
    ask(page, question)
    first = reply_done(page)
    # the system prompt reached the model: the prompt Triton counted is the conversation with it
    prompt = chat_prompt_ids(load_tokenizer(resolve_model(DEFAULT_MODEL)),
                             [{"role": "system", "content": system}, {"role": "user", "content": question}])
    assert f"prompt {len(prompt)} tokens" in page.locator("#reply-stats").inner_text()

    # the same seed: the same reply, generated again (the stats streamed anew) in place of the first
    watch_stats(page)
    page.locator("#regenerate").click()
    page.wait_for_function("window.seenStats.some(s => s.includes('streaming'))", timeout=60000)
    reply_done(page)
    page.wait_for_function("(([bots, first]) => bots.length === 1 && bots[0].innerText === first)"
                           "([document.querySelectorAll('#chatbot .message.bot'), %s])" % json.dumps(first),
                           timeout=30000)

    _clear(page)
    assert page.locator("#chatbot .message").count() == 0


def test_a_reply_cannot_make_the_browser_fetch_a_remote_image(page):
    """A reply is markdown the model wrote; an image in it whose URL carries the conversation would leak it when the
    browser loads it. The UI's policy admits images from itself only: a remote one is blocked, never requested."""
    import http.server
    import threading

    requested = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requested.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/leak.png?q=secret"
        blocked = page.evaluate("""url => new Promise(done => {
            document.addEventListener('securitypolicyviolation', e => done(e.violatedDirective), {once: true});
            const img = document.createElement('img');
            img.src = url;
            document.querySelector('#chatbot').appendChild(img);
            setTimeout(() => done(null), 3000);
        })""", url)
        assert blocked == "img-src" and requested == []
    finally:
        server.shutdown()
