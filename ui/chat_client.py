"""The UI's OpenAI client of the gateway: a reply streamed as chatbot messages with a stats line, and errors as
sentences that say what to do."""
from __future__ import annotations

import json
import time

import openai
from openai import AsyncOpenAI

from ui.messages import as_openai, reply_text, shown


class ChatClient:
    def __init__(self, gateway_url: str, api_key: str | None):
        self.gateway_url = gateway_url
        # Async: Stop cancels the task awaiting a reply, which closes the HTTP stream at once (a sync generator would
        # linger in its worker thread until collected), and no call holds the event loop the UI's handlers share.
        self.client = AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key=api_key or "unused", max_retries=0,
                                  timeout=300)
        self._model: str | None = None

    async def model(self) -> str:
        """The served base model (the gateway lists it first)."""
        if self._model is None:
            self._model = (await self.client.models.list()).data[0].id
        return self._model

    async def takes_images(self, model: str | None) -> bool:
        """Whether the model (the base model when None) takes pictures: its card's input_modalities (when the gateway
        cannot say, the request goes, and its answer says)."""
        try:
            cards = (await self.client.models.list()).data
        except openai.OpenAIError:
            return True
        card = next((c for c in cards if c.id == model), cards[0])
        return "image" in (getattr(card, "input_modalities", None) or ["text"])

    async def models(self) -> list[str]:
        """What a chat can talk to: the base model, then its LoRA adapters (the gateway's /v1/models)."""
        return [card.id for card in (await self.client.models.list()).data]

    async def stream_reply(self, history: list[dict], settings: dict):
        """Yields (the reply's chat messages so far, stats line) while the reply streams: the reasoning as a
        thought, when the model thinks, then the answer."""
        start, first, text, reasoning, chunks = time.perf_counter(), None, "", "", 0
        tokens = prompt_tokens = None
        calls: dict[int, dict] = {}  # the tool calls streamed so far, by index
        stream = await self.client.chat.completions.create(
            **chat_request(settings.get("model") or await self.model(), history, settings), stream=True,
            stream_options={"include_usage": True})
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
                    answer = reply_text(text, calls)
                    yield shown(reasoning, answer, thinking=not answer), stats(start, first, chunks, streaming=True)
            yield shown(reasoning, reply_text(text, calls), thinking=False), stats(
                start, first, tokens or chunks, streaming=False, prompt_tokens=prompt_tokens)
        finally:
            await stream.close()  # on Stop too: closing the connection cancels the request on the server

    def error_text(self, e: Exception) -> str:
        """What went wrong, as one sentence the user can act on (never a traceback)."""
        if isinstance(e, openai.APIConnectionError):  # (timeouts too)
            return (f"Cannot reach the gateway at {self.gateway_url} ({e.__cause__ or e.message}). Is it running? "
                    f"`npu-llm up` starts it; `npu-llm ui --gateway-url URL` points the UI at another.")
        if isinstance(e, openai.AuthenticationError):
            return ("The gateway refused the API key (401). Start the UI with `--api-key KEY` (or NPU_LLM_API_KEY "
                    "set) to the gateway's key.")
        if isinstance(e, openai.APIStatusError):
            if e.status_code == 503:
                return (f"The server is not serving (503): {_server_message(e)}. Is Triton running? `npu-llm up` "
                        f"starts it.")
            return f"The gateway refused the request ({e.status_code}): {_server_message(e)}"
        if isinstance(e, openai.APIError):  # an error event in the stream, after the 200
            return f"The reply failed on the server: {_server_message(e)}"
        return str(e) or type(e).__name__  # (the UI's own checks: ValueError naming the field)


def _server_message(e: openai.APIError) -> str:
    """The message the gateway wrote in its OpenAI-shaped error body (which names the parameter of a 400)."""
    body = e.body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"].get("message") or e.message
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return e.message


def chat_request(model: str, history: list[dict], settings: dict) -> dict:
    """The chat completions request for the next reply: the conversation (system prompt first, no thoughts) and
    the side panel's settings (named as in conversations.SETTINGS). JSON mode asks for JSON, matching the schema
    when one is given; tools (an OpenAI tools list, as JSON) lets the model call them. ValueError (shown in the
    chat) names a box that does not hold valid JSON."""
    request = {"model": model, "messages": as_openai(history, settings["system"]),
               "temperature": settings["temperature"], "top_p": settings["top_p"],
               "max_tokens": int(settings["max_tokens"])}
    if settings["seed"] is not None and settings["seed"] >= 0:
        request["seed"] = int(settings["seed"])
    if settings["json_mode"]:
        request["response_format"] = {"type": "json_object"}
        if settings["schema"].strip():
            request["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "reply", "schema": _json(settings["schema"], "the schema")}}
    if settings["tools"].strip():
        request["tools"] = _json(settings["tools"], "the tools list")
        request["tool_choice"] = settings["tool_choice"]
    return request


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def stats(start: float, first: float | None, tokens: int | None, streaming: bool,
          prompt_tokens: int | None = None) -> str:
    """The stats line under the chat: time to first token, tokens, tokens/s, and the prompt's size."""
    if first is None:
        return "waiting for the first token…" if streaming else "no tokens: the model ended at once"
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
