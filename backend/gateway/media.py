"""The images of a chat request, each fetched and decoded before anything reaches Triton, as vLLM's media connector
takes them: a data: URL always; a file:// URL only under --allowed-local-media-path; an http(s) URL only from a host
in --allowed-media-domains (unlike vLLM, no host is allowed by default: the gateway fetching whatever a client names
is a door into the network behind it), without following redirects, within a timeout and a size cap. Each failure is
a 400 naming the message part it came from. Triton gets each image's own bytes, base64-encoded (its `image` input)."""
from __future__ import annotations

import asyncio
import base64
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from backend.gateway.errors import ApiError
from backend.gateway.protocol import ChatMessage, ImageUrlPart
from backend.triton.media import ImageError, check_images, data_url_bytes

# vLLM's VLLM_IMAGE_FETCH_TIMEOUT (seconds), read the same way
FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"
DEFAULT_FETCH_TIMEOUT_S = 5.0
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024


def takes_images(model_folder: Path) -> bool:
    """Whether the model is a vision-language model (its config.json has a vision_config)."""
    config = model_folder / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


@dataclass
class MediaLoader:
    takes_images: bool = False
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] = field(default_factory=list)
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    timeout_s: float = field(default_factory=lambda: float(os.environ.get(FETCH_TIMEOUT_ENV, DEFAULT_FETCH_TIMEOUT_S)))

    def __post_init__(self):
        if self.allowed_local_media_path is not None:
            folder = Path(self.allowed_local_media_path)
            if not folder.is_dir():
                raise ValueError(f"--allowed-local-media-path {folder}: not a directory")
            self.allowed_local_media_path = str(folder.resolve())

    async def images_of(self, messages: list[ChatMessage]) -> list[str]:
        """The conversation's images in order, base64-encoded, each checked to decode; an ApiError (400) naming the
        part that fails."""
        parts = [(f"messages[{i}].content[{j}]", part) for i, message in enumerate(messages)
                 if not isinstance(message.content, (str, type(None)))
                 for j, part in enumerate(message.content) if isinstance(part, ImageUrlPart)]
        if parts and not self.takes_images:
            raise ApiError(400, "this model takes text only: send the conversation without image_url parts",
                           param=parts[0][0])
        wheres = [where for where, _ in parts]
        try:
            encoded = [await self._bytes(part.image_url.url, where) for where, part in parts]
            await asyncio.to_thread(check_images, encoded, wheres)  # (each must decode; Triton decodes its own)
        except ImageError as e:
            raise ApiError(400, str(e), param=e.where) from None
        return [base64.b64encode(data).decode() for data in encoded]

    async def _bytes(self, url: str, where: str) -> bytes:
        scheme = urlparse(url).scheme.lower()
        if scheme == "data":
            return data_url_bytes(url, where)
        if scheme == "file":
            return await asyncio.to_thread(self._local_file, url, where)
        if scheme in ("http", "https"):
            return await self._fetch(url, where)
        raise ImageError(where, "the image URL must be a data:, file:// or http(s):// URL")

    def _local_file(self, url: str, where: str) -> bytes:
        if self.allowed_local_media_path is None:
            raise ImageError(where, "file:// images need the gateway's --allowed-local-media-path")
        named = unquote(urlparse(url).path)
        path = Path(named).resolve()  # (links and .. resolved before the check; the message names what was asked)
        if Path(self.allowed_local_media_path) not in path.parents:
            raise ImageError(where, f"{named} is not under --allowed-local-media-path")
        if not path.is_file():
            raise ImageError(where, f"no file {named}")
        if path.stat().st_size > self.max_image_bytes:
            raise ImageError(where, f"{named} is larger than {self.max_image_bytes} bytes")
        return path.read_bytes()

    async def _fetch(self, url: str, where: str) -> bytes:
        import httpx

        host = (urlparse(url).hostname or "").lower()  # (the host alone, as vLLM matches it: any port)
        if host not in {domain.lower() for domain in self.allowed_media_domains}:
            raise ImageError(where, f"images from {host or url!r} are not fetched: the gateway fetches http(s) images "
                                    "only from the hosts of its --allowed-media-domains")
        try:  # (the whole fetch, not each read, within the timeout)
            return await asyncio.wait_for(self._download(url, where), self.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise ImageError(where, f"fetching {url} took longer than {self.timeout_s} s") from None
        except httpx.HTTPError as e:
            raise ImageError(where, f"fetching {url} failed ({e})") from None

    async def _download(self, url: str, where: str) -> bytes:
        import httpx

        async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise ImageError(where, f"fetching {url} answered HTTP {response.status_code}")
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > self.max_image_bytes:
                        raise ImageError(where, f"{url} is larger than {self.max_image_bytes} bytes")
                return bytes(data)
