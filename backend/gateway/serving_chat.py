"""POST /v1/chat/completions: the conversation through the chat template, tools and structured outputs
(backend/gateway/tools.py), and the answer as OpenAI's chat completion or its stream of chunks: reasoning split
off first (backend/gateway/reasoning.py), then tool calls read from what follows it."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response

from backend.engine.sampling_params import StructuredOutputsParams
from backend.gateway.protocol import ChatCompletionRequest, NamedToolChoice
from backend.gateway.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    FunctionCallOut,
    ToolCallOut,
    Usage,
    chunk_json,
    completion_id,
    now,
)
from backend.gateway.errors import ApiError
from backend.gateway.reasoning import ReasoningSplit, reasoning_split
from backend.gateway.serving import Serving, Totals
from backend.gateway.sse import event_stream
from backend.gateway.tools import ToolDeltas, constraint_for, render_prompt


def prepare(serving: Serving, req: ChatCompletionRequest) -> tuple[str, StructuredOutputsParams | None]:
    """The prompt and the output's constraint, or a 400 naming what is wrong."""
    constraint = req.constraint()  # (at most one: checked when the request was validated)
    mode = req.tool_mode
    tool_constraint = constraint_for(mode, req.tools or [], req.parallel_tool_calls)
    if tool_constraint is not None and constraint is not None:
        raise ApiError(400, "tool_choice 'required' or a named function cannot be combined with response_format or "
                            "structured outputs: the tool call is the output", param="tool_choice")
    messages = [m.for_template() for m in req.messages]
    try:
        prompt = render_prompt(serving.tokenizer, messages, req.tools if mode != "none" else None,
                               req.chat_template_kwargs)
    except Exception as e:  # the template itself rejects the conversation (e.g. roles out of order)
        raise ApiError(400, f"messages: {e}", param="messages") from None
    return prompt, tool_constraint or constraint


async def answer(serving: Serving, req: ChatCompletionRequest, prompt: str, constraint, started: float,
                 images: list[str] = ()) -> Response:
    rid = completion_id("chatcmpl")
    chunk, responses = await serving.start("chat", started, prompt, req.engine_parameters(constraint), req.stream, rid,
                                             model=req.model, images=images)
    deltas = [choice_deltas(serving, req, prompt, constraint) for _ in range(req.n)]
    if req.stream:
        return event_stream(_events(serving, req, deltas, rid, chunk, responses))
    whole = await serving.gather(chunk, responses, req.n)
    choices = []
    for i in range(req.n):
        parts = deltas[i].feed(whole.texts[i]) + deltas[i].finish()
        choices.append(ChatChoice(index=i, message=_message(parts),
                                  logprobs=_logprobs(whole.logprobs[i], req.top_logprobs) if req.logprobs else None,
                                  finish_reason=_finish_reason(whole.reasons[i], deltas[i].tools)))
    response = ChatCompletionResponse(id=rid, model=req.model, choices=choices,
                                      usage=Usage.of(whole.num_input_tokens, sum(whole.counts)),
                                      prompt_logprobs=whole.prompt_logprobs, kv_transfer_params=whole.kv_transfer_params)
    return JSONResponse(response.model_dump())


async def _events(serving: Serving, req: ChatCompletionRequest, deltas: list[ChoiceDeltas], rid: str, chunk,
                  responses) -> AsyncIterator[str]:
    created = now()

    def event(choices, usage=None) -> str:
        return chunk_json(ChatCompletionChunk(id=rid, created=created, model=req.model, choices=choices, usage=usage))

    yield event([ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""}) for i in range(req.n)])
    totals = Totals()
    async for c in serving.relay(chunk, responses, totals):
        for i, text in enumerate(c.texts):
            reason = c.finish_reasons[i]
            parts = deltas[i].feed(text) + (deltas[i].finish() if reason else [])
            lp = _logprobs(c.logprobs[i], req.top_logprobs) if req.logprobs and c.logprobs else None
            if not parts and (reason or lp):
                parts = [{}]
            for k, part in enumerate(parts):  # one event per delta: a choice appears once per chunk
                last = k == len(parts) - 1
                yield event([ChatChunkChoice(index=i, delta=part, logprobs=lp if k == 0 else None,
                                             finish_reason=_finish_reason(reason, deltas[i].tools) if last
                                             else None)])
    if req.include_usage:
        yield event([], Usage.of(totals.prompt, totals.completion))


@dataclass
class ChoiceDeltas:
    """One choice's text as chat deltas: the reasoning split off first (when the server has a reasoning parser),
    what follows it read for tool calls (so a call is never looked for inside the thinking)."""

    tools: ToolDeltas
    reasoning: ReasoningSplit | None = None

    def feed(self, text: str) -> list[dict]:
        if self.reasoning is None:
            return self.tools.feed(text)
        return self._answer_to_tools(self.reasoning.feed(text))

    def finish(self) -> list[dict]:
        held = self._answer_to_tools(self.reasoning.finish()) if self.reasoning is not None else []
        return held + self.tools.finish()

    def _answer_to_tools(self, parts: list[dict]) -> list[dict]:
        out = []
        for part in parts:
            out += self.tools.feed(part["content"]) if "content" in part else [part]
        return out


def _message(parts: list[dict]) -> AssistantMessage:
    """The deltas of a whole answer, put together."""
    content = "".join(p.get("content", "") for p in parts)
    reasoning = "".join(p.get("reasoning", "") for p in parts) or None
    calls: dict[int, dict] = {}
    for part in parts:
        for delta in part.get("tool_calls", []):
            call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.get("id") or call["id"]
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"].get("arguments", "")
    tool_calls = [ToolCallOut(id=c["id"], function=FunctionCallOut(name=c["name"], arguments=c["arguments"]))
                  for _, c in sorted(calls.items())]
    return AssistantMessage(content=content or (None if tool_calls else ""), reasoning_content=reasoning,
                            reasoning=reasoning, tool_calls=tool_calls or None)


def choice_deltas(serving: Serving, req: ChatCompletionRequest, prompt: str,
                  constraint: StructuredOutputsParams | None) -> ChoiceDeltas:
    tools = ToolDeltas(req.tool_mode, serving.tool_call_parser, {t.function.name for t in req.tools or []},
                       req.parallel_tool_calls)
    if serving.reasoning_parser is None:
        return ChoiceDeltas(tools)
    return ChoiceDeltas(tools, reasoning_split(serving.reasoning_parser, prompt, constrained=constraint is not None))


def _finish_reason(reason: str | None, deltas: ToolDeltas) -> str | None:
    """"tool_calls" when the model chose to call (auto, required); a named function forced on it ends with
    "stop", as OpenAI's and vLLM's do."""
    chose = deltas.made_calls and not isinstance(deltas.mode, NamedToolChoice)
    return "tool_calls" if chose and reason == "stop" else reason


def _logprobs(entries: list[dict] | None, k: int | None) -> dict | None:
    """OpenAI's chat logprobs from vLLM's shape (backend/triton/contract.py: the sampled token first)."""
    if entries is None:
        return None

    def item(lp: dict):
        token = lp["decoded_token"]
        return {"token": token, "logprob": lp["logprob"], "bytes": list(token.encode())}

    content = []
    for position in entries:
        sampled, *_ = position.values()
        top = sorted(position.values(), key=lambda lp: lp["rank"])[: k or 0]
        content.append({**item(sampled), "top_logprobs": [item(lp) for lp in top]})
    return {"content": content}
