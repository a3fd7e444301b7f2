"""OpenAI-compatible HTTP API (starlette + sse-starlette) in front of Triton: the settings, and the app put together
from its routes (backend/gateway/routes.py), its middleware (the API key, request metrics, CORS) and the handlers
that turn a route's errors into OpenAI's error responses (backend/gateway/errors.py builds them all).

Each request becomes one Triton gRPC stream (backend/gateway/serving.py). A client that disconnects, streaming or
not, cancels the Triton stream, and with it the engine request and its KV blocks. The endpoints: serving_chat.py,
serving_completions.py, serving_responses.py (OpenAI's Responses API), serving_tokenize.py (vLLM's /tokenize and
/detokenize).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from backend.gateway.client import TritonClient
from backend.gateway.errors import INTERNAL_ERROR, ApiError
from backend.gateway.media import MediaLoader, takes_images
from backend.gateway.middleware import ApiKeyMiddleware, RequestMetricsMiddleware
from backend.gateway.proxy import DisaggregatedClient
from backend.gateway.reasoning import REASONING_PARSERS, reasoning_parser
from backend.gateway.response_store import ResponseStore
from backend.gateway.routes import COUNTED, ROUTES, RUNTIME_LORA_ROUTES
from backend.gateway.serving import Serving
from backend.gateway.serving_models import runtime_lora_updating
from backend.gateway.tools import TOOL_CALL_PARSERS, tool_call_parser
from backend.models.registry import DEFAULT_MODEL, resolve_model


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
    # disaggregated prefill (backend/gateway/proxy.py): with both, the gateway is the proxy of these Tritons'
    # gRPC URLs and triton_url is unused
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    allow_kv_transfer_params: bool = False  # a client's kv_transfer_params reach the engine (a proxy in front)
    # vision-language models: where image URLs may point (backend/gateway/media.py)
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] = field(default_factory=list)


def _load_tokenizer(name_or_path: str):
    from backend.engine.tokenizer import load_template_tokenizer

    return load_template_tokenizer(name_or_path)


async def _api_error(request: Request, error: ApiError) -> Response:
    return error.response()


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Starlette's own 404 and 405, in OpenAI's error shape like every other error."""
    type_ = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    response = ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", type_).response()
    response.headers.update(error.headers or {})  # (405's Allow)
    return response


async def _unexpected(request: Request, error: Exception) -> Response:
    """A bug, not a bad request: still OpenAI's shape, naming nothing of it (the traceback goes to the log, as
    Starlette's own does)."""
    return ApiError(500, INTERNAL_ERROR, "internal_error").response()


async def _client_left(request: Request, error: ClientDisconnect) -> Response:
    return Response(status_code=499)  # (nginx's "client closed request": only the request metrics see it)


def create_app(settings: GatewaySettings, tokenizer=None) -> Starlette:
    if settings.tool_call_parser not in ("auto", *TOOL_CALL_PARSERS):
        raise ValueError(f"tool_call_parser must be auto or one of {', '.join(TOOL_CALL_PARSERS)}")
    if settings.reasoning_parser not in ("auto", "none", *REASONING_PARSERS):
        raise ValueError(f"reasoning_parser must be auto, none or one of {', '.join(REASONING_PARSERS)}")
    if bool(settings.prefill_urls) != bool(settings.decode_urls):
        raise ValueError("a disaggregated gateway needs both --prefill and --decode Triton URLs")
    tokenizer = tokenizer or _load_tokenizer(settings.tokenizer)
    serving = Serving(tokenizer, tool_call_parser=tool_call_parser(tokenizer, settings.tool_call_parser),
                      reasoning_parser=reasoning_parser(tokenizer, settings.reasoning_parser),
                      allow_kv_transfer_params=settings.allow_kv_transfer_params,
                      served_model_name=settings.served_model_name,
                      media=MediaLoader(takes_images(resolve_model(settings.tokenizer)),
                                        settings.allowed_local_media_path, settings.allowed_media_domains))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # (grpc.aio: made on the app's loop)
        if settings.decode_urls:
            serving.triton = DisaggregatedClient(settings.prefill_urls, settings.decode_urls, settings.triton_model)
        else:
            serving.triton = TritonClient(settings.triton_url, settings.triton_model)
        yield
        await serving.triton.close()

    # outermost first: CORS answers a preflight before the key is asked for; a refused key is still counted
    middleware = []
    if settings.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                                     allow_headers=["*"]))
    middleware.append(Middleware(RequestMetricsMiddleware, metrics=serving.metrics, endpoints=COUNTED))
    if settings.api_key is not None:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=settings.api_key))
    routes = ROUTES + (RUNTIME_LORA_ROUTES if runtime_lora_updating() else [])
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                        ClientDisconnect: _client_left, Exception: _unexpected})
    app.state.settings, app.state.serving, app.state.response_store = settings, serving, ResponseStore()
    return app
