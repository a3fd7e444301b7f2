"""Images as they arrive (bytes, base64 text, data: URLs) checked and decoded into PIL images: the one place where
a client's bytes become pixels, for the gateway and for Triton's `image` input alike. A bad image is a ValueError
naming where it came from; nothing here imports torch."""
from __future__ import annotations

import base64
import binascii
import io

# Images with more pixels than this are refused before they are decoded (PIL's own decompression-bomb limit is
# about 89 million; the vision models resize every image to far fewer pixels anyway).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


def decode_image(data: bytes, where: str):
    """A PIL image in RGB of encoded image bytes (PNG, JPEG, WebP, GIF's first frame, ...), or a ValueError naming
    `where` and what is wrong: not an image, truncated, or too many pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ValueError(f"{where}: not an image (its {len(data)} bytes are no format PIL reads)") from None
    width, height = image.size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{where}: an image of {width} x {height} pixels; at most {MAX_IMAGE_PIXELS} pixels")
    try:
        image.load()  # (the header alone was read: a truncated or corrupt body fails here)
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: the image cannot be decoded ({e})") from None


def decode_base64_image(text: str | bytes, where: str):
    """A base64-encoded image (Triton's `image` input, vllm_backend's contract), decoded."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: not valid base64") from None
    return decode_image(data, where)


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes a `data:image/...;base64,...` URL carries."""
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise ValueError(f"{where}: a data URL must be data:image/<format>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data URL's payload is not valid base64") from None
