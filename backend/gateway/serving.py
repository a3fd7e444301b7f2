"""What every endpoint shares: the Triton client, the tokenizer, the metrics, the HTTP errors, and one path
from Triton's responses to an answer (`relay` for a stream, `gather` for a whole answer).

The first Triton response is awaited before answering, so a request the engine rejects gets a
proper 4xx instead of a stream that fails; after that, errors travel as an SSE error event.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.responses import JSONResponse

from backend.gateway.client import Chunk, InvalidRequest, TritonClient, TritonUnavailable
from backend.gateway.responses import error_body


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.status, self.param), status_code=self.status)


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


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("npu_llm_gateway_requests_total", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("npu_llm_gateway_request_duration_seconds", "Request latency (to the last byte).",
                                 ["endpoint"], registry=self.registry)
        self.ttft = Histogram("npu_llm_gateway_time_to_first_token_seconds", "Time to the first generated text.",
                              ["endpoint"], registry=self.registry)


@dataclass
class Totals:
    """Tokens of a streamed answer, counted as it passes (for the usage chunk)."""

    prompt: int = 0
    completion: int = 0


@dataclass
class Gathered:
    """A whole answer: per choice its text, finish reason, token count and logprobs."""

    texts: list[str]
    reasons: list[str | None]
    counts: list[int]
    logprobs: list[list[dict] | None]
    num_input_tokens: int = 0
    prompt_logprobs: list[dict | None] | None = None  # (and the prompt's ids), when asked for
    prompt_token_ids: list[int] | None = None


@dataclass
class Serving:
    tokenizer: object
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None  # one of REASONING_PARSERS; None: the output is all content
    triton: TritonClient | None = None  # made in the app's lifespan: grpc.aio channels belong to its event loop

    async def start(self, endpoint: str, started: float, prompt: str, parameters: dict, stream: bool, logprobs: bool,
                    request_id: str, prompt_token_ids: list[int] | None = None) -> tuple[Chunk, AsyncIterator[Chunk]]:
        """Send the request to Triton and wait for its first response (the engine's verdict on it)."""
        responses = self.triton.generate(prompt, parameters, stream, logprobs, request_id, prompt_token_ids)
        with triton_errors():
            try:
                first = await anext(responses)
            except StopAsyncIteration:
                raise ApiError(500, "Triton closed the stream without a response", "internal_error") from None
        self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - started)
        return first, responses

    async def relay(self, chunk: Chunk, responses, endpoint: str, started: float,
                    totals: Totals) -> AsyncIterator[Chunk | str]:
        """The chunks of a started stream; an error becomes one SSE error payload (a str). Counts tokens."""
        totals.prompt = chunk.num_input_tokens or 0
        try:
            while True:
                totals.completion += sum(chunk.num_new_tokens)
                yield chunk
                if chunk.final:
                    break
                chunk = await anext(responses)
        except StopAsyncIteration:
            pass
        except Exception as e:  # after the 200: tell the client in-band, then end the stream
            yield json.dumps(error_body(str(e), "internal_error", 500))
        finally:
            await responses.aclose()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    @staticmethod
    async def gather(chunk: Chunk, responses, n: int) -> Gathered:
        """A whole non-streaming answer (one Triton response, but read to the end of the stream)."""
        answer = Gathered([""] * n, [None] * n, [0] * n, [None] * n, chunk.num_input_tokens or 0)
        try:
            while True:
                for i in range(len(chunk.texts)):
                    answer.texts[i] += chunk.texts[i]
                    answer.counts[i] += chunk.num_new_tokens[i]
                    answer.reasons[i] = chunk.finish_reasons[i] or answer.reasons[i]
                    if chunk.logprobs and chunk.logprobs[i]:
                        answer.logprobs[i] = (answer.logprobs[i] or []) + chunk.logprobs[i]
                if chunk.prompt_logprobs is not None:
                    answer.prompt_logprobs, answer.prompt_token_ids = chunk.prompt_logprobs, chunk.prompt_token_ids
                if chunk.final:
                    break
                chunk = await anext(responses)
        except StopAsyncIteration:
            pass
        finally:
            await responses.aclose()
        return answer
