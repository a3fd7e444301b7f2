"""POST /v1/completions: a text (or token-id) prompt, answered as OpenAI's text completion or its stream."""
from __future__ import annotations

from collections.abc import AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.responses import JSONResponse, Response

from backend.gateway.protocol import CompletionRequest
from backend.gateway.responses import CompletionChoice, CompletionResponse, Usage, completion_id, now
from backend.gateway.serving import Serving, Totals


async def answer(serving: Serving, req: CompletionRequest, started: float) -> Response:
    constraint = req.constraint()  # (at most one: checked when the request was validated)
    # Token ids go to the engine as they are; their text is only for echo.
    ids = None if isinstance(req.prompt, str) else req.prompt
    prompt = req.prompt if ids is None else serving.tokenizer.decode(ids)
    rid = completion_id("cmpl")
    chunk, responses = await serving.start("completions", started, prompt, req.engine_parameters(constraint),
                                           req.stream, req.logprobs is not None, rid, ids)
    if req.stream:
        return EventSourceResponse(_events(serving, req, rid, prompt, chunk, responses, started))
    whole = await serving.gather(chunk, responses, req.n)
    echo = prompt if req.echo else ""
    choices = [CompletionChoice(index=i, text=echo + whole.texts[i], finish_reason=whole.reasons[i],
                                logprobs=_logprobs(whole.logprobs[i]) if req.logprobs is not None else None)
               for i in range(req.n)]
    response = CompletionResponse(id=rid, model=req.model, choices=choices,
                                  usage=Usage.of(whole.num_input_tokens, sum(whole.counts)))
    return JSONResponse(response.model_dump())


async def _events(serving: Serving, req: CompletionRequest, rid: str, prompt: str, chunk, responses,
                  started: float) -> AsyncIterator[str]:
    created = now()

    def event(choices, usage=None) -> str:
        chunk = CompletionResponse(id=rid, created=created, model=req.model, choices=choices, usage=usage)
        return chunk.model_dump_json(exclude=None if usage else {"usage"})  # usage only in its own last chunk

    if req.echo:
        yield event([CompletionChoice(index=i, text=prompt) for i in range(req.n)])
    totals = Totals()
    async for c in serving.relay(chunk, responses, "completions", started, totals):
        if isinstance(c, str):
            yield c
            return
        choices = [CompletionChoice(index=i, text=c.texts[i], finish_reason=c.finish_reasons[i],
                                    logprobs=_logprobs(c.logprobs[i]) if req.logprobs is not None and c.logprobs
                                    else None)
                   for i in range(len(c.texts)) if c.texts[i] or c.finish_reasons[i]]
        if choices:
            yield event(choices)
    if req.include_usage:
        yield event([], Usage.of(totals.prompt, totals.completion))
    yield "[DONE]"


def _logprobs(entries: list[dict] | None) -> dict | None:
    """OpenAI's completion logprobs from vLLM's shape (the sampled token first at each position)."""
    if entries is None:
        return None
    sampled = [next(iter(position.values())) for position in entries]
    return {"tokens": [lp["decoded_token"] for lp in sampled],
            "token_logprobs": [lp["logprob"] for lp in sampled],
            "top_logprobs": [{lp["decoded_token"]: lp["logprob"] for lp in position.values()} for position in entries],
            "text_offset": None}
