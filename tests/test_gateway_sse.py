"""The gateway's one SSE framing (backend/gateway/sse.py) over real HTTP: an endpoint's events as it made them, an
error met after the 200 as in-band events (chat's error body; the Responses API's `error` event and then its
response.failed), and the end marker only on a stream that finished."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from backend.gateway.errors import INTERNAL_ERROR
from backend.gateway.sse import event_stream, typed_event_stream


async def _events(fail: bool, make, pause_s: float = 0.0):
    yield make({"type": "first"})
    await asyncio.sleep(pause_s)
    if fail:
        raise RuntimeError("the engine went away")
    yield make({"type": "second"})


def _app() -> Starlette:
    async def chunks(request):
        pause_s = float(request.query_params.get("pause", 0))
        return event_stream(_events(request.query_params.get("fail") == "1", json.dumps, pause_s))

    async def typed(request):
        return typed_event_stream(lambda event: _events(request.query_params.get("fail") == "1", event),
                                  lambda error: [{"type": "response.failed", "message": error.message}])

    return Starlette(routes=[Route("/chunks", chunks), Route("/typed", typed)])


def _raw(path: str) -> str:
    transport = httpx.ASGITransport(app=_app())

    async def read():
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            response = await client.get(path)
            assert response.status_code == 200
            return response.text

    return asyncio.run(read())


def _read(path: str) -> list[tuple[str | None, str]]:
    events, name = [], None
    for line in _raw(path).splitlines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, line[len("data: "):]))
            name = None
    return events


@pytest.mark.parametrize("fail", [False, True], ids=["finished", "failed"])
def test_chat_and_completions_streams_end_in_done_or_an_error_body(fail):
    events = _read(f"/chunks?fail={int(fail)}")
    assert events[0] == (None, json.dumps({"type": "first"}))
    if fail:
        [(_, last)] = events[1:]
        assert json.loads(last) == {"error": {"message": INTERNAL_ERROR, "type": "internal_error",
                                              "param": None, "code": 500}}
    else:
        assert [data for _, data in events[1:]] == [json.dumps({"type": "second"}), "[DONE]"]


@pytest.mark.parametrize("fail", [False, True], ids=["finished", "failed"])
def test_responses_streams_are_named_numbered_and_fail_with_an_error_event(fail):
    events = _read(f"/typed?fail={int(fail)}")
    payloads = [json.loads(data) for _, data in events]
    assert [name for name, _ in events] == [p["type"] for p in payloads]  # each event named by its type
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    if fail:
        assert payloads[1:] == [{"type": "error", "code": "internal_error", "message": INTERNAL_ERROR,
                                 "param": None, "sequence_number": 1},
                                {"type": "response.failed", "message": INTERNAL_ERROR, "sequence_number": 2}]
    else:
        assert [p["type"] for p in payloads] == ["first", "second"]  # no [DONE]: the last event says it is done


@pytest.mark.parametrize("path", ["/chunks", "/typed"])
def test_events_are_framed_as_openai_frames_them(path):
    """LF line ends and a blank LF line after each event: a client that splits on "\n\n" alone (vLLM's benchmark
    client does) reads every event whole."""
    raw = _raw(path)
    assert "\r" not in raw and raw.endswith("\n\n")
    events = raw.removesuffix("\n\n").split("\n\n")
    assert [event.splitlines()[-1] for event in events] == [f"data: {data}" for _, data in _read(path)]


def test_no_keep_alive_comment_comes_between_events(monkeypatch):
    """OpenAI's and vLLM's servers send none, and clients written against them lose the event after one."""
    from sse_starlette.sse import EventSourceResponse

    monkeypatch.setattr(EventSourceResponse, "DEFAULT_PING_INTERVAL", 0.05)  # (sse-starlette's default: 15 s)
    raw = _raw("/chunks?pause=0.3")
    assert not any(line.startswith(":") for line in raw.splitlines()), raw
