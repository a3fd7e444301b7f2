"""OpenAI-compatible HTTP API (starlette + sse-starlette) in front of Triton.

Each request becomes one Triton gRPC stream. The first Triton response is awaited before
answering, so a request the engine rejects gets a proper 4xx instead of a stream that fails;
after that, errors travel as an SSE error event. A client that disconnects, streaming or not,
cancels the Triton stream, and with it the engine request and its KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backend.gateway.client import Chunk, InvalidRequest, TritonClient, TritonUnavailable
from backend.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_id,
    error_body,
    now,
    usage,
)
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


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.status, self.param), status_code=self.status)


@dataclass
class _Totals:
    prompt: int = 0
    completion: int = 0


class _Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("npu_llm_gateway_requests_total", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("npu_llm_gateway_request_duration_seconds", "Request latency (to the last byte).",
                                 ["endpoint"], registry=self.registry)
        self.ttft = Histogram("npu_llm_gateway_time_to_first_token_seconds", "Time to the first generated text.",
                              ["endpoint"], registry=self.registry)


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
    from backend.engine.tokenizer import load_tokenizer
    from backend.models.registry import resolve_model

    return load_tokenizer(resolve_model(name_or_path))


def create_app(settings: GatewaySettings, tokenizer=None) -> Starlette:
    tokenizer = tokenizer or _load_tokenizer(settings.tokenizer)
    metrics = _Metrics()
    triton: TritonClient = None  # made in lifespan: grpc.aio channels belong to the serving event loop

    @contextlib.asynccontextmanager
    async def lifespan(app):
        nonlocal triton
        triton = TritonClient(settings.triton_url, settings.triton_model)
        yield
        await triton.close()

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
            raise ApiError(400, f"{param}: {first['msg']}", param=param) from None
        if parsed.model != settings.served_model_name:
            raise ApiError(404, f"model {parsed.model!r} does not exist; this server serves "
                                f"{settings.served_model_name!r}", "not_found_error", "model")
        return parsed

    async def first_chunk(prompt: str, req, logprobs: bool, request_id: str, prompt_token_ids=None):
        stream = triton.generate(prompt, req.engine_parameters(), req.stream, logprobs, request_id, prompt_token_ids)
        with triton_errors():
            try:
                return await anext(stream), stream
            except StopAsyncIteration:
                raise ApiError(500, "Triton closed the stream without a response", "internal_error") from None

    @contextlib.contextmanager
    def triton_errors():
        """Failures reported by the Triton client, as the gateway's HTTP errors."""
        try:
            yield
        except InvalidRequest as e:
            raise ApiError(400, str(e)) from None
        except TritonUnavailable as e:
            raise ApiError(503, str(e), "service_unavailable") from None
        except RuntimeError as e:
            raise ApiError(500, str(e), "internal_error") from None

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

    # -- chat -------------------------------------------------------------------------------------

    async def chat(request: Request, start: float) -> Response:
        req = validate(ChatCompletionRequest, await read_body(request))
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template itself rejects the conversation (e.g. roles out of order)
            raise ApiError(400, f"messages: {e}", param="messages") from None
        return await until_disconnected(request, answer_chat(req, prompt, start))

    async def answer_chat(req: ChatCompletionRequest, prompt: str, start: float) -> Response:
        rid = completion_id("chatcmpl")
        chunk, stream = await first_chunk(prompt, req, req.logprobs, rid)
        metrics.ttft.labels("chat").observe(time.perf_counter() - start)
        if req.stream:
            return EventSourceResponse(_chat_events(req, rid, chunk, stream, start))
        texts, logprobs, reasons, n_in, n_out = await _gather(chunk, stream, req.n)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": texts[i]},
             "logprobs": _chat_logprobs(logprobs[i], req.top_logprobs) if req.logprobs else None,
             "finish_reason": reasons[i]}
            for i in range(req.n)
        ]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now(), "model": req.model,
                             "choices": choices, "usage": usage(n_in, sum(n_out))})

    async def _chat_events(req, rid, chunk: Chunk, stream, start) -> AsyncIterator[str]:
        created = now()

        def event(choices, **extra):
            return json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                               "choices": choices, **extra})

        yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(req.n)])
        totals = _Totals()
        async for c in _relay(chunk, stream, req, "chat", start, totals):
            if isinstance(c, str):  # an error after the stream started
                yield c
                return
            choices = []
            for i in range(len(c.texts)):
                if c.texts[i] or c.finish_reasons[i]:
                    lp = _chat_logprobs(c.logprobs[i], req.top_logprobs) if req.logprobs and c.logprobs else None
                    delta = {"content": c.texts[i]} if c.texts[i] else {}
                    choices.append({"index": i, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reasons[i]})
            if choices:
                yield event(choices)
        if req.include_usage:
            yield event([], usage=usage(totals.prompt, totals.completion))
        yield "[DONE]"

    # -- completions ------------------------------------------------------------------------------

    async def completions(request: Request, start: float) -> Response:
        req = validate(CompletionRequest, await read_body(request))
        return await until_disconnected(request, answer_completion(req, start))

    async def answer_completion(req: CompletionRequest, start: float) -> Response:
        # Token ids go to the engine as they are; their text is only for echo.
        ids = None if isinstance(req.prompt, str) else req.prompt
        prompt = req.prompt if ids is None else tokenizer.decode(ids)
        rid = completion_id("cmpl")
        chunk, stream = await first_chunk(prompt, req, req.logprobs is not None, rid, ids)
        metrics.ttft.labels("completions").observe(time.perf_counter() - start)
        if req.stream:
            return EventSourceResponse(_completion_events(req, rid, prompt, chunk, stream, start))
        texts, logprobs, reasons, n_in, n_out = await _gather(chunk, stream, req.n)
        if req.echo:
            texts = [prompt + t for t in texts]
        choices = [{"index": i, "text": texts[i], "logprobs": _completion_logprobs(logprobs[i]) if req.logprobs is not None
                    else None, "finish_reason": reasons[i]} for i in range(req.n)]
        return JSONResponse({"id": rid, "object": "text_completion", "created": now(), "model": req.model,
                             "choices": choices, "usage": usage(n_in, sum(n_out))})

    async def _completion_events(req, rid, prompt, chunk, stream, start) -> AsyncIterator[str]:
        created = now()

        def event(choices, **extra):
            return json.dumps({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                               "choices": choices, **extra})

        if req.echo:
            yield event([{"index": i, "text": prompt, "logprobs": None, "finish_reason": None} for i in range(req.n)])
        totals = _Totals()
        async for c in _relay(chunk, stream, req, "completions", start, totals):
            if isinstance(c, str):
                yield c
                return
            choices = [{"index": i, "text": c.texts[i], "finish_reason": c.finish_reasons[i],
                        "logprobs": _completion_logprobs(c.logprobs[i]) if req.logprobs is not None and c.logprobs
                        else None}
                       for i in range(len(c.texts)) if c.texts[i] or c.finish_reasons[i]]
            if choices:
                yield event(choices)
        if req.include_usage:
            yield event([], usage=usage(totals.prompt, totals.completion))
        yield "[DONE]"

    # -- shared streaming helpers -----------------------------------------------------------------

    async def _relay(chunk: Chunk, stream, req, endpoint: str, start: float, totals: "_Totals"):
        """The chunks of a started stream; an error becomes one SSE error payload. Counts tokens into totals."""
        totals.prompt = chunk.num_input_tokens or 0
        try:
            while True:
                totals.completion += sum(chunk.num_new_tokens)
                yield chunk
                if chunk.final:
                    break
                chunk = await anext(stream)
        except StopAsyncIteration:
            pass
        except Exception as e:  # after the 200: tell the client in-band, then end the stream
            yield json.dumps(error_body(str(e), "internal_error", 500))
        finally:
            await stream.aclose()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    async def _gather(chunk: Chunk, stream, n: int):
        """A whole non-streaming answer (one Triton response, but read to the end of the stream)."""
        texts, logprobs, reasons, counts = [""] * n, [None] * n, [None] * n, [0] * n
        n_in = chunk.num_input_tokens or 0
        try:
            while True:
                for i in range(len(chunk.texts)):
                    texts[i] += chunk.texts[i]
                    counts[i] += chunk.num_new_tokens[i]
                    reasons[i] = chunk.finish_reasons[i] or reasons[i]
                    if chunk.logprobs and chunk.logprobs[i]:
                        logprobs[i] = (logprobs[i] or []) + chunk.logprobs[i]
                if chunk.final:
                    break
                chunk = await anext(stream)
        except StopAsyncIteration:
            pass
        finally:
            await stream.aclose()
        return texts, logprobs, reasons, n_in, counts

    def _chat_logprobs(entries: list[dict] | None, k: int | None) -> dict | None:
        """OpenAI's chat logprobs from vLLM's shape (backend/triton/contract.py: the sampled token first)."""
        if entries is None:
            return None

        def item(lp: dict):
            token = lp["decoded_token"]
            return {"token": token, "logprob": lp["logprob"], "bytes": list(token.encode())}

        content = []
        for position in entries:
            sampled, *_ = position.values()
            top = sorted(position.values(), key=lambda lp: lp["rank"])[: k or 0]
            content.append({**item(sampled), "top_logprobs": [item(lp) for lp in top]})
        return {"content": content}

    def _completion_logprobs(entries: list[dict] | None) -> dict | None:
        if entries is None:
            return None
        sampled = [next(iter(position.values())) for position in entries]
        return {"tokens": [lp["decoded_token"] for lp in sampled],
                "token_logprobs": [lp["logprob"] for lp in sampled],
                "top_logprobs": [{lp["decoded_token"]: lp["logprob"] for lp in position.values()} for position in entries],
                "text_offset": None}

    # -- the rest ---------------------------------------------------------------------------------

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": settings.served_model_name, "object": "model", "created": now(), "owned_by": "npu-llm"}]})

    async def health(request: Request) -> Response:
        if await triton.ready():
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
            return JSONResponse(await triton.admin(request.url.path.strip("/")))

    async def profile_endpoint(request: Request) -> Response:
        return await handle("profile", request, profile)

    async def chat_endpoint(request: Request) -> Response:
        return await handle("chat", request, chat)

    async def completions_endpoint(request: Request) -> Response:
        return await handle("completions", request, completions)

    routes = [
        Route("/v1/chat/completions", chat_endpoint, methods=["POST"]),
        Route("/v1/completions", completions_endpoint, methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", guarded(prometheus), methods=["GET"]),
        Route("/start_profile", profile_endpoint, methods=["POST"]),
        Route("/stop_profile", profile_endpoint, methods=["POST"]),
    ]
    middleware = []
    if settings.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                                     allow_headers=["*"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.settings = settings
    return app
