"""Gradio chat UI: an ordinary OpenAI client of the gateway, with a panel of Triton's metrics.

Replies stream token by token; a thinking model's reasoning (the gateway's reasoning_content) streams
into a "thought" above the answer, which folds away once the answer begins. Stop cancels the Gradio event,
which closes the HTTP stream, so the gateway cancels the Triton request and the engine frees it. The server
panel refreshes from Triton's /metrics every few seconds.
"""
from __future__ import annotations

import json
import os
import time
import urllib.request
from collections import deque
from dataclasses import dataclass

import gradio as gr
import pandas as pd
from openai import AsyncOpenAI, OpenAI, OpenAIError
from prometheus_client.parser import text_string_to_metric_families

REFRESH_S = 3.0
HISTORY_S = 300  # throughput plot window
THINKING, THOUGHT = "💭 Thinking…", "💭 Thought"


@dataclass
class UISettings:
    gateway_url: str = "http://127.0.0.1:9000"
    metrics_url: str = "http://127.0.0.1:8002/metrics"
    api_key: str | None = None


def _error_text(e: Exception) -> str:
    """A readable one-liner for the chat, never a traceback."""
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"].get("message", str(e))
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return getattr(e, "message", None) or str(e) or type(e).__name__


class ChatBackend:
    def __init__(self, settings: UISettings):
        self.settings = settings
        client_args = dict(base_url=f"{settings.gateway_url}/v1", api_key=settings.api_key or "unused",
                           max_retries=0, timeout=300)
        self.client = OpenAI(**client_args)
        # Replies stream through the async client: Stop cancels the task awaiting it, which closes the
        # HTTP stream at once (a sync generator would linger in its worker thread until collected).
        self.async_client = AsyncOpenAI(**client_args)
        self.samples: deque[tuple[float, float]] = deque()  # (time, vllm:generation_tokens_total)
        self._model: str | None = None

    def model(self) -> str:
        if self._model is None:
            self._model = self.client.models.list().data[0].id
        return self._model

    async def stream_reply(self, history: list[dict], system: str, temperature: float, top_p: float,
                           max_tokens: int, seed: float | None, json_mode: bool = False, schema: str = "",
                           tools: str = "", tool_choice: str = "auto"):
        """Yields (the reply's chat messages so far, stats line) while the reply streams: the reasoning as a
        thought, when the model thinks, then the answer. JSON mode asks for JSON (matching the schema, when one is
        given); tools (an OpenAI tools list, as JSON) lets the model call them, shown readably."""
        # earlier thoughts stay on the screen only: models are sent their earlier answers, not their thinking
        messages = ([{"role": "system", "content": system}] if system.strip() else []) + [
            {"role": m["role"], "content": m["content"]} for m in history if not _is_thought(m)]
        start, first, text, reasoning, chunks = time.perf_counter(), None, "", "", 0
        tokens = prompt_tokens = None
        calls: dict[int, dict] = {}  # the tool calls streamed so far, by index
        stream = await self.async_client.chat.completions.create(
            model=self.model(), messages=messages, temperature=temperature, top_p=top_p, max_tokens=int(max_tokens),
            seed=None if seed is None or seed < 0 else int(seed), stream=True, stream_options={"include_usage": True},
            **_output_options(json_mode, schema, tools, tool_choice))
        try:
            async for chunk in stream:
                if chunk.usage is not None:  # the exact counts, in the last chunk
                    tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
                delta = chunk.choices[0].delta if chunk.choices else None
                # (the SDK keeps the fields it does not declare, such as reasoning_content, as attributes)
                thought = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
                if delta and (delta.content or delta.tool_calls or thought):
                    first = first or time.perf_counter()
                    reasoning += thought or ""
                    text += delta.content or ""
                    for call in delta.tool_calls or []:
                        entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                        entry["name"] += call.function.name or ""
                        entry["arguments"] += call.function.arguments or ""
                    chunks += 1  # one per engine step: a token, or a few that complete a character
                    answer = _reply(text, calls)
                    yield _shown(reasoning, answer, thinking=not answer), _stats(start, first, chunks, streaming=True)
            yield _shown(reasoning, _reply(text, calls), thinking=False), _stats(
                start, first, tokens or chunks, streaming=False, prompt_tokens=prompt_tokens)
        finally:
            await stream.close()  # on Stop too: closing the connection cancels the request on the server

    def server_panel(self) -> tuple[str, pd.DataFrame]:
        try:
            with urllib.request.urlopen(self.settings.metrics_url, timeout=2) as r:
                families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        except OSError as e:
            return f"**Server** unreachable ({e})", self.throughput()

        def values(name: str) -> list[float]:  # one per engine (data parallel: one per Triton instance)
            family = families.get(name)
            return [sample.value for sample in family.samples] if family else []

        def total(name: str) -> float:
            return sum(values(name))

        def mean(name: str) -> float:
            return total(name) / max(1, len(values(name)))

        engines = families["npu_llm:engine_info"].samples if "npu_llm:engine_info" in families else []
        labels = engines[0].labels if engines else {}
        devices = ", ".join(engine.labels.get("device", "?") for engine in engines) or "?"
        now = time.time()
        self.samples.append((now, total("vllm:generation_tokens")))  # the parser strips _total from counters
        while self.samples and self.samples[0][0] < now - HISTORY_S:
            self.samples.popleft()
        panel = (
            f"**Model** {labels.get('engine_model', '?')} · **Layout** {labels.get('layout', '?')} on {devices} · "
            f"**KV cache** {mean('vllm:kv_cache_usage_perc') * 100:.1f}% · "
            f"**Running** {total('vllm:num_requests_running'):.0f} · "
            f"**Waiting** {total('vllm:num_requests_waiting'):.0f} · "
            f"**Prefix-cache hit rate** {mean('vllm:prefix_cache_hit_rate') * 100:.0f}%"
        )
        return panel, self.throughput()

    def throughput(self) -> pd.DataFrame:
        """Generation tokens/s between successive samples, at clock time. The columns are typed even when empty:
        Gradio's plot picks each axis's scale from its column's dtype, and an untyped (object) column is drawn
        as categories, which put the raw floats on the axis in the order they came."""
        points = list(self.samples)
        pairs = [(t1, (v1 - v0) / (t1 - t0)) for (t0, v0), (t1, v1) in zip(points, points[1:]) if t1 > t0]
        return pd.DataFrame({
            "time": pd.to_datetime([t for t, _ in pairs], unit="s", utc=True).tz_convert(None),
            "tokens/s": pd.Series([rate for _, rate in pairs], dtype="float64")})


