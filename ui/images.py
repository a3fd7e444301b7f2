"""Images in the chat: an attached picture becomes a user message of its own, shown by the chatbot from a file the UI
serves, and carrying the picture itself as a data: URL (the `image` key, which the chatbot ignores), which is what
the model is sent (ui/messages.py) and what the browser keeps.

How conversations with pictures fit in the browser's storage (localStorage holds about 5 MB a site): each picture
is kept as a JPEG of at most MAX_SIDE pixels a side (tens of KB; the vision models resize far smaller anyway, and
the model sees the same picture in every later turn), and the store's pictures together stay under
STORED_IMAGE_CHARS: past it, the pictures of the conversations written to longest ago are dropped, each leaving a
note in its place.
"""
from __future__ import annotations

import base64
import copy
import hashlib
import io
import tempfile
from pathlib import Path

MAX_SIDE = 768
JPEG_QUALITY = 85
STORED_IMAGE_CHARS = 3_000_000
DROPPED = "🖼️ (picture not kept: the browser's storage holds only the latest conversations' pictures)"
UNREADABLE = "🖼️ (a picture the browser's storage held could not be read)"
JPEG_URL = "data:image/jpeg;base64,"
MAX_STORED_CHARS = 4 * 1024 * 1024  # (a picture the UI made is far smaller)
# the files the chatbot shows the pictures from (written again from the data URL after a restart of the UI)
SHOWN = Path(tempfile.gettempdir()) / "npu-llm-ui-images"


def is_image(message: dict) -> bool:
    return "image" in message


def attached(path: str) -> dict:
    """The user message of a picture the user attached: downsized, as a JPEG data URL. ValueError: not a picture."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as picture:
            picture = picture.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{Path(path).name} is not a picture this UI can read ({e})") from None
    picture.thumbnail((MAX_SIDE, MAX_SIDE))
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return shown({"role": "user", "content": "", "image": JPEG_URL + base64.b64encode(buffer.getvalue()).decode()})


def shown(message: dict) -> dict:
    """A picture's message with its file in place for the chatbot (written from its data URL when missing); one the
    UI did not make (the browser's storage is the browser's to change) becomes a note."""
    image = message["image"]
    try:
        if not isinstance(image, str) or not image.startswith(JPEG_URL) or len(image) > MAX_STORED_CHARS:
            raise ValueError
        data = base64.b64decode(image[len(JPEG_URL):], validate=True)
    except ValueError:
        return {"role": "user", "content": UNREADABLE, "metadata": {"log": "note"}}
    path = SHOWN / f"{hashlib.sha256(data).hexdigest()[:32]}.jpg"
    if not path.is_file():
        SHOWN.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return {**message, "content": {"path": str(path), "mime_type": "image/jpeg"}}


def shown_again(store: dict) -> dict:
    """The store as the browser gave it back, each picture's file in place again."""
    store = copy.deepcopy(store)
    for conversation in store["conversations"]:
        conversation["messages"] = [shown(m) if is_image(m) else m for m in conversation["messages"]]
    return store


def within_budget(store: dict) -> dict:
    """The store with its pictures under STORED_IMAGE_CHARS: the newest conversations' kept, older ones' dropped."""
    total = 0
    for conversation in sorted(store["conversations"], key=lambda c: c["updated"], reverse=True):
        for i in reversed(range(len(conversation["messages"]))):  # (the latest pictures first)
            message = conversation["messages"][i]
            if is_image(message):
                total += len(message["image"])
                if total > STORED_IMAGE_CHARS:
                    conversation["messages"][i] = {"role": "user", "content": DROPPED, "metadata": {"log": "note"}}
    return store
