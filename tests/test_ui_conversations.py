"""The chat UI as a desktop chat app, in a real headless Chromium: conversations kept in the browser across reloads
and restarts of `npu-llm ui`, each with its settings; renamed, searched, switched and deleted; a user message
edited and resent, any reply generated anew; a conversation exported as Markdown and as the OpenAI request it
amounts to; the plots' rendered axes; and errors that say what to do."""
from __future__ import annotations

import json
import re

import pytest
from markdown_it import MarkdownIt
from openai import OpenAI

from tests.conftest import GATEWAY_API_KEY, free_port, start_gateway
from tests.ui_browser import (ask, bot_text, chat_rows, chromium_page, exported, open_ui, reply_done, running_ui,
                              set_field, watch_stats)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ui-conversations")


@pytest.fixture(scope="module")
def ui(triton_server, gateway, log_dir):
    with running_ui(gateway, triton_server.metrics_url, log_dir) as url:
        yield url


@pytest.fixture(scope="module")
def page():
    """One browser for the module: one storage, as one user's."""
    with chromium_page() as page:
        yield page


def listed(page) -> list[str]:
    return [text.strip() for text in page.locator("#conversations label").all_inner_texts()]


def wait_listed(page, titles: list[str]) -> None:
    page.wait_for_function("titles => JSON.stringify([...document.querySelectorAll('#conversations label')]"
                           ".map(l => l.innerText.trim())) === JSON.stringify(titles)", arg=titles, timeout=30000)


def wait_rows(page, rows: list[str]) -> None:
    page.wait_for_function("rows => JSON.stringify([...document.querySelectorAll('#chatbot .message-row')]"
                           ".map(r => r.innerText.trim())) === JSON.stringify(rows)", arg=rows, timeout=30000)


def wait_row_count(page, count: int) -> None:
    page.wait_for_function("n => document.querySelectorAll('#chatbot .message-row').length === n", arg=count,
                           timeout=30000)


def settings_shown(page) -> tuple[str, str, str, str]:
    return (page.locator("#system-prompt textarea").input_value(),
            page.locator("#temperature input[type=number]").input_value(),
            page.locator("#max-tokens input[type=number]").input_value(), page.locator("#seed input").input_value())


def new_conversation(page, question: str, system: str = "", temperature: str = "0.7", max_tokens: str = "12",
                     seed: str = "-1"):
    """A new chat with these settings, asked one question; returns its messages once the reply is kept."""
    page.locator("#new-chat").click()
    wait_rows(page, [])
    page.locator("#system-prompt textarea").fill(system)
    set_field(page, "#temperature input[type=number]", temperature)
    set_field(page, "#max-tokens input[type=number]", max_tokens)
    set_field(page, "#seed input", seed)
    ask(page, question)
    reply_done(page)
    page.wait_for_function("q => [...document.querySelectorAll('#conversations label')]"
                           ".some(l => l.innerText.trim() === q)", arg=question, timeout=30000)
    return chat_rows(page)


def switch_to(page, title: str, rows: list[str]) -> None:
    page.locator("#conversations label").filter(has_text=title).click()
    wait_rows(page, rows)


def test_conversations_and_their_settings_survive_a_reload_and_a_restart(triton_server, gateway, page, log_dir):
    port = free_port()  # (the same origin after the restart: the same browser storage)
    with running_ui(gateway, triton_server.metrics_url, log_dir, port=port) as url:
        open_ui(page, url)
        ships = new_conversation(page, "Tell me about ships.", "You are a pirate.", "0.3", "16", "7")
        eggs = new_conversation(page, "How do I boil an egg?", "You are a chef.", "0.5", "12", "11")
        assert listed(page) == ["How do I boil an egg?", "Tell me about ships."]  # newest first
        open_ui(page, url)  # (a reload)
        _both_are_back(page, ships, eggs)
        # leave the page before its server goes: its scripts, reconnecting to a server that went away, may navigate
        # while the next open_ui does, which aborts that navigation (net::ERR_ABORTED, once on a fresh clone's CI)
        page.goto("about:blank")
    with running_ui(gateway, triton_server.metrics_url, log_dir, port=port) as url:
        open_ui(page, url)
        _both_are_back(page, ships, eggs)


def _both_are_back(page, ships: list[str], eggs: list[str]) -> None:
    wait_listed(page, ["How do I boil an egg?", "Tell me about ships."])
    wait_rows(page, eggs)  # the one open before
    assert settings_shown(page) == ("You are a chef.", "0.5", "12", "11")
    switch_to(page, "Tell me about ships.", ships)
    assert settings_shown(page) == ("You are a pirate.", "0.3", "16", "7")
    switch_to(page, "How do I boil an egg?", eggs)
    assert settings_shown(page) == ("You are a chef.", "0.5", "12", "11")


