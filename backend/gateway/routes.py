"""The gateway's routes: thin handlers that read their state from `request.app.state` (the settings and the
Serving), parse the body (backend/gateway/request_body.py) and hand it to the endpoint's module. The API key and the
request metrics are middleware (backend/gateway/middleware.py); errors become responses in app.py's handlers."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from importlib.metadata import version as package_version

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backend.gateway import serving_chat, serving_completions, serving_models, serving_responses, serving_tokenize
from backend.gateway.errors import ApiError, triton_errors
from backend.gateway.protocol import ChatCompletionRequest, CompletionRequest
from backend.gateway.protocol_responses import ResponsesRequest
from backend.gateway.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from backend.gateway.request_body import parse
from backend.gateway.serving_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

log = logging.getLogger(__name__)


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


async def chat(request: Request) -> Response:
    serving = request.app.state.serving
    req = await parse(request, ChatCompletionRequest)
    images = await serving.media.images_of(req.messages)  # (first: a text-only model's template fails on parts)
    prompt, constraint = serving_chat.prepare(serving, req)
    return await until_disconnected(request, serving_chat.answer(serving, req, prompt, constraint,
                                                                 request.state.started, images))


async def completions(request: Request) -> Response:
    req = await parse(request, CompletionRequest)
    return await until_disconnected(request, serving_completions.answer(request.app.state.serving, req,
                                                                        request.state.started))


async def responses(request: Request) -> Response:
    req = await parse(request, ResponsesRequest)
    state = request.app.state
    return await until_disconnected(request, serving_responses.answer(state.serving, _callers_responses(request), req,
                                                                      request.state.started))


async def kept_response(request: Request) -> Response:
    store, response_id = _callers_responses(request), request.path_params["response_id"]
    if request.method == "DELETE":
        return serving_responses.forget(store, response_id)
    return serving_responses.retrieve(store, response_id)


def _callers_responses(request: Request):
    """The kept responses this request's caller may see (backend/gateway/response_store.py)."""
    return request.app.state.response_store.of(request.headers.get("authorization"))


async def tokenize(request: Request) -> Response:
    return await serving_tokenize.tokenize(request.app.state.serving, await parse(request, TokenizeRequest))


async def detokenize(request: Request) -> Response:
    return serving_tokenize.detokenize(request.app.state.serving, await parse(request, DetokenizeRequest))


async def version(request: Request) -> Response:
    return JSONResponse({"version": package_version("npu-llm")})


async def models(request: Request) -> Response:
    return await serving_models.list_models(request.app.state.serving)


async def load_lora_adapter(request: Request) -> Response:
    serving = request.app.state.serving
    return await serving_models.load_adapter(serving, await parse(request, LoadLoRAAdapterRequest))


async def unload_lora_adapter(request: Request) -> Response:
    serving = request.app.state.serving
    return await serving_models.unload_adapter(serving, await parse(request, UnloadLoRAAdapterRequest))


async def health(request: Request) -> Response:
    """200 when Triton's model is ready to serve. The one route open without the API key: its 503 names no address
    (the log does)."""
    model, triton = request.app.state.settings.triton_model, request.app.state.serving.triton
    if await triton.ready():
        return JSONResponse({"status": "ok"})
    log.warning("health: Triton model %r at %s is not ready", model, triton.url)
    raise ApiError(503, "the model is not ready", "service_unavailable")


async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def profile(request: Request) -> Response:
    """POST /start_profile, /stop_profile (vLLM's admin routes): a capture in the engine, when it was served with the
    profile_dir engine argument."""
    with triton_errors():
        return JSONResponse(await request.app.state.serving.triton.admin(request.url.path.strip("/")))


ROUTES = [
    Route("/v1/chat/completions", chat, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/v1/responses/{response_id}", kept_response, methods=["GET", "DELETE"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/version", version, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/start_profile", profile, methods=["POST"]),
    Route("/stop_profile", profile, methods=["POST"]),
]
# With NPU_LLM_ALLOW_RUNTIME_LORA_UPDATING (backend/gateway/serving_models.py) only, as vLLM adds them.
RUNTIME_LORA_ROUTES = [
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
]
# The routes counted in npu_llm_gateway_requests_total (and timed), by their endpoint label.
COUNTED = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
           "/tokenize": "tokenize", "/detokenize": "detokenize", "/start_profile": "profile", "/stop_profile": "profile"}
