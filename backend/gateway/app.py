"""OpenAI-compatible HTTP API (starlette + sse-starlette) in front of Triton: the routes, and what every
route does before its endpoint's module answers (the API key, the body's size and JSON, validation).

Each request becomes one Triton gRPC stream (backend/gateway/serving.py). A client that
disconnects, streaming or not, cancels the Triton stream, and with it the engine request and its
KV blocks. The endpoints: serving_chat.py, serving_completions.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backend.gateway import serving_chat, serving_completions
from backend.gateway.client import TritonClient
from backend.gateway.protocol import ChatCompletionRequest, CompletionRequest
from backend.gateway.reasoning import REASONING_PARSERS, reasoning_parser
from backend.gateway.responses import ModelCard, ModelList, error_body
from backend.gateway.serving import ApiError, Serving, triton_errors
from backend.gateway.tools import TOOL_CALL_PARSERS, tool_call_parser
from backend.models.registry import DEFAULT_MODEL


@dataclass
class GatewaySettings:
    triton_url: str = "localhost:8001"
    triton_model: str = "llm"
    served_model_name: str = DEFAULT_MODEL
    tokenizer: str = DEFAULT_MODEL
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    max_body_bytes: int = 1 << 20
    tool_call_parser: str = "auto"  # "auto" (read off the chat template) or one of TOOL_CALL_PARSERS
    reasoning_parser: str = "auto"  # "auto" (read off the tokenizer), "none" or one of REASONING_PARSERS


def _is_union_branch(loc_part) -> bool:
    """pydantic puts the tried type of a union into an error's location ("stop.str"): not a field name."""
    return isinstance(loc_part, str) and (
        loc_part in ("str", "int", "float", "bool", "list", "dict", "none") or "[" in loc_part or "-" in loc_part
    )


async def until_disconnected(request: Request, work):
    """Await `work` (a coroutine), cancelling it if the client disconnects first (ClientDisconnect then).

    Only once the body has been read: the watcher takes the connection's next ASGI message.
    """
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # this handler itself is cancelled (the server shutting down): so is the work
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    if not watcher.cancelled():
        watcher.exception()  # retrieved: a failed receive counts as a disconnect
    task.cancel()  # the client left first
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnect()


def _load_tokenizer(name_or_path: str):
    from backend.engine.tokenizer import load_template_tokenizer

    return load_template_tokenizer(name_or_path)


def create_app(settings: GatewaySettings, tokenizer=None) -> Starlette:
    if settings.tool_call_parser not in ("auto", *TOOL_CALL_PARSERS):
        raise ValueError(f"tool_call_parser must be auto or one of {', '.join(TOOL_CALL_PARSERS)}")
    if settings.reasoning_parser not in ("auto", "none", *REASONING_PARSERS):
        raise ValueError(f"reasoning_parser must be auto, none or one of {', '.join(REASONING_PARSERS)}")
    tokenizer = tokenizer or _load_tokenizer(settings.tokenizer)
    serving = Serving(tokenizer, tool_call_parser=tool_call_parser(tokenizer, settings.tool_call_parser),
                      reasoning_parser=reasoning_parser(tokenizer, settings.reasoning_parser))
    metrics = serving.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app):
        serving.triton = TritonClient(settings.triton_url, settings.triton_model)
        yield
        await serving.triton.close()

    def authorize(request: Request) -> None:
        if settings.api_key is not None and request.headers.get("authorization", "") != f"Bearer {settings.api_key}":
            raise ApiError(401, "invalid or missing API key", "authentication_error")

    async def read_body(request: Request) -> dict:
        authorize(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise ApiError(413, f"request body over {settings.max_body_bytes} bytes")
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > settings.max_body_bytes:
                raise ApiError(413, f"request body over {settings.max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    def validate(model_cls, data: dict):
        try:
            parsed = model_cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"] if not _is_union_branch(p))
            message = first["msg"].removeprefix("Value error, ")
            if first["type"] == "extra_forbidden":
                message = "unknown field (this server refuses what it would not honour)"
            raise ApiError(400, f"{param}: {message}" if param else message, param=param or None) from None
        if parsed.model != settings.served_model_name:
            raise ApiError(404, f"model {parsed.model!r} does not exist; this server serves "
                                f"{settings.served_model_name!r}", "not_found_error", "model")
        return parsed

    async def handle(endpoint: str, request: Request, work) -> Response:
        start = time.perf_counter()
        try:
            response = await work(request, start)
        except ApiError as e:
            response = e.response()
        except ClientDisconnect:
            response = Response(status_code=499)
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        if not isinstance(response, EventSourceResponse):
            metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    async def chat(request: Request, start: float) -> Response:
        req = validate(ChatCompletionRequest, await read_body(request))
        prompt, constraint = serving_chat.prepare(serving, req)
        return await until_disconnected(request, serving_chat.answer(serving, req, prompt, constraint, start))

    async def completions(request: Request, start: float) -> Response:
        req = validate(CompletionRequest, await read_body(request))
        return await until_disconnected(request, serving_completions.answer(serving, req, start))

    async def models(request: Request) -> Response:
        return JSONResponse(ModelList(data=[ModelCard(id=settings.served_model_name)]).model_dump())

    async def health(request: Request) -> Response:
        if await serving.triton.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(f"Triton model {settings.triton_model!r} at {settings.triton_url} is not ready",
                                       "service_unavailable", 503), status_code=503)

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def guarded(route):
        """The route behind the API key (every route but /health has one, when a key is set)."""
        async def endpoint(request: Request) -> Response:
            try:
                authorize(request)
            except ApiError as e:
                return e.response()
            return await route(request)
        return endpoint

    async def profile(request: Request, start: float) -> Response:
        """POST /start_profile, /stop_profile (vLLM's admin routes): a capture in the engine, when it was
        served with the profile_dir engine argument. Always behind the API key, when there is one."""
        authorize(request)
        with triton_errors():
            return JSONResponse(await serving.triton.admin(request.url.path.strip("/")))

    def counted(endpoint: str, work):
        async def route(request: Request) -> Response:
            return await handle(endpoint, request, work)
        return route

    routes = [
        Route("/v1/chat/completions", counted("chat", chat), methods=["POST"]),
        Route("/v1/completions", counted("completions", completions), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", guarded(prometheus), methods=["GET"]),
        Route("/start_profile", counted("profile", profile), methods=["POST"]),
        Route("/stop_profile", counted("profile", profile), methods=["POST"]),
    ]
    middleware = []
    if settings.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                                     allow_headers=["*"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.settings = settings
    return app
