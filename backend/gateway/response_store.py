"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in this gateway process's memory, the
newest MAX_RESPONSES within MAX_BYTES of JSON, each for TTL_S seconds, and each only for the credentials that made it.
A restart forgets them, and another gateway process does not see them: behind a load balancer, pin a conversation to
one gateway (or send the whole input each time)."""
from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 1000
# Their JSON in all (responses and the conversations through them): long conversations, and metadata within OpenAI's
# limits, cannot run the gateway out of memory. One larger than this is answered but not kept.
MAX_BYTES = 256 << 20
TTL_S = 3600.0


@dataclass
class Kept:
    response: dict  # the response as it was answered
    messages: list[dict]  # the conversation through it, as chat messages (its instructions not included, as OpenAI's)
    owner: str  # a hash of the credentials it was made with
    size: int  # its JSON's bytes
    expires: float


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, ttl_s: float = TTL_S, max_bytes: int = MAX_BYTES):
        self.max_responses, self.ttl_s, self.max_bytes = max_responses, ttl_s, max_bytes
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self.bytes = 0

    def of(self, authorization: str | None) -> CallersResponses:
        """The responses a caller with this Authorization header sees (all callers alike without one)."""
        return CallersResponses(self, hashlib.sha256((authorization or "").encode()).hexdigest())

    def keep(self, response: dict, messages: list[dict], owner: str) -> None:
        size = len(json.dumps([response, messages]))
        if size > self.max_bytes:
            return
        self._kept[response["id"]] = Kept(response, messages, owner, size, time.monotonic() + self.ttl_s)
        self.bytes += size
        while len(self._kept) > self.max_responses or self.bytes > self.max_bytes:
            self.bytes -= self._kept.popitem(last=False)[1].size  # the oldest

    def get(self, response_id: str, owner: str) -> Kept | None:
        kept = self._kept.get(response_id)
        if kept is not None and kept.expires < time.monotonic():
            self._drop(response_id)
            return None
        return kept if kept is not None and kept.owner == owner else None

    def forget(self, response_id: str, owner: str) -> bool:
        """Whether it was kept for this owner (and now is not)."""
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        self.bytes -= self._kept.pop(response_id).size


@dataclass
class CallersResponses:
    """One caller's view of the store: another's responses are as unknown to it as ones never kept."""

    store: ResponseStore
    owner: str

    def keep(self, response: dict, messages: list[dict]) -> None:
        self.store.keep(response, messages, self.owner)

    def get(self, response_id: str) -> Kept | None:
        return self.store.get(response_id, self.owner)

    def forget(self, response_id: str) -> bool:
        return self.store.forget(response_id, self.owner)
