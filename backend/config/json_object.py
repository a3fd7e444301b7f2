"""A JSON object read from text or a file, or a ValueError naming its source and what is wrong with it: what every
JSON a user hands us (request parameters, model.json's neighbours, an adapter's config) is read through."""
from __future__ import annotations

import json
from pathlib import Path


def json_object(raw: str | bytes, source: str) -> dict:
    try:
        values = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{source} is nested too deeply") from None
    if not isinstance(values, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(values).__name__}")
    return values


def json_object_file(path: Path, source: str) -> dict:
    """The file's JSON object (the caller has checked that the file is there)."""
    return json_object(path.read_bytes(), source)
