"""POST /v1/completions: a text (or token-id) prompt, answered as OpenAI's text completion or its stream."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, Response

from backend.gateway.protocol import CompletionRequest
from backend.gateway.errors import ApiError
from backend.gateway.responses import CompletionChoice, CompletionResponse, Usage, chunk_json, completion_id, now
from backend.gateway.serving import Serving, Totals
from backend.gateway.sse import event_stream


async def answer(serving: Serving, req: CompletionRequest, started: float) -> Response:
    """One prompt's completion, or a batch's: prompt k's choices are indexed k * n + i, as OpenAI's."""
    constraint = req.constraint()  # (at most one: checked when the request was validated)
    rid = completion_id("cmpl")
    prompts = req.prompts
    if req.stream:
        if len(prompts) > 1:
            raise ApiError(400, "streaming a batch of prompts is not supported: send one prompt per request", param="prompt")
        prompt, ids = _prompt_text(serving, prompts[0])
        chunk, responses = await serving.start("completions", started, prompt, req.engine_parameters(constraint),
                                               True, rid, ids, req.model)
        return event_stream(_events(serving, req, rid, prompt, chunk, responses))
    try:
        async with asyncio.TaskGroup() as group:  # (one failing cancels the others, and its error is the answer)
            tasks = [group.create_task(_complete(serving, req, p, constraint, started,
                                                 rid if len(prompts) == 1 else f"{rid}-{k}"))
                     for k, p in enumerate(prompts)]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    answers = [t.result() for t in tasks]
    choices = [c.model_copy(update={"index": k * req.n + c.index}) for k, (cs, _, _) in enumerate(answers) for c in cs]
    usage = Usage.of(sum(u.prompt_tokens for _, u, _ in answers), sum(u.completion_tokens for _, u, _ in answers))
    transfer = answers[0][2] if len(answers) == 1 else None  # (a prefill's hand-over: one prompt)
    return JSONResponse(CompletionResponse(id=rid, model=req.model, choices=choices, usage=usage,
                                           kv_transfer_params=transfer).model_dump())


def _prompt_text(serving: Serving, prompt: str | list[int]) -> tuple[str, list[int] | None]:
    """(the prompt's text, its token ids when it was given as ids): ids go to the engine as they are, their text is
    only for echo."""
    return (prompt, None) if isinstance(prompt, str) else (serving.tokenizer.decode(prompt), prompt)


async def _complete(serving: Serving, req: CompletionRequest, prompt: str | list[int], constraint, started: float,
                    rid: str) -> tuple[list[CompletionChoice], Usage, dict | None]:
    """One prompt's choices (indexed from 0), usage, and kv_transfer_params (a prefill's, on a kv_producer)."""
    prompt, ids = _prompt_text(serving, prompt)
    chunk, responses = await serving.start("completions", started, prompt, req.engine_parameters(constraint),
                                           False, rid, ids, req.model)
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
                                        finish_reason=_finish_reason(whole.reasons[i], generated), logprobs=logprobs,
                                        prompt_logprobs=_trimmed(whole.prompt_logprobs, req.prompt_logprobs)))
    return choices, Usage.of(whole.num_input_tokens, sum(whole.counts) if generated else 0), whole.kv_transfer_params


async def _events(serving: Serving, req: CompletionRequest, rid: str, prompt: str, chunk,
                  responses) -> AsyncIterator[str]:
    created = now()

    def event(choices, usage=None) -> str:
        return chunk_json(CompletionResponse(id=rid, created=created, model=req.model, choices=choices, usage=usage))

    # vLLM's prompt_logprobs extra comes with the first event (they come with the first response)
    vllm_prompt_logprobs = _trimmed(chunk.prompt_logprobs, req.prompt_logprobs)
    offsets = [0] * req.n  # each choice's text so far: where its next token's text_offset starts
    if req.echo:  # the prompt first, with its logprobs when asked
        positions = _prompt_positions(chunk.prompt_token_ids, chunk.prompt_logprobs, serving.tokenizer, req)
        yield event([CompletionChoice(index=i, text=prompt, logprobs=_openai_logprobs(positions) if positions else None,
                                      prompt_logprobs=vllm_prompt_logprobs) for i in range(req.n)])
        offsets, vllm_prompt_logprobs = [len(prompt)] * req.n, None
    generated = req.max_tokens != 0  # (0: the one token the engine sampled is not part of the answer)
    totals = Totals()
    async for c in serving.relay(chunk, responses, totals):
        choices = []
        for i in range(len(c.texts)):
            if not ((c.texts[i] and generated) or c.finish_reasons[i]):
                continue
            logprobs = None
            if req.logprobs is not None and generated and c.logprobs and c.logprobs[i]:
                logprobs = _openai_logprobs(_positions(c.logprobs[i], req.logprobs), offsets[i])
            offsets[i] += len(c.texts[i])
            choices.append(CompletionChoice(index=i, text=c.texts[i] if generated else "", logprobs=logprobs,
                                            finish_reason=_finish_reason(c.finish_reasons[i], generated),
                                            prompt_logprobs=vllm_prompt_logprobs))
        if choices:
            vllm_prompt_logprobs = None
            yield event(choices)
    if req.include_usage:
        yield event([], Usage.of(totals.prompt, totals.completion if generated else 0))


def _finish_reason(reason: str | None, generated: bool) -> str | None:
    """The engine's reason, or "length" for an answer that asked for no tokens (max_tokens 0: the one the engine
    sampled, whatever ended it, is not in the answer)."""
    return reason if generated or reason is None else "length"


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


def _trimmed(scored: list[dict | None] | None, top: int | None) -> list[dict | None] | None:
    """vLLM's prompt logprobs with the `top` alternatives asked for (the engine may have computed more, for echo), or
    None where they were not asked for."""
    if top is None or scored is None:
        return None
    return [None if entry is None else {t: lp for j, (t, lp) in enumerate(entry.items()) if j == 0 or lp["rank"] <= top}
            for entry in scored]


def _openai_logprobs(positions: list[tuple[str, float | None, dict | None]], offset: int = 0) -> dict:
    """OpenAI's completion logprobs: tokens, their logprobs, the top alternatives, and each token's offset in the
    answer's text (which, streamed, starts at `offset`)."""
    offsets = []
    for text, _, _ in positions:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [p[0] for p in positions], "token_logprobs": [p[1] for p in positions],
            "top_logprobs": [p[2] for p in positions], "text_offset": offsets}
