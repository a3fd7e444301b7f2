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
    generated = req.max_tokens != 0  # (0: the one token the engine sampled is not part of the answer)
    prompt_positions = _prompt_positions(whole.prompt_token_ids, whole.prompt_logprobs, serving.tokenizer, req)
    choices = []
    for i in range(req.n):
        logprobs = None
        if req.logprobs is not None:
            completion = _positions(whole.logprobs[i] or [], req.logprobs) if generated else []
            logprobs = _openai_logprobs(prompt_positions + completion if req.echo else completion)
        choices.append(CompletionChoice(index=i, text=echo + (whole.texts[i] if generated else ""),
                                        finish_reason=whole.reasons[i], logprobs=logprobs,
                                        prompt_logprobs=whole.prompt_logprobs if req.prompt_logprobs is not None
                                        else None))
    response = CompletionResponse(id=rid, model=req.model, choices=choices,
                                  usage=Usage.of(whole.num_input_tokens, sum(whole.counts) if generated else 0))
    return JSONResponse(response.model_dump())


async def _events(serving: Serving, req: CompletionRequest, rid: str, prompt: str, chunk, responses,
                  started: float) -> AsyncIterator[str]:
    created = now()

    def event(choices, usage=None) -> str:
        chunk = CompletionResponse(id=rid, created=created, model=req.model, choices=choices, usage=usage)
        return chunk.model_dump_json(exclude=None if usage else {"usage"})  # usage only in its own last chunk

    if req.echo:  # the prompt first, with its logprobs when asked (they come with the first response)
        positions = _prompt_positions(chunk.prompt_token_ids, chunk.prompt_logprobs, serving.tokenizer, req)
        yield event([CompletionChoice(index=i, text=prompt, logprobs=_openai_logprobs(positions) if positions else None,
                                      prompt_logprobs=chunk.prompt_logprobs if req.prompt_logprobs is not None
                                      else None)
                     for i in range(req.n)])
    generated = req.max_tokens != 0
    totals = Totals()
    async for c in serving.relay(chunk, responses, "completions", started, totals):
        if isinstance(c, str):
            yield c
            return
        choices = [CompletionChoice(index=i, text=c.texts[i] if generated else "", finish_reason=c.finish_reasons[i],
                                    logprobs=_openai_logprobs(_positions(c.logprobs[i] or [], req.logprobs))
                                    if req.logprobs is not None and c.logprobs and generated else None)
                   for i in range(len(c.texts)) if (c.texts[i] and generated) or c.finish_reasons[i]]
        if choices:
            yield event(choices)
    if req.include_usage:
        yield event([], Usage.of(totals.prompt, totals.completion))
    yield "[DONE]"


def _positions(entries: list[dict], top: int) -> list[tuple[str, float | None, dict | None]]:
    """vLLM's logprobs (the position's own token first, then alternatives by rank) as (token text, its logprob, the
    top `top` and itself by text)."""
    positions = []
    for entry in entries:
        own, *others = entry.values()
        alternatives = {lp["decoded_token"]: lp["logprob"] for lp in others if lp["rank"] <= top}
        positions.append((own["decoded_token"], own["logprob"], {own["decoded_token"]: own["logprob"], **alternatives}))
    return positions


def _prompt_positions(ids: list[int] | None, scored: list[dict | None] | None, tokenizer, req) -> list:
    """The prompt's positions for an echo with logprobs: its first token has no logprob (OpenAI's null)."""
    if not (req.echo and req.logprobs is not None) or scored is None:
        return []
    return [(tokenizer.decode([ids[0]]), None, None)] + _positions(scored[1:], req.logprobs)


def _openai_logprobs(positions: list[tuple[str, float | None, dict | None]]) -> dict:
    """OpenAI's completion logprobs: tokens, their logprobs, the top alternatives, and each token's offset in the
    answer's text."""
    offsets, offset = [], 0
    for text, _, _ in positions:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [p[0] for p in positions], "token_logprobs": [p[1] for p in positions],
            "top_logprobs": [p[2] for p in positions], "text_offset": offsets}
