"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in this gateway process's memory, the
newest MAX_RESPONSES, each for TTL_S seconds. A restart forgets them, and another gateway process does not see them:
behind a load balancer, pin a conversation to one gateway (or send the whole input each time)."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 1000
TTL_S = 3600.0


@dataclass
class Kept:
    response: dict  # the response as it was answered
    messages: list[dict]  # the conversation through it, as chat messages (its instructions not included, as OpenAI's)
    expires: float


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, ttl_s: float = TTL_S):
        self.max_responses, self.ttl_s = max_responses, ttl_s
        self._kept: OrderedDict[str, Kept] = OrderedDict()

    def keep(self, response: dict, messages: list[dict]) -> None:
        self._kept[response["id"]] = Kept(response, messages, time.monotonic() + self.ttl_s)
        while len(self._kept) > self.max_responses:
            self._kept.popitem(last=False)  # the oldest

    def get(self, response_id: str) -> Kept | None:
        kept = self._kept.get(response_id)
        if kept is not None and kept.expires < time.monotonic():
            del self._kept[response_id]
            return None
        return kept

    def forget(self, response_id: str) -> bool:
        """Whether it was kept (and now is not)."""
        return self._kept.pop(response_id, None) is not None
