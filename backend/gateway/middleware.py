"""What the gateway does around every route (pure ASGI, so a stream passes through untouched): the API key, and the
request count and latency of each endpoint, measured to the response's last byte, streamed or not."""
from __future__ import annotations

import secrets
import time

from starlette.routing import get_route_path

from backend.gateway.errors import ApiError

OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe needs no key


class ApiKeyMiddleware:
    """Every route but OPEN_PATHS needs `Authorization: Bearer <key>`, when a key is set (vLLM's --api-key)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and get_route_path(scope) not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = ApiError(401, "invalid or missing API key", "authentication_error").response()
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class RequestMetricsMiddleware:
    """Counts each request by endpoint and status, and times it until the app is done with it (a stream's end, or
    the client leaving). `request.state.started` is when it came, for the endpoints' time to first token."""

    def __init__(self, app, metrics, endpoints: dict[str, str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        scope.setdefault("state", {})["started"] = started
        endpoint = self.endpoints.get(get_route_path(scope))
        if endpoint is None:
            return await self.app(scope, receive, send)
        status = None

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.requests.labels(endpoint, str(status or 500)).inc()  # (none: it failed before answering)
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
