"""Gradio chat UI: an ordinary OpenAI client of the gateway, with conversations kept in the browser and a panel of
Triton's metrics.

A message may carry pictures (attached with the clip, dropped or pasted), sent to a vision-language model as
image_url parts (ui/images.py says how they are kept). Replies stream token by token; a thinking model's reasoning (the gateway's reasoning_content) streams into a
thought above the answer, which folds away once the answer begins. Stop cancels the Gradio event, which closes the
HTTP stream, so the gateway cancels the Triton request and the engine frees it.

Conversations (the sidebar) live in the browser's localStorage, through gr.BrowserState: each browser keeps its
own (a UI shared by several people holds none of them, and shows nobody another's), and they survive reloads and
restarts of `npu-llm ui`. Each keeps its messages, system prompt and sampling settings (ui/conversations.py).

The server panel and the plots refresh from Triton's /metrics every few seconds (ui/server_metrics.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr
from openai import OpenAIError

from ui import conversations, images
from ui.chat_client import ChatClient, chat_request
from ui.content_policy import MIDDLEWARE
from ui.conversations import SETTINGS
from ui.exposure import checked_login
from ui.messages import before_reply, is_thought, note, settled, text_of
from ui.server_metrics import HISTORY_S, REFRESH_S, ServerMetrics

STORE_KEY = "npu-llm-conversations"
# BrowserState encrypts what it stores with this key, which the page itself carries, so it hides nothing; a key
# drawn anew at each start (Gradio's default) would leave the stored conversations unreadable after a restart.
STORE_SECRET = "npu-llm-chat-conversations"
REGENERATE, REGENERATE_SELECTED = "Regenerate", "Regenerate selected"
# A streaming reply redraws the chat at most this often: the page renders the whole message anew at each update,
# and a slow browser given one per token falls ever further behind (its clicks wait behind the backlog).
REDRAW_S = 0.1
SKIP = gr.skip()  # (an output left as it is)
EMPTY_MESSAGE = {"text": "", "files": []}


@dataclass
class UISettings:
    gateway_url: str = "http://127.0.0.1:9000"
    # Triton's /metrics of the servers that answer (several are summed: decode servers of a disaggregated deployment)
    metrics_urls: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8002/metrics"])
    api_key: str | None = None
    prefill_metrics_urls: list[str] = field(default_factory=list)  # disaggregated: the prefill servers' /metrics


class Session:
    """One page's side of the UI, in a gr.State (Gradio hands every event of a browser session the same object).

    `store` holds the page's conversations while it is open: loaded once from the browser's storage (at the page's
    load, or at the first event of a session the server does not know, after a restart of the UI), then changed by
    the handlers (async, so one at a time on the event loop) and mirrored back to the browser. Every change to the
    chat goes through a handler that keeps it, so the store, not the page's copy as it stood when an event fired,
    is the chat. `reply` counts who took the chat last: a reply streams only while no later event took it (another
    reply, a switch, a new chat, a delete, Clear, Stop); `streamed` is its latest messages, not yet kept, and
    `stats` the stats line as the chat's holder last drew it. `selected` is the message chosen for Regenerate.
    """

    def __init__(self):
        self.store = conversations.empty_store()
        self.restored = False
        self.reply = 0
        self.streamed: tuple[int, list[dict]] | None = None
        self.stats = ""
        self.selected: int | None = None

    def restore(self, stored) -> None:
        if not self.restored:
            self.store, self.restored = images.shown_again(conversations.loaded(stored)), True

    def take_chat(self) -> int:
        """The chat taken from whoever had it (its stats line emptied): a reply streaming now stops at its next
        token."""
        self.reply += 1
        self.selected, self.stats = None, ""
        return self.reply

    def chat(self) -> list[dict]:
        """The chat as it stands: the streaming reply's latest messages while one streams, else the kept ones."""
        if self.streamed is not None and self.streamed[0] == self.reply:
            return self.streamed[1]
        conversation = conversations.current(self.store)
        return conversation["messages"] if conversation else []