def test_rename_search_switch_and_delete(ui, page):
    open_ui(page, ui)
    river = new_conversation(page, "Name a river.")
    new_conversation(page, "Name a mountain.")
    set_field(page, "#title textarea", "Peaks")  # renames the open one
    wait_listed(page, ["Peaks", "Name a river."])
    open_ui(page, ui)
    wait_listed(page, ["Peaks", "Name a river."])

    page.locator("#search textarea").fill("RIV")  # titles, any case
    wait_listed(page, ["Name a river."])
    page.locator("#search textarea").fill("")
    wait_listed(page, ["Peaks", "Name a river."])

    switch_to(page, "Name a river.", river)
    assert page.locator("#title textarea").input_value() == "Name a river."
    page.locator("#delete").click()
    wait_listed(page, ["Peaks"])
    wait_rows(page, [])
    open_ui(page, ui)
    wait_listed(page, ["Peaks"])


def test_edit_and_resend_drops_the_later_turns_and_any_reply_is_generated_anew(ui, page):
    open_ui(page, ui)
    new_conversation(page, "Name a city.", max_tokens="10")
    ask(page, "Name another one.")
    reply_done(page)
    wait_row_count(page, 4)

    watch_stats(page)
    page.locator("#chatbot button[aria-label='Edit']").first.click()
    page.locator("#chatbot textarea").fill("Name a fruit.")
    page.locator("#chatbot button[aria-label='Submit']").click()
    page.wait_for_function("window.seenStats.some(s => s.includes('streaming'))", timeout=60000)  # a new answer
    reply_done(page)
    wait_row_count(page, 2)
    assert chat_rows(page)[0] == "Name a fruit." and chat_rows(page)[1]
    page.wait_for_function("document.querySelector('#conversations label').innerText.trim() === 'Name a fruit.'",
                           timeout=30000)  # kept, and titled from its first message as it now is

    # a reply that is not the last: selected, then generated anew (the turns after it dropped)
    ask(page, "Name another one.")
    reply_done(page)
    wait_row_count(page, 4)
    page.locator("#chatbot [data-testid=bot]").first.click()
    page.wait_for_function("document.querySelector('#regenerate').innerText.includes('selected')", timeout=10000)
    watch_stats(page)
    page.locator("#regenerate").click()
    page.wait_for_function("window.seenStats.some(s => s.includes('streaming'))", timeout=60000)
    reply_done(page)
    wait_row_count(page, 2)
    assert chat_rows(page)[0] == "Name a fruit." and page.locator("#regenerate").inner_text() == "Regenerate"


