"""Images as they arrive (bytes, base64 text, data: URLs) checked and decoded into PIL images: the one place where
a client's bytes become pixels, for the gateway and for Triton's `image` input alike. A bad image is an ImageError
(a ValueError) naming where it came from; nothing here imports torch.

What one request may cost is bounded before anything is decoded, from the images' headers: at most
MAX_IMAGE_PIXELS an image, MAX_REQUEST_PIXELS all of a request's together (a few KB of PNG can declare a picture of
billions of pixels; the vision models resize every image to far fewer anyway)."""
from __future__ import annotations

import base64
import binascii
import io

MAX_IMAGE_PIXELS = 64 * 1024 * 1024
MAX_REQUEST_PIXELS = 2 * MAX_IMAGE_PIXELS


class ImageError(ValueError):
    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where = where


def decode_images(encoded: list[bytes], wheres: list[str]) -> list:
    """PIL images in RGB of encoded image bytes (PNG, JPEG, WebP, GIF's first frame, ...), each named by its `where`;
    an ImageError for the first that is not an image, is truncated, or has too many pixels, alone or with the rest."""
    return [_decoded(image, where) for image, where in zip(_within_budget(encoded, wheres), wheres)]


def check_images(encoded: list[bytes], wheres: list[str]) -> None:
    """What decode_images checks, each image decoded and let go before the next (the gateway keeps the bytes)."""
    for image, where in zip(_within_budget(encoded, wheres), wheres):
        _decoded(image, where)


def _within_budget(encoded: list[bytes], wheres: list[str]) -> list:
    """The images opened (their headers read), each and all together within the pixel budgets."""
    opened = [_opened(data, where) for data, where in zip(encoded, wheres)]
    total = sum(image.size[0] * image.size[1] for image in opened)
    if total > MAX_REQUEST_PIXELS:
        raise ImageError(wheres[-1], f"the request's images hold {total} pixels together; at most {MAX_REQUEST_PIXELS}")
    return opened


def _opened(data: bytes, where: str):
    """The image's header read (no pixels decoded yet), its size checked."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(where, f"not an image (its {len(data)} bytes are no format PIL reads)") from None
    except (Image.DecompressionBombError, OSError, SyntaxError, ValueError) as e:  # (a header PIL refuses)
        raise ImageError(where, f"the image cannot be read ({e})") from None
    width, height = image.size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise ImageError(where, f"an image of {width} x {height} pixels; at most {MAX_IMAGE_PIXELS} pixels")
    return image


def _decoded(image, where: str):
    from PIL import Image

    try:
        image.load()  # (the header alone was read: a truncated or corrupt body fails here)
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(where, f"the image cannot be decoded ({e})") from None


def base64_bytes(text: str | bytes, where: str) -> bytes:
    """Base64 text's bytes (line breaks and spaces allowed, as vllm_backend's decoding allows them)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", errors="replace")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(where, "not valid base64") from None


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes a `data:image/...;base64,...` URL carries."""
    header, comma, payload = url.partition(",")
    header = header.lower()
    if not comma or not header.startswith("data:image/") or not header.endswith(";base64"):
        raise ImageError(where, "a data URL must be data:image/<format>;base64,<data>")
    try:
        return base64_bytes(payload, where)
    except ImageError:
        raise ImageError(where, "the data URL's payload is not valid base64") from None