def _output_options(json_mode: bool, schema: str, tools: str, tool_choice: str) -> dict:
    """The request's response_format and tools, from the side panel; ValueError (shown in the chat) if not JSON."""
    options = {}
    if json_mode:
        options["response_format"] = {"type": "json_object"}
        if schema.strip():
            options["response_format"] = {"type": "json_schema",
                                          "json_schema": {"name": "reply", "schema": _json(schema, "the schema")}}
    if tools.strip():
        options["tools"] = _json(tools, "the tools")
        options["tool_choice"] = tool_choice
    return options


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def _is_thought(message: dict) -> bool:
    return bool((message.get("metadata") or {}).get("title"))


def _shown(reasoning: str, answer: str, thinking: bool) -> list[dict]:
    """The reply as the chatbot's messages: the reasoning as a thought (Gradio folds it away once its status is
    done), then the answer."""
    shown = []
    if reasoning:
        shown.append({"role": "assistant", "content": reasoning,
                      "metadata": {"title": THINKING if thinking else THOUGHT,
                                   "status": "pending" if thinking else "done"}})
    if answer or not reasoning:
        shown.append({"role": "assistant", "content": answer})
    return shown


def _settled(messages: list[dict]) -> list[dict]:
    """The messages with a thought cut short (Stop, an error) marked done: no spinner left turning."""
    return [{**m, "metadata": {**m["metadata"], "title": THOUGHT, "status": "done"}}
            if _is_thought(m) and m["metadata"].get("status") == "pending" else m for m in messages]


def _reply(text: str, calls: dict[int, dict]) -> str:
    """The reply as shown: its text, then each tool call as its name and pretty-printed arguments."""
    shown = [text] if text else []
    for _, call in sorted(calls.items()):
        try:
            arguments = json.dumps(json.loads(call["arguments"]), indent=2)
        except json.JSONDecodeError:  # still streaming
            arguments = call["arguments"]
        shown.append(f"🔧 **{call['name']}**\n```json\n{arguments}\n```")
    return "\n\n".join(shown)


def _stats(start: float, first: float | None, tokens: int | None, streaming: bool,
           prompt_tokens: int | None = None) -> str:
    if first is None:
        return "waiting for the first token…"
    ttft = first - start
    elapsed = time.perf_counter() - first
    parts = [f"TTFT {ttft:.2f} s"]
    if tokens:
        parts.append(f"{tokens} tokens")
        if elapsed > 0 and tokens > 1:
            parts.append(f"{(tokens - 1) / elapsed:.1f} tokens/s")
    if prompt_tokens:  # the conversation as the model saw it (system prompt and template included)
        parts.append(f"prompt {prompt_tokens} tokens")
    return " · ".join(parts) + (" · streaming…" if streaming else "")