def test_export_is_markdown_and_the_openai_request_of_the_conversation(ui, page, gateway):
    open_ui(page, ui)
    question, system = "Name a planet.", "You are brief."
    new_conversation(page, question, system, temperature="0", max_tokens="8")
    client = OpenAI(base_url=f"{gateway}/v1", api_key=GATEWAY_API_KEY)
    asked = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=asked, temperature=0,
                                            top_p=0.95, max_tokens=8).choices[0].message.content  # (greedy)

    request = json.loads(exported(page, "#export-json", ".json"))
    assert request["messages"] == asked + [{"role": "assistant", "content": answer}]
    assert (request["temperature"], request["top_p"], request["max_tokens"]) == (0, 0.95, 8)
    # a request the gateway takes as it is: the conversation's next reply
    assert client.chat.completions.create(**request).choices[0].message.content is not None

    markdown = exported(page, "#export-markdown", ".md")
    assert markdown == f"# {question}\n\n## System\n\n{system}\n\n## User\n\n{question}\n\n## Assistant\n\n{answer}\n"
    tokens = MarkdownIt().parse(markdown)
    headings = [(t.tag, tokens[i + 1].content) for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings[:4] == [("h1", question), ("h2", "System"), ("h2", "User"), ("h2", "Assistant")]


def _axes(page, plot: str) -> dict[str, tuple[str, list[tuple[str, float, float]]]]:
    """The rendered chart's axes: {"X"/"Y": (vega's description of the axis, [(tick label, x, y)])}."""
    return page.evaluate("""plot => Object.fromEntries([...document.querySelectorAll(plot + ' g.role-axis')]
        .filter(g => (g.getAttribute('aria-label') || '').match(/^[XY]-axis/))
        .map(g => [g.getAttribute('aria-label')[0], [g.getAttribute('aria-label'),
            [...g.querySelectorAll('.role-axis-label text')].map(t => {
                const box = t.getBoundingClientRect(); return [t.textContent, box.x, box.y]; })]]))""", plot)


def _number(label: str) -> float:
    """A tick label as a number: plain, or with an SI prefix (d3's "~s" format: 500m, 1.2k)."""
    value, prefix = re.fullmatch(r"(-?[0-9.]+)([mkM]?)", label).groups()
    return float(value) * {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6}[prefix]


def test_the_plots_read_right_as_rendered(ui, page):
    open_ui(page, ui)
    new_conversation(page, "Count from one to twenty.", max_tokens="48")  # (something to plot)
    # drawn with a rate above 0 (a refresh after the reply)
    page.wait_for_function("[...document.querySelectorAll('#throughput-plot g.role-axis')].some(g => "
                           "/^Y-axis.* from 0 to [1-9]/.test(g.getAttribute('aria-label') || ''))", timeout=30000)
    for plot, top in (("#throughput-plot", None), ("#kv-cache-plot", 100)):
        axes = _axes(page, plot)
        (x_axis, x_ticks), (y_axis, y_ticks) = axes["X"], axes["Y"]
        assert "time scale" in x_axis and "linear scale with values from 0" in y_axis, (x_axis, y_axis)
        assert top is None or y_axis.endswith(f"to {top}")
        assert [x for _, x, _ in x_ticks] == sorted(x for _, x, _ in x_ticks)  # time runs left to right
        assert len(y_ticks) >= 2 and all(len(label) <= 5 for label, _, _ in y_ticks), y_ticks  # short numbers,
        assert [y for _, _, y in sorted(y_ticks, key=lambda t: _number(t[0]))] == sorted(  # larger further up
            (y for _, _, y in y_ticks), reverse=True)


def _failed_reply(page, url: str) -> str:
    open_ui(page, url)
    ask(page, "Hello.")
    page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('failed')", timeout=60000)
    return bot_text(page)


def test_errors_say_what_to_do(triton_server, gateway, page, log_dir):
    metrics = triton_server.metrics_url
    with running_ui(gateway, metrics, log_dir, api_key="not-the-key") as url:
        text = _failed_reply(page, url)
        assert "refused the API key (401)" in text and "--api-key" in text, text
    nowhere = f"http://127.0.0.1:{free_port()}"
    with running_ui(nowhere, metrics, log_dir) as url:
        text = _failed_reply(page, url)
        assert f"Cannot reach the gateway at {nowhere}" in text and "npu-llm up" in text, text
    # a gateway whose Triton is gone (a stopped engine)
    port = free_port()
    orphan = start_gateway(f"127.0.0.1:{free_port()}", port, log_dir / "orphan-gateway.log")
    try:
        with running_ui(f"http://127.0.0.1:{port}", metrics, log_dir) as url:
            text = _failed_reply(page, url)
            assert "not serving (503)" in text and "Is Triton running?" in text, text
    finally:
        orphan.terminate()
        orphan.wait(15)
    assert "Traceback" not in text


def test_a_reply_streaming_when_the_chat_is_switched_stays_with_its_conversation(ui, page, triton_server):
    open_ui(page, ui)
    bird = new_conversation(page, "Name a bird.")
    question = "Tell me a long dragon story."
    new_conversation(page, question, max_tokens="8")
    set_field(page, "#max-tokens input[type=number]", "1500")
    ask(page, "Make it much longer, with many chapters.")
    page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('streaming')", timeout=60000)
    switch_to(page, "Name a bird.", bird)  # while it streams: it stops, on the server too
    assert triton_server.wait_metric("vllm:num_requests_running", lambda v: v == 0, timeout=15) == 0
    wait_rows(page, bird)  # (the story's last updates the page applies end with the chat as the switch left it)
    page.wait_for_timeout(2000)
    assert chat_rows(page) == bird  # (and nothing of the story comes after)

    page.locator("#conversations label").filter(has_text=question).click()
    page.wait_for_function("n => document.querySelectorAll('#chatbot .message-row').length === n", arg=4,
                           timeout=30000)
    story = chat_rows(page)
    assert story[2] == "Make it much longer, with many chapters." and story[3]  # what it had streamed, kept
    open_ui(page, ui)
    switch_to(page, question, story)


def test_a_question_sent_while_a_reply_streams_takes_the_chat(ui, page, triton_server):
    open_ui(page, ui)
    new_conversation(page, "Name a tree.", max_tokens="8")
    set_field(page, "#max-tokens input[type=number]", "1500")
    ask(page, "Tell me a very long story about a forest, with many chapters.")
    page.wait_for_function("document.querySelector('#reply-stats').innerText.includes('streaming')", timeout=60000)
    set_field(page, "#max-tokens input[type=number]", "8")
    ask(page, "Name a flower.")  # the story stops where it was, and the flower is answered
    reply_done(page)
    rows = chat_rows(page)
    assert len(rows) == 6 and rows[3] and rows[4] == "Name a flower." and rows[5], rows
    assert triton_server.wait_metric("vllm:num_requests_running", lambda v: v == 0, timeout=15) == 0
    open_ui(page, ui)
    wait_rows(page, rows)  # all of it kept
