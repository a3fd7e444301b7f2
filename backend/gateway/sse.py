"""Server-sent events, framed in one place: each event as the endpoint made it, an error met after the 200 as one
last in-band event (the status is already sent), and the protocol's end marker. Chat and completions send bare data
events ending in [DONE]."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from sse_starlette.sse import EventSourceResponse, ServerSentEvent

from backend.gateway.errors import ApiError


def chunk_error(error: ApiError) -> str:
    """The chat and completions streams' error event: OpenAI's error body as the data."""
    return json.dumps(error.body())


def event_stream(events: AsyncIterator[str | ServerSentEvent], *,
                 error_event: Callable[[ApiError], str | ServerSentEvent] = chunk_error,
                 done: str | None = "[DONE]") -> EventSourceResponse:
    """A streamed answer. `done` ends a stream that finished (chat and completions end with [DONE])."""
    async def framed():
        try:
            async for event in events:
                yield event
        except Exception as e:  # after the 200: tell the client in-band, then end the stream
            yield error_event(ApiError.of(e))
            return
        if done is not None:
            yield done

    return EventSourceResponse(framed())

