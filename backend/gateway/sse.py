"""Server-sent events, framed in one place: each event as the endpoint made it, an error met after the 200 as one
last in-band event (the status is already sent), and the protocol's end marker. Chat and completions send bare data
events ending in [DONE]; the Responses API sends typed events (`typed_event_stream`)."""
from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable

from sse_starlette.sse import EventSourceResponse, ServerSentEvent

from backend.gateway.errors import ApiError

# Each line ends in LF, so each event in a blank line of LF, and no keep-alive comments: as OpenAI's and vLLM's
# servers send them. (The SSE spec allows CRLF and comments, sse-starlette's defaults, but clients written against
# those servers split events on "\n\n" only and do not expect a comment between events: vLLM's own benchmark client
# lost every event after a ping until two arrived in one read, and the usage with them.)
LINE_END = "\n"
NO_PINGS = 0


def chunk_error(error: ApiError) -> list[str]:
    """The chat and completions streams' error event: OpenAI's error body as the data."""
    return [json.dumps(error.body())]


def event_stream(events: AsyncIterator[str | ServerSentEvent], *,
                 error_events: Callable[[ApiError], list[str | ServerSentEvent]] = chunk_error,
                 done: str | None = "[DONE]") -> EventSourceResponse:
    """A streamed answer. `done` ends a stream that finished (chat and completions end with [DONE]; the Responses
    API's last event says so itself)."""
    async def framed():
        try:
            async for event in events:
                yield event
        except Exception as e:  # after the 200: tell the client in-band, then end the stream
            for event in error_events(ApiError.of(e)):
                yield event
            return
        if done is not None:
            yield done

    return EventSourceResponse(framed(), sep=LINE_END, ping=NO_PINGS)


def typed_event_stream(events: Callable[[Callable[[dict], ServerSentEvent]], AsyncIterator[ServerSentEvent]],
                       failed: Callable[[ApiError], list[dict]]) -> EventSourceResponse:
    """The Responses API's stream: `events(event)` makes its events with `event(payload)`, which names each by its
    type and numbers it (`sequence_number`, one sequence per stream). An error is an `error` event, then the
    `failed(error)` events (response.failed); the last event says the stream is done, so there is no end marker."""
    sequence = itertools.count()

    def event(payload: dict) -> ServerSentEvent:
        return ServerSentEvent(data=json.dumps({**payload, "sequence_number": next(sequence)}), event=payload["type"],
                               sep=LINE_END)

    def error_events(error: ApiError) -> list[ServerSentEvent]:
        return [event({"type": "error", "code": error.type, "message": error.message, "param": error.param}),
                *map(event, failed(error))]

    return event_stream(events(event), error_events=error_events, done=None)