def _settings(values) -> dict:
    return dict(zip(SETTINGS, values))


def build_app(settings: UISettings) -> gr.Blocks:
    client = ChatClient(settings.gateway_url, settings.api_key)
    metrics = ServerMetrics(settings.metrics_urls, settings.prefill_metrics_urls)
    # (small files, left to the system's temporary-file cleaning: Gradio serves copies from its own cache)
    exports = Path(tempfile.mkdtemp(prefix="npu-llm-exports-"))

    async def stream(session, asked, query, values, shown_first: list):
        """The chat's next reply: yields [message box, chatbot, stats, Regenerate, *kept]. First the chat up to the
        question (kept at once, the stats emptied for the reply; `shown_first` are the message box's and
        Regenerate's values), then the reply as it streams, then the reply kept. Once another event took the chat
        it stops, and leaves the screen and the store to that event."""
        turn = session.take_chat()
        yield [shown_first[0], asked, "", shown_first[1], *saved(session, asked, query, values)]
        if not asked or asked[-1]["role"] != "user":
            return  # (nothing to answer)
        reply, stats, drawn = [], "", 0.0
        try:
            async with contextlib.aclosing(client.stream_reply(asked, _settings(values))) as replies:
                async for reply, stats in replies:
                    if session.reply != turn:
                        break  # (closing the stream cancels the request on the server)
                    session.streamed, session.stats = (turn, asked + reply), stats
                    if time.monotonic() - drawn >= REDRAW_S:
                        drawn = time.monotonic()
                        yield [SKIP, asked + reply, stats, SKIP, SKIP, SKIP, SKIP]
        except Exception as e:  # (a note in the chat, never a traceback; a cancel is no Exception)
            reply = settled([m for m in reply if is_thought(m)]) + [note(client.error_text(e))]  # its thoughts stay
            stats = "request failed"
        finally:
            if session.streamed is not None and session.streamed[0] == turn:
                session.streamed = None
        if session.reply != turn:
            # The page applies each event's updates in their order, but not in order across events: this reply's
            # last updates may land after what the event that took the chat drew. So it ends by drawing the chat as
            # it is now, with the taker's stats line.
            yield [SKIP, session.chat(), session.stats, SKIP, SKIP, SKIP, SKIP]
            return
        session.stats = stats
        yield [SKIP, asked + reply, stats, SKIP, *saved(session, asked + reply, query, values)]

    async def models(chosen):
        """The model picker's choices; the base model chosen unless the conversation chose one."""
        try:
            names = await client.models()
        except Exception:  # (the gateway is not there yet: the first reply says so, with what to do)
            return gr.skip()
        return gr.Dropdown(choices=names, value=chosen or names[0])

    # What shows the store's current conversation -----------------------------------------------------------------
    def sidebar(store, query=""):
        """The conversation list: the titles that hold the query, newest first, the current one chosen."""
        choices = conversations.listing(store, query)
        chosen = store["current"] if any(cid == store["current"] for _, cid in choices) else None
        return gr.update(choices=choices, value=chosen)

    def on_screen(store) -> list:
        """[chatbot, title, stats, regenerate, *settings] for the current conversation (a new chat: empty, with the
        settings left as they are)."""
        conversation = conversations.current(store)
        if conversation is None:
            return [[], "", "", REGENERATE] + [gr.skip()] * len(SETTINGS)
        kept = conversation["settings"]
        return ([conversation["messages"], conversations.title(conversation), "", REGENERATE]
                + [kept[name] if name in kept else gr.skip() for name in SETTINGS])

    def saved(session, history, query, values) -> list:
        """[browser store, list, title] once the current conversation is kept as the chat and the settings are."""
        before = conversations.title(conversations.current(session.store))
        session.store = conversations.saved(session.store, settled(history), _settings(values))
        after = conversations.title(conversations.current(session.store))
        # (the title box only when the title changed: the user may be typing a new one)
        return [session.store, sidebar(session.store, query), after if after != before else gr.skip()]

    async def persist(session, stored, query, *values):
        session.restore(stored)
        return saved(session, session.chat(), query, values)

    async def restore(session, stored, query):
        session.restore(stored)
        # (the session as an output: Gradio then expires it with the page)
        return [session, sidebar(session.store, query)] + on_screen(session.store)

    async def switch(session, stored, chosen, query, *values):
        session.restore(stored)
        saved(session, session.chat(), query, values)  # (the one left: a reply cut short stays with it)
        session.take_chat()
        session.store = conversations.switched(session.store, chosen)
        return [session.store, sidebar(session.store, query)] + on_screen(session.store)

    async def start_new(session, stored, query, *values):
        return await switch(session, stored, None, query, *values)

    async def rename_current(session, stored, title, query):
        session.restore(stored)
        if conversations.current(session.store) is None:
            gr.Info("A new chat is kept, and can be renamed, from its first message.")
            return gr.skip(), gr.skip(), ""
        session.store = conversations.renamed(session.store, title)
        return session.store, sidebar(session.store, query), conversations.title(conversations.current(session.store))

    async def delete_current(session, stored, query):
        session.restore(stored)
        session.take_chat()
        session.store = conversations.deleted(session.store)
        return [session.store, sidebar(session.store, query)] + on_screen(session.store)

    # The chat ----------------------------------------------------------------------------------------------------
    async def send_message(session, stored, message, query, *values):
        """The message box's text and pictures (each a message of its own, ui/images.py), sent; a picture for a
        model that takes text only is refused before anything is sent, and the box keeps what it holds."""
        text, files = message["text"], message.get("files") or []
        if not text.strip() and not files:
            yield [SKIP] * 7
            return
        session.restore(stored)
        try:
            if files and not await client.takes_images(_settings(values)["model"]):
                raise ValueError("This model takes text only: remove the picture to send the message.")
            pictures = [images.attached(f if isinstance(f, str) else f["path"]) for f in files]
        except ValueError as e:
            gr.Warning(str(e))
            yield [SKIP] * 7
            return
        asked = settled(session.chat()) + pictures + ([{"role": "user", "content": text}] if text.strip() else [])
        async for shown in stream(session, asked, query, values, [EMPTY_MESSAGE, REGENERATE]):
            yield shown

    async def answer_anew(asked, session, query, values):
        """The reply generated anew from `asked` (the chat up to where the next reply starts)."""
        async for shown in stream(session, asked, query, values, [SKIP, REGENERATE]):
            yield shown

    async def edited(edit: gr.EditData, session, stored, query, *values):
        """Up to the edited user message, which now says what the user wrote (an emptied one is left as it was)."""
        session.restore(stored)
        chat, text = session.chat(), text_of(edit.value)
        asked = chat if not text.strip() or edit.index >= len(chat) else chat[:edit.index] + [
            {"role": "user", "content": text}]
        async for shown in answer_anew(asked, session, query, values):
            yield shown

    async def regenerate_selected(session, stored, query, *values):
        """The selected message's reply (the last one's, with none selected), later turns dropped."""
        session.restore(stored)
        async for shown in answer_anew(before_reply(session.chat(), session.selected), session, query, values):
            yield shown

    async def retry_last(session, stored, query, *values):
        session.restore(stored)
        async for shown in answer_anew(before_reply(session.chat()), session, query, values):
            yield shown

    async def select_message(session, select: gr.SelectData):
        """A click on a message chooses it for Regenerate; a second click on it, none."""
        session.selected = None if session.selected == select.index else select.index
        return REGENERATE if session.selected is None else REGENERATE_SELECTED

    async def stop_reply(session, stored, stats, query, *values):
        """[stats, chatbot, Regenerate, *kept]: the reply as far as it came, kept, its stats line saying so."""
        session.restore(stored)
        chat = settled(session.chat())  # (no thought left "thinking")
        session.take_chat()
        if "streaming" in stats:  # (and only then)
            stats = f"{stats.replace(' · streaming…', '')} · stopped"
        session.stats = stats
        return [stats, chat, REGENERATE, *saved(session, chat, query, values)]

    async def clear_chat(session, stored, query, *values):
        """[chatbot, stats, Regenerate, *kept]: an empty chat (which the store does not keep)."""
        session.restore(stored)
        session.take_chat()
        return [[], "", REGENERATE, *saved(session, [], query, values)]

    async def export(kind, session, stored, *values):
        """A file of the conversation on the screen: Markdown, or JSON (the chat request it amounts to)."""
        session.restore(stored)
        chosen, history = _settings(values), session.chat()
        name = conversations.title(conversations.current(session.store))
        try:
            text = (conversations.as_markdown(name, history, chosen) if kind == "md" else json.dumps(
                chat_request(chosen["model"] or await client.model(), history, chosen), indent=2,
                ensure_ascii=False) + "\n")
        except (OpenAIError, OSError, ValueError) as e:
            raise gr.Error(client.error_text(e)) from None
        path = Path(tempfile.mkdtemp(dir=exports)) / f"{_file_name(name)}.{kind}"
        path.write_text(text, encoding="utf-8")
        return gr.update(value=str(path), visible=True)

    async def export_markdown(session, stored, *values):
        return await export("md", session, stored, *values)

    async def export_json(session, stored, *values):
        return await export("json", session, stored, *values)

    with gr.Blocks(title="npu-llm chat") as app:
        stored = gr.BrowserState(conversations.empty_store(), storage_key=STORE_KEY, secret=STORE_SECRET)
        session = gr.State(Session())
        with gr.Sidebar(label="Conversations", elem_id="sidebar"):
            new_chat = gr.Button("New chat", variant="primary", elem_id="new-chat")
            search = gr.Textbox(placeholder="Search titles…", show_label=False, elem_id="search")
            conversation_list = gr.Radio([], label="Conversations", elem_id="conversations")
            title_box = gr.Textbox(label="Title (Enter renames)", elem_id="title")
            with gr.Row():
                rename = gr.Button("Rename", size="sm", min_width=0, elem_id="rename")
                delete = gr.Button("Delete", size="sm", variant="stop", min_width=0, elem_id="delete")
            with gr.Row():
                export_md = gr.Button("Export Markdown", size="sm", min_width=0, elem_id="export-markdown")
                export_js = gr.Button("Export JSON", size="sm", min_width=0, elem_id="export-json")
            exported = gr.File(label="Export", interactive=False, visible=False, elem_id="export-file")

        gr.Markdown("## npu-llm chat")
        panel = gr.Markdown("**Server** connecting…", elem_id="server-panel")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Chat", elem_id="chatbot", height=420, editable="user",
                                     buttons=["copy", "copy_all"])
                stats = gr.Markdown("", elem_id="reply-stats")
                # (pictures: the paperclip, dropped on the box or pasted into it; sent to a vision-language model)
                message = gr.MultimodalTextbox(placeholder="Ask something… (attach a picture with the clip, by "
                                               "dropping or pasting it)", show_label=False, elem_id="message",
                                               file_types=["image"], file_count="multiple", sources=["upload"])
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
                # the base model or one of its LoRA adapters (filled in from the gateway's /v1/models once loaded)
                model = gr.Dropdown([], value=None, label="Model (base or LoRA adapter)", allow_custom_value=True,
                                    elem_id="model")
        timer = gr.Timer(REFRESH_S, active=False)  # (started once the conversations are restored)

        settings_inputs = [system, temperature, top_p, max_tokens, seed, json_mode, schema, tools, tool_choice, model]
        assert len(settings_inputs) == len(SETTINGS)
        kept = [stored, conversation_list, title_box]  # what saved() answers
        screen = [chatbot, title_box, stats, regenerate, *settings_inputs]  # what on_screen() answers
        chat_inputs = [session, stored, search, *settings_inputs]
        # A reply is one event from the question to its end. Not one at a time (Gradio's default) across the
        # people sharing the UI, nor skipped while another reply streams (it takes the chat from that one).
        replies = dict(outputs=[message, chatbot, stats, regenerate, *kept], concurrency_limit=None,
                       trigger_mode="multiple", show_progress="hidden")
        events = [
            message.submit(send_message, [session, stored, message, search, *settings_inputs], **replies),
            send.click(send_message, [session, stored, message, search, *settings_inputs], **replies),
            regenerate.click(regenerate_selected, chat_inputs, **replies),
            chatbot.retry(retry_last, chat_inputs, **replies),
            chatbot.edit(edited, chat_inputs, **replies),
        ]
        chatbot.select(select_message, session, regenerate, queue=False)
        # The events below take the chat, so a streaming reply stops at its next token and draws the chat as the
        # taker left it. Stop also cancels the reply's event, which closes its stream at once (no token may come).
        stop.click(stop_reply, [session, stored, stats, search, *settings_inputs], [stats, chatbot, regenerate, *kept],
                   cancels=events)
        for cleared in (clear.click, chatbot.clear):  # (the chatbot's own bin icon too)
            cleared(clear_chat, [session, stored, search, *settings_inputs], [chatbot, stats, regenerate, *kept])
        # A setting belongs to the conversation it is changed in; text boxes are kept when left, not per key.
        gr.on([c.blur if isinstance(c, gr.Textbox) else c.change for c in settings_inputs], persist, chat_inputs,
              kept, trigger_mode="always_last", show_progress="hidden", queue=False)

        new_chat.click(start_new, chat_inputs, [stored, conversation_list, *screen])
        conversation_list.input(switch, [session, stored, conversation_list, search, *settings_inputs],
                                [stored, conversation_list, *screen])
        gr.on([rename.click, title_box.submit], rename_current, [session, stored, title_box, search], kept,
              queue=False)
        delete.click(delete_current, [session, stored, search], [stored, conversation_list, *screen])
        search.change(lambda s, q: sidebar(s.store, q), [session, search], conversation_list, queue=False)
        export_md.click(export_markdown, [session, stored, *settings_inputs], exported)
        export_js.click(export_json, [session, stored, *settings_inputs], exported)

        refresh = [panel, throughput_plot, kv_plot]
        timer.tick(metrics.refresh, None, refresh)
        # the panel fills in once the conversations are back (which is how a test knows the page is ready)
        app.load(restore, [session, stored, search], [session, conversation_list, *screen]).then(
            models, model, model).then(lambda: (*metrics.refresh(), gr.Timer(active=True)), None, [*refresh, timer])
    return app


def _file_name(title: str) -> str:
    return re.sub(r"[^\w\- ]+", "", title).strip().replace(" ", "-")[:60] or "conversation"


def run_ui(args) -> int:
    """`npu-llm ui` (flags in backend/entrypoints/cli.py)."""
    api_key = args.api_key or os.environ.get("NPU_LLM_API_KEY") or None  # the gateway's, read from the same variable
    try:
        auth = checked_login(args.host, api_key)
    except ValueError as e:
        print(f"npu-llm ui: {e}", file=sys.stderr)
        return 2
    app = build_app(UISettings(args.gateway_url, args.metrics_url, api_key, args.prefill_metrics_url))
    app.queue().launch(server_name=args.host, server_port=args.port, show_error=False, quiet=True, auth=auth,
                       app_kwargs={"middleware": MIDDLEWARE})
    return 0
