"""What every endpoint shares: the Triton client, the tokenizer, the metrics, and one path from Triton's responses
to an answer (`relay` for a stream, `gather`, built on it, for a whole answer).

The first Triton response is awaited before answering, so a request the engine rejects gets a proper 4xx instead of
a stream that fails; after that, errors travel in-band (backend/gateway/sse.py).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from backend.engine.sampling_params import SamplingParams
from backend.gateway.client import Chunk, TritonClient
from backend.gateway.errors import ApiError, triton_errors
from backend.gateway.media import MediaLoader
from backend.gateway.request_body import validate


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
    kv_transfer_params: dict | None = None  # a prefill on a kv_producer engine: for the decode engine


@dataclass
class Serving:
    tokenizer: object
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None  # one of REASONING_PARSERS; None: the output is all content
    # made in the app's lifespan (grpc.aio channels belong to its event loop): a TritonClient, or the proxy's
    # DisaggregatedClient (backend/gateway/proxy.py), which has its interface
    triton: TritonClient | None = None
    max_model_len: int | None = None  # the engine's, once asked (backend/gateway/serving_tokenize.py)
    # a client's kv_transfer_params reach the engine only when the gateway is told so (a proxy in front of it):
    # they name other engines' blocks
    allow_kv_transfer_params: bool = False
    served_model_name: str = ""  # the base model's name; any other `model` a request names is an adapter
    adapters: dict[str, str] = field(default_factory=dict)  # the Triton model's LoRA adapters, as last asked
    media: MediaLoader = field(default_factory=MediaLoader)  # a chat request's images (backend/gateway/media.py)

    async def start(self, endpoint: str, started: float, prompt: str, parameters: dict, stream: bool,
                    request_id: str, prompt_token_ids: list[int] | None = None,
                    model: str | None = None, images: list[str] = ()) -> tuple[Chunk, AsyncIterator[Chunk]]:
        """Send the request to Triton (with the adapter its `model` names, and its images base64-encoded) and wait for
        its first response (the engine's verdict on it)."""
        lora_name = None if model in (None, self.served_model_name) else model
        responses = self.triton.generate(prompt, self.sampling_params(parameters), stream, request_id, prompt_token_ids,
                                         lora_name, images)
        with triton_errors():
            try:
                first = await anext(responses)
            except StopAsyncIteration:
                raise ApiError(500, "Triton closed the stream without a response", "internal_error") from None
        self.metrics.ttft.labels(endpoint).observe(time.perf_counter() - started)
        return first, responses

    def sampling_params(self, parameters: dict) -> SamplingParams:
        """The engine's SamplingParams of a request's fields: the one shape it travels in, to Triton and on to the
        engine (a 400 naming the field the engine would refuse). A client's kv_transfer_params are dropped unless
        the gateway passes them on."""
        if not self.allow_kv_transfer_params:
            parameters = {k: v for k, v in parameters.items() if k != "kv_transfer_params"}
        return validate(SamplingParams, parameters)

    @staticmethod
    async def relay(chunk: Chunk, responses, totals: Totals | None = None) -> AsyncIterator[Chunk]:
        """The chunks of a started request, the first included, to its final one (counted into `totals`); the
        Triton stream is closed however the reading ends."""
        totals = totals if totals is not None else Totals()
        totals.prompt = chunk.num_input_tokens or 0
        try:
            while True:
                totals.completion += sum(chunk.num_new_tokens)
                yield chunk
                if chunk.final:
                    return
                chunk = await anext(responses)
        except StopAsyncIteration:
            pass
        finally:
            await responses.aclose()

    @classmethod
    async def gather(cls, chunk: Chunk, responses, n: int) -> Gathered:
        """A whole non-streaming answer (one Triton response, but read to the end of the stream)."""
        answer = Gathered([""] * n, [None] * n, [0] * n, [None] * n, chunk.num_input_tokens or 0)
        async for chunk in cls.relay(chunk, responses):
            for i in range(len(chunk.texts)):
                answer.texts[i] += chunk.texts[i]
                answer.counts[i] += chunk.num_new_tokens[i]
                answer.reasons[i] = chunk.finish_reasons[i] or answer.reasons[i]
                if chunk.logprobs and chunk.logprobs[i]:
                    answer.logprobs[i] = (answer.logprobs[i] or []) + chunk.logprobs[i]
            if chunk.prompt_logprobs is not None:
                answer.prompt_logprobs, answer.prompt_token_ids = chunk.prompt_logprobs, chunk.prompt_token_ids
            answer.kv_transfer_params = chunk.kv_transfer_params or answer.kv_transfer_params
        return answer
