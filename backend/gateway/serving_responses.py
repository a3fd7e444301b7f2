"""POST /v1/responses (OpenAI's Responses API): served as the chat request it amounts to
(backend/gateway/protocol_responses.py), its chat deltas (reasoning, text, tool calls) made into the Responses API's
output items, whole or as its stream of typed events. GET and DELETE /v1/responses/{id}: a kept response."""
from __future__ import annotations

import copy
import time
import uuid
from collections.abc import AsyncIterator, Callable

from sse_starlette.sse import ServerSentEvent
from starlette.responses import JSONResponse, Response

from backend.gateway import serving_chat
from backend.gateway.errors import ApiError
from backend.gateway.protocol import ChatCompletionRequest
from backend.gateway.protocol_responses import ResponsesRequest, as_messages
from backend.gateway.request_body import validate
from backend.gateway.response_store import CallersResponses
from backend.gateway.serving import Serving, Totals
from backend.gateway.sse import typed_event_stream


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


async def answer(serving: Serving, store: CallersResponses, req: ResponsesRequest, started: float) -> Response:
    history = []
    if req.previous_response_id is not None:
        kept = store.get(req.previous_response_id)
        if kept is None:
            raise ApiError(400, f"previous_response_id: no response {req.previous_response_id!r} is kept here (they "
                                "are kept in this gateway's memory, for a while)", param="previous_response_id")
        history = kept.messages
    chat = validate(ChatCompletionRequest, req.as_chat(history))
    prompt, constraint = serving_chat.prepare(serving, chat)
    rid = _id("resp")
    chunk, responses = await serving.start("responses", started, prompt, chat.engine_parameters(constraint),
                                           bool(req.stream), rid, model=req.model)
    deltas = serving_chat.choice_deltas(serving, chat, prompt, constraint)
    answered = Answered(serving, store, req, rid, history)
    output = OutputItems()
    if req.stream:
        totals = Totals()

        def failed(error: ApiError) -> list[dict]:
            return [{"type": "response.failed", "response": answered.response(
                output.items, "failed", totals.prompt, totals.completion, error)}]

        return typed_event_stream(lambda event: _events(answered, deltas, output, totals, chunk, responses, event),
                                  failed)
    whole = await serving.gather(chunk, responses, 1)
    output.feed(deltas.feed(whole.texts[0]) + deltas.finish())
    status = _status(whole.reasons[0])
    output.finish(status)
    response = answered.response(output.items, status, whole.num_input_tokens, whole.counts[0])
    answered.keep(response)
    return JSONResponse(response)


def retrieve(store: CallersResponses, response_id: str) -> Response:
    kept = store.get(response_id)
    if kept is None:
        raise ApiError(404, f"no response {response_id!r} is kept here", "not_found_error")
    return JSONResponse(kept.response)


def forget(store: CallersResponses, response_id: str) -> Response:
    if not store.forget(response_id):
        raise ApiError(404, f"no response {response_id!r} is kept here", "not_found_error")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _status(reason: str | None) -> str:
    """A finished response's status from the engine's finish reason: cut at max_output_tokens is incomplete; aborted
    (the engine stopping), or a stream that ended without one, failed."""
    return {"stop": "completed", "length": "incomplete"}.get(reason, "failed")


async def _events(answered: Answered, deltas: serving_chat.ChoiceDeltas, output: OutputItems, totals: Totals, chunk,
                  responses, event: Callable[[dict], ServerSentEvent]) -> AsyncIterator[ServerSentEvent]:
    started = answered.response([], "in_progress", 0, 0)
    yield event({"type": "response.created", "response": started})
    yield event({"type": "response.in_progress", "response": started})
    reason = None
    async for c in answered.serving.relay(chunk, responses, totals):
        reason = c.finish_reasons[0]
        for payload in output.feed(deltas.feed(c.texts[0]) + (deltas.finish() if reason else [])):
            yield event(payload)
    status = _status(reason)
    for payload in output.finish(status):
        yield event(payload)
    final = answered.response(output.items, status, totals.prompt, totals.completion)
    answered.keep(final)
    yield event({"type": f"response.{status}", "response": final})


