"""Gradio chat UI: an ordinary OpenAI client of the gateway, with conversations kept in the browser and a panel of
Triton's metrics.

Replies stream token by token; a thinking model's reasoning (the gateway's reasoning_content) streams into a
thought above the answer, which folds away once the answer begins. Stop cancels the Gradio event, which closes the
HTTP stream, so the gateway cancels the Triton request and the engine frees it.

Conversations (the sidebar) live in the browser's localStorage, through gr.BrowserState: each browser keeps its
own (a UI shared by several people holds none of them, and shows nobody another's), and they survive reloads and
restarts of `npu-llm ui`. Each keeps its messages, system prompt and sampling settings (ui/conversations.py).

The server panel and the plots refresh from Triton's /metrics every few seconds (ui/server_metrics.py).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
from openai import OpenAIError

from ui import conversations
from ui.chat_client import ChatClient, chat_request
from ui.conversations import SETTINGS
from ui.messages import before_reply, is_thought, settled, text_of
from ui.server_metrics import HISTORY_S, ServerMetrics

REFRESH_S = 3.0
STORE_KEY = "npu-llm-conversations"
# BrowserState encrypts what it stores with this key, which the page itself carries, so it hides nothing; a key
# drawn anew at each start (Gradio's default) would leave the stored conversations unreadable after a restart.
STORE_SECRET = "npu-llm-chat-conversations"
REGENERATE, REGENERATE_SELECTED = "Regenerate", "Regenerate selected"


@dataclass
class UISettings:
    gateway_url: str = "http://127.0.0.1:9000"
    metrics_url: str = "http://127.0.0.1:8002/metrics"
    api_key: str | None = None


def build_app(settings: UISettings) -> gr.Blocks:
    client = ChatClient(settings.gateway_url, settings.api_key)
    metrics = ServerMetrics(settings.metrics_url)
    exports = tempfile.TemporaryDirectory(prefix="npu-llm-exports-")  # (removed when the UI exits)

    async def respond(history, *values):
        asked = list(history)
        if not asked or asked[-1]["role"] != "user":
            yield gr.skip(), gr.skip()  # (nothing to answer)
            return
        reply = [{"role": "assistant", "content": ""}]
        try:
            async for reply, stats in client.stream_reply(asked, dict(zip(SETTINGS, values))):
                yield asked + reply, stats
        except (OpenAIError, OSError, ValueError) as e:
            thoughts = settled([m for m in reply if is_thought(m)])  # what it had thought stays
            failed = {"role": "assistant", "content": f"⚠️ {client.error_text(e)}"}
            yield asked + thoughts + [failed], "request failed"

    def add_user(message, history):
        """The message into the chat, and the stats line emptied for its reply."""
        if not message.strip():
            return "", history, gr.skip()
        return "", list(history) + [{"role": "user", "content": message}], ""

    def edited(history, edit: gr.EditData):
        """The conversation up to the edited user message, which now says what the user wrote."""
        return list(history[:edit.index]) + [{"role": "user", "content": text_of(edit.value)}]

    def settle_thoughts(history):
        now = settled(history)
        return now if now != history else gr.skip()  # (nothing was thinking: nothing to redraw)

    def select_message(select: gr.SelectData):
        chosen = select.index if select.selected else None
        return chosen, gr.update(value=REGENERATE if chosen is None else REGENERATE_SELECTED)

    def before_selected(history, selected):
        """Regenerate: the selected message's reply (the last one's, with none selected), later turns dropped."""
        index = selected if selected is not None and selected < len(history) else None
        return before_reply(history, index), None, gr.update(value=REGENERATE)

    # The store (the browser's) and what shows its current conversation ----------------------------------------
    def sidebar(store, query=""):
        """The conversation list: the titles that hold the query, newest first, the current one chosen."""
        choices = conversations.listing(store, query)
        chosen = store["current"] if any(cid == store["current"] for _, cid in choices) else None
        return gr.update(choices=choices, value=chosen)

    def shown(store) -> list:
        """[chatbot, title, stats, selected, regenerate, *settings] for the current conversation (a new chat:
        empty, with the settings left as they are)."""
        conversation = conversations.current(store)
        fresh = ["", None, gr.update(value=REGENERATE)]
        if conversation is None:
            return [[], ""] + fresh + [gr.skip()] * len(SETTINGS)
        kept = conversation["settings"]
        return ([conversation["messages"], conversations.title(conversation)] + fresh
                + [kept[name] if name in kept else gr.skip() for name in SETTINGS])

    def persist(store, history, query, *values):
        store = conversations.saved(store, history, dict(zip(SETTINGS, values)))
        current = conversations.current(store)
        return store, sidebar(store, query), conversations.title(current) if current else ""

    def restore(store, query):
        return [sidebar(store, query)] + shown(store)

    def switch(store, chosen, history, query, *values):
        store = conversations.switched(conversations.saved(store, history, dict(zip(SETTINGS, values))), chosen)
        return [store, sidebar(store, query)] + shown(store)

    def rename_current(store, title, query):
        store = conversations.renamed(store, title)
        return store, sidebar(store, query), conversations.title(conversations.current(store))

    def delete_current(store, query):
        store = conversations.deleted(store)
        return [store, sidebar(store, query)] + shown(store)

    def export(kind, store, history, *values):
        """A file of the conversation on the screen: Markdown, or JSON (the chat request it amounts to)."""
        chosen = dict(zip(SETTINGS, values))
        name = conversations.title(conversations.current(store) or {"messages": history})
        try:
            text = (conversations.as_markdown(name, history, chosen) if kind == "md" else
                    json.dumps(chat_request(client.model(), history, chosen), indent=2, ensure_ascii=False) + "\n")
        except (OpenAIError, OSError, ValueError) as e:
            raise gr.Error(client.error_text(e)) from None
        path = Path(tempfile.mkdtemp(dir=exports.name)) / f"{_file_name(name)}.{kind}"  # (Gradio serves a copy)
        path.write_text(text, encoding="utf-8")
        return gr.update(value=str(path), visible=True)

    with gr.Blocks(title="npu-llm chat") as app:
        store = gr.BrowserState(conversations.empty_store(), storage_key=STORE_KEY, secret=STORE_SECRET)
        selected = gr.State(None)  # the chat message chosen for Regenerate (None: the last reply)
        with gr.Sidebar(label="Conversations", elem_id="sidebar"):
            new_chat = gr.Button("New chat", variant="primary", elem_id="new-chat")
            search = gr.Textbox(placeholder="Search titles…", show_label=False, elem_id="search")
            listing = gr.Radio([], label="Conversations", elem_id="conversations")
            title = gr.Textbox(label="Title (Enter renames)", elem_id="title")
            with gr.Row():
                rename = gr.Button("Rename", size="sm", min_width=0, elem_id="rename")
                delete = gr.Button("Delete", size="sm", variant="stop", min_width=0, elem_id="delete")
            with gr.Row():
                export_md = gr.Button("Export Markdown", size="sm", min_width=0, elem_id="export-markdown")
                export_json = gr.Button("Export JSON", size="sm", min_width=0, elem_id="export-json")
            exported = gr.File(label="Export", interactive=False, visible=False, elem_id="export-file")

        gr.Markdown("## npu-llm chat")
        panel = gr.Markdown("**Server** connecting…", elem_id="server-panel")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Chat", elem_id="chatbot", height=420, editable="user",
                                     buttons=["copy", "copy_all"])
                stats = gr.Markdown("", elem_id="reply-stats")
                message = gr.Textbox(placeholder="Ask something…", show_label=False, elem_id="message")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id="send")
                    stop = gr.Button("Stop", elem_id="stop")
                    regenerate = gr.Button(REGENERATE, elem_id="regenerate")
                    clear = gr.Button("Clear", elem_id="clear")
                minutes = HISTORY_S // 60
                with gr.Row():
                    throughput_plot = gr.LinePlot(x="time", y="tokens/s", y_lim=[0, None], y_axis_format="~s",
                                                  title=f"Generation throughput (last {minutes} min)", height=200,
                                                  elem_id="throughput-plot")
                    kv_plot = gr.LinePlot(x="time", y="KV cache %", y_lim=[0, 100], height=200,
                                          title=f"KV-cache usage (last {minutes} min)", elem_id="kv-cache-plot")
            with gr.Column(scale=1):
                system = gr.Textbox(label="System prompt", value="", lines=3, elem_id="system-prompt")
                temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature", elem_id="temperature")
                top_p = gr.Slider(0.05, 1, value=0.95, step=0.05, label="Top p", elem_id="top-p")
                max_tokens = gr.Slider(1, 2048, value=512, step=1, label="Max tokens", elem_id="max-tokens")
                seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)", elem_id="seed")
                json_mode = gr.Checkbox(label="JSON mode", value=False, elem_id="json-mode")
                schema = gr.Textbox(label="JSON schema (optional)", lines=3, elem_id="json-schema",
                                    placeholder='{"type": "object", "properties": {...}}')
                tools = gr.Textbox(label="Tools (OpenAI tools list, optional)", lines=3, elem_id="tools",
                                   placeholder='[{"type": "function", "function": {"name": ..., "parameters": {...}}}]')
                tool_choice = gr.Radio(["auto", "required"], value="auto", label="Tool choice", elem_id="tool-choice")

        settings_inputs = [system, temperature, top_p, max_tokens, seed, json_mode, schema, tools, tool_choice]
        assert len(settings_inputs) == len(SETTINGS)
        persist_io = dict(fn=persist, inputs=[store, chatbot, search, *settings_inputs],
                          outputs=[store, listing, title], show_progress="hidden")
        shown_outputs = [chatbot, title, stats, selected, regenerate, *settings_inputs]
        events = []

        def answer(trigger):
            """The reply to the chat as `trigger` left it, streamed, then kept in the store."""
            replying = trigger.then(respond, [chatbot, *settings_inputs], [chatbot, stats])
            replying.then(**persist_io)
            events.append(replying)

        answer(message.submit(add_user, [message, chatbot], [message, chatbot, stats], queue=False))
        answer(send.click(add_user, [message, chatbot], [message, chatbot, stats], queue=False))
        answer(regenerate.click(before_selected, [chatbot, selected], [chatbot, selected, regenerate], queue=False))
        answer(chatbot.retry(before_reply, chatbot, chatbot, queue=False))
        answer(chatbot.edit(edited, chatbot, chatbot, queue=False))
        chatbot.select(select_message, None, [selected, regenerate], queue=False)
        # Label the reply once the cancellation went through (queued behind it, not racing it).
        stop.click(None, cancels=events, queue=False).then(
            lambda s: f"{s.replace(' · streaming…', '')} · stopped", stats, stats).then(
            settle_thoughts, chatbot, chatbot, show_progress="hidden").then(  # (no loading overlay on the reply)
            **persist_io)
        clear.click(lambda: ([], ""), None, [chatbot, stats], cancels=events).then(**persist_io)
        chatbot.clear(lambda: "", None, stats, cancels=events).then(**persist_io)  # (its own bin icon)
        # A setting belongs to the conversation it is changed in; text boxes are kept when left, not per key.
        gr.on([c.blur if isinstance(c, gr.Textbox) else c.change for c in settings_inputs], **persist_io)

        new_chat.click(lambda s, h, q, *v: switch(s, None, h, q, *v), [store, chatbot, search, *settings_inputs],
                       [store, listing, *shown_outputs], cancels=events)
        listing.input(switch, [store, listing, chatbot, search, *settings_inputs],
                      [store, listing, *shown_outputs], cancels=events)
        gr.on([rename.click, title.submit], rename_current, [store, title, search], [store, listing, title])
        delete.click(delete_current, [store, search], [store, listing, *shown_outputs], cancels=events)
        search.change(sidebar, [store, search], listing, queue=False)
        export_md.click(lambda *a: export("md", *a), [store, chatbot, *settings_inputs], exported)
        export_json.click(lambda *a: export("json", *a), [store, chatbot, *settings_inputs], exported)

        timer = gr.Timer(REFRESH_S)
        timer.tick(metrics.refresh, None, [panel, throughput_plot, kv_plot])
        app.load(metrics.refresh, None, [panel, throughput_plot, kv_plot])
        app.load(restore, [store, search], [listing, *shown_outputs])
    return app


def _file_name(title: str) -> str:
    return re.sub(r"[^\w\- ]+", "", title).strip().replace(" ", "-")[:60] or "conversation"


def run_ui(args) -> int:
    """`npu-llm ui` (flags in backend/cli.py)."""
    api_key = args.api_key or os.environ.get("NPU_LLM_API_KEY") or None  # the gateway's, read from the same variable
    app = build_app(UISettings(args.gateway_url, args.metrics_url, api_key))
    app.queue().launch(server_name=args.host, server_port=args.port, show_error=False, quiet=True)
    return 0
