"""A request's JSON body as its pydantic model, or the 4xx that names what is wrong with it: over the size limit,
not JSON, not an object, a field out of range (named, as `param`), a model this server does not serve (neither the
base model nor an adapter: backend/gateway/serving_models.py)."""
from __future__ import annotations

import json

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from backend.gateway.errors import ApiError
from backend.gateway.serving_models import check_model


async def parse(request: Request, model_cls: type[BaseModel]):
    settings = request.app.state.settings
    parsed = validate(model_cls, await read_json(request, settings.max_body_bytes))
    await check_model(request.app.state.serving, getattr(parsed, "model", None))
    return parsed


async def read_json(request: Request, max_bytes: int) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body over {max_bytes} bytes")
    body = b""
    async for part in request.stream():  # (a chunked body's size is only known by reading it)
        body += part
        if len(body) > max_bytes:
            raise ApiError(413, f"request body over {max_bytes} bytes")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def validate(model_cls: type[BaseModel], data: dict):
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not _is_union_branch(p))
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field (this server refuses what it would not honour)"
        raise ApiError(400, f"{param}: {message}" if param else message, param=param or None) from None


def _is_union_branch(loc_part) -> bool:
    """pydantic puts the tried type of a union into an error's location ("stop.str"): not a field name."""
    return isinstance(loc_part, str) and (
        loc_part in ("str", "int", "float", "bool", "list", "dict", "none") or "[" in loc_part or "-" in loc_part
    )