class Answered:
    """What a response says beside its output (its id and time, the request's settings, echoed), and keeping it."""

    def __init__(self, serving: Serving, store: CallersResponses, req: ResponsesRequest, rid: str, history: list[dict]):
        self.serving, self.store, self.req, self.rid, self.history = serving, store, req, rid, history
        self.created = time.time()

    def keep(self, response: dict) -> None:
        """Keep a finished response for previous_response_id, unless the request said store false or it failed."""
        if self.req.store is not False and response["status"] != "failed":
            self.store.keep(response, self.history + self.req.input_messages() + as_messages(response["output"]))

    def response(self, items: list[dict], status: str, input_tokens: int, output_tokens: int,
                 error: ApiError | None = None) -> dict:
        req = self.req
        reasoning = "".join(part["text"] for item in items if item["type"] == "reasoning" for part in item["content"])
        # (the reasoning text re-encoded: its think tags are not counted)
        reasoning_tokens = len(self.serving.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        tool_choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": req.model,
            "output": items,
            "error": None if error is None else {"code": "server_error", "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": tool_choice or "auto", "tools": [t.model_dump() for t in req.tools or []],
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
            if req.text and req.text.format else {"format": {"type": "text"}},
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "metadata": req.metadata or {}, "truncation": "disabled", "reasoning": None,
            "usage": None if status == "in_progress" else {
                "input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": input_tokens + output_tokens},
        }


# a text item's events (.delta, .done) and what they carry beside the text
TEXT_EVENTS = {"message": ("response.output_text", {"logprobs": []}), "reasoning": ("response.reasoning_text", {})}


class OutputItems:
    """A response's output items, built from chat deltas (backend/gateway/serving_chat.py ChoiceDeltas) as they come:
    a reasoning item, a message, function calls, each opened when its first delta arrives and done when another
    kind follows. `feed` and `finish` return the stream events that say so; a whole answer only keeps the items."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None
        self._call_index: int | None = None  # the chat delta index of the open function call

    def feed(self, parts: list[dict]) -> list[dict]:
        events = []
        for part in parts:
            if "reasoning" in part:
                events += self._text("reasoning", part["reasoning"])
            if part.get("content"):
                events += self._text("message", part["content"])
            for call in part.get("tool_calls", []):
                events += self._call(call)
        return events

    def finish(self, status: str) -> list[dict]:
        """The last item done, with the response's status (incomplete when cut at max_output_tokens)."""
        return self._close("completed" if status == "completed" else "incomplete")

    def _text(self, kind: str, text: str) -> list[dict]:
        events = [] if self._is_open(kind) else self._close() + self._open_text(kind)
        item, index = self._open, len(self.items) - 1
        item["content"][0]["text"] += text
        event, extra = TEXT_EVENTS[kind]
        return events + [{"type": f"{event}.delta", "item_id": item["id"], "output_index": index, "content_index": 0,
                          "delta": text, **extra}]

    def _call(self, call: dict) -> list[dict]:
        events = []
        if not (self._is_open("function_call") and self._call_index == call["index"]):
            events += self._close()
            self._call_index = call["index"]
            self._open = {"id": _id("fc"), "type": "function_call", "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
            self.items.append(self._open)
            events.append(self._added())
        arguments = call["function"].get("arguments", "")
        self._open["arguments"] += arguments
        if arguments:
            events.append({"type": "response.function_call_arguments.delta", "item_id": self._open["id"],
                           "output_index": len(self.items) - 1, "delta": arguments})
        return events

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _open_text(self, kind: str) -> list[dict]:
        if kind == "message":
            self._open = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                          "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            self._open = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(self._open)
        events = [self._added(), self._part("response.content_part.added", part)]
        self._open["content"].append(part)
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        events = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            event, extra = TEXT_EVENTS[item["type"]]
            events.append({"type": f"{event}.done", **where, "content_index": 0, "text": part["text"], **extra})
            events.append({"type": "response.content_part.done", **where, "content_index": 0,
                           "part": copy.deepcopy(part)})
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": copy.deepcopy(item)})
        return events

    def _added(self) -> dict:
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": copy.deepcopy(self._open)}

    def _part(self, kind: str, part: dict) -> dict:
        return {"type": kind, "item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0,
                "part": copy.deepcopy(part)}
