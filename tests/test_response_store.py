"""The gateway's store of Responses-API answers: bounded in count and bytes, and each seen only by its caller."""
from __future__ import annotations

import json

from backend.gateway.response_store import ResponseStore


def _response(rid: str, text: str = "") -> dict:
    return {"id": rid, "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}


def test_a_caller_sees_only_its_own_responses():
    store = ResponseStore()
    alice, bob = store.of("Bearer alice"), store.of("Bearer bob")
    alice.keep(_response("resp_a"), [{"role": "user", "content": "hi"}])
    assert alice.get("resp_a").messages == [{"role": "user", "content": "hi"}]
    assert bob.get("resp_a") is None and store.of(None).get("resp_a") is None
    assert not bob.forget("resp_a") and alice.get("resp_a") is not None  # another's delete is a not-found
    assert alice.forget("resp_a") and alice.get("resp_a") is None and store.bytes == 0


def test_the_oldest_go_when_the_bytes_or_the_count_run_over():
    one = len(json.dumps([_response("resp_0", "x" * 1000), []]))
    store = ResponseStore(max_responses=10, max_bytes=3 * one)
    caller = store.of("Bearer k")
    for i in range(5):
        caller.keep(_response(f"resp_{i}", "x" * 1000), [])
    assert [caller.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.bytes == 3 * one
    caller.keep(_response("resp_big", "x" * 4 * one), [])  # larger than the whole budget: answered, never kept
    assert caller.get("resp_big") is None and store.bytes == 3 * one
    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.of("").keep(_response(f"resp_{i}"), [])
    assert [store.of("").get(f"resp_{i}") is not None for i in range(3)] == [False, True, True]