def build_app(settings: UISettings) -> gr.Blocks:
    backend = ChatBackend(settings)

    async def respond(history, system, temperature, top_p, max_tokens, seed, json_mode, schema, tools, tool_choice):
        asked = list(history)
        reply = [{"role": "assistant", "content": ""}]
        try:
            async for reply, stats in backend.stream_reply(asked, system, temperature, top_p, max_tokens, seed,
                                                           json_mode, schema, tools, tool_choice):
                yield asked + reply, stats
        except (OpenAIError, OSError, ValueError) as e:
            thoughts = _settled([m for m in reply if _is_thought(m)])  # what it had thought stays
            yield asked + thoughts + [{"role": "assistant", "content": f"⚠️ {_error_text(e)}"}], "request failed"

    def add_user(message, history):
        if not message.strip():
            return "", history
        return "", list(history) + [{"role": "user", "content": message}]

    def settle_thoughts(history):
        settled = _settled(history)
        return settled if settled != history else gr.skip()  # (nothing was thinking: nothing to redraw)

    def drop_last_reply(history):
        history = list(history)
        while history and history[-1]["role"] == "assistant":
            history.pop()
        return history

    with gr.Blocks(title="npu-llm chat") as app:
        gr.Markdown("## npu-llm chat")
        panel = gr.Markdown("**Server** connecting…", elem_id="server-panel")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Chat", elem_id="chatbot", height=460)
                stats = gr.Markdown("", elem_id="reply-stats")
                message = gr.Textbox(placeholder="Ask something…", show_label=False, elem_id="message")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id="send")
                    stop = gr.Button("Stop", elem_id="stop")
                    regenerate = gr.Button("Regenerate", elem_id="regenerate")
                    clear = gr.Button("Clear", elem_id="clear")
            with gr.Column(scale=1):
                system = gr.Textbox(label="System prompt", value="", lines=3, elem_id="system-prompt")
                temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature", elem_id="temperature")
                top_p = gr.Slider(0.05, 1, value=0.95, step=0.05, label="Top p")
                max_tokens = gr.Slider(1, 2048, value=512, step=1, label="Max tokens", elem_id="max-tokens")
                seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)", elem_id="seed")
                json_mode = gr.Checkbox(label="JSON mode", value=False, elem_id="json-mode")
                schema = gr.Textbox(label="JSON schema (optional)", lines=3, elem_id="json-schema",
                                    placeholder='{"type": "object", "properties": {...}}')
                tools = gr.Textbox(label="Tools (OpenAI tools list, optional)", lines=3, elem_id="tools",
                                   placeholder='[{"type": "function", "function": {"name": ..., "parameters": {...}}}]')
                tool_choice = gr.Radio(["auto", "required"], value="auto", label="Tool choice", elem_id="tool-choice")
                plot = gr.LinePlot(x="time", y="tokens/s", title="Generation throughput (last 5 min)",
                                   y_lim=[0, None], y_axis_format="~s",
                                   height=220, elem_id="throughput-plot")

        settings_inputs = [system, temperature, top_p, max_tokens, seed, json_mode, schema, tools, tool_choice]
        events = [
            message.submit(add_user, [message, chatbot], [message, chatbot], queue=False).then(
                respond, [chatbot, *settings_inputs], [chatbot, stats]),
            send.click(add_user, [message, chatbot], [message, chatbot], queue=False).then(
                respond, [chatbot, *settings_inputs], [chatbot, stats]),
            regenerate.click(drop_last_reply, chatbot, chatbot, queue=False).then(
                respond, [chatbot, *settings_inputs], [chatbot, stats]),
        ]
        # Label the reply once the cancellation went through (queued behind it, not racing it).
        stop.click(None, cancels=events, queue=False).then(
            lambda s: f"{s.replace(' · streaming…', '')} · stopped", stats, stats).then(
            settle_thoughts, chatbot, chatbot, show_progress="hidden")  # (no loading overlay on the stopped reply)
        clear.click(lambda: ([], ""), None, [chatbot, stats], cancels=events)
        timer = gr.Timer(REFRESH_S)
        timer.tick(backend.server_panel, None, [panel, plot])
        app.load(backend.server_panel, None, [panel, plot])
    return app


def run_ui(args) -> int:
    """`npu-llm ui` (flags in backend/cli.py)."""
    api_key = args.api_key or os.environ.get("NPU_LLM_API_KEY") or None  # the gateway's, read from the same variable
    app = build_app(UISettings(args.gateway_url, args.metrics_url, api_key))
    app.queue().launch(server_name=args.host, server_port=args.port, show_error=False, quiet=True)
    return 0
