"""Triton gRPC client for the gateway: one bidirectional stream per request (tritonclient.grpc.aio)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from backend.config.control_key import control_key
from backend.engine.sampling_params import SamplingParams
from backend.triton.contract import (
    ADMIN_PARAMETER,
    CONTROL_KEY_PARAMETER,
    ENGINE_UNAVAILABLE,
    INVALID_REQUEST,
    sampling_parameters_json,
)
from backend.triton.loras import is_lora_refusal


class TritonUnavailable(RuntimeError):
    """Triton cannot be reached or the model is not ready."""


class InvalidRequest(ValueError):
    """The engine rejected the request's content (or the adapter it names)."""


@dataclass
class Chunk:
    """One Triton response: per choice, the new text, new token count and (if asked) logprobs."""

    texts: list[str]
    num_new_tokens: list[int]
    finish_reasons: list[str | None]
    num_input_tokens: int | None
    logprobs: list[list[dict] | None] = field(default_factory=list)
    final: bool = False  # the request's last response
    # when asked for (the prompt_logprobs sampling parameter), once: vLLM's prompt logprobs (None first), and the
    # prompt's token ids
    prompt_logprobs: list[dict | None] | None = None
    prompt_token_ids: list[int] | None = None
    # a prefill on a kv_producer engine, in its final response: where a decode engine pulls its KV from
    kv_transfer_params: dict | None = None


def infer_input(name: str, value: bytes | bool):
    """A one-element input of the vLLM-backend contract: BYTES for bytes, BOOL for bools.

    (tritonclient.grpc and tritonclient.grpc.aio share this InferInput class.)
    """
    triton_type = "BYTES" if isinstance(value, bytes) else "BOOL"
    t = grpcclient.InferInput(name, [1], triton_type)
    t.set_data_from_numpy(np.array([value], dtype=np.object_ if triton_type == "BYTES" else bool))
    return t


class TritonClient:
    def __init__(self, url: str, model: str):
        self.url = url
        self.model = model
        self._client = grpcclient.InferenceServerClient(url)

    async def ready(self, timeout: float = 2.0) -> bool:
        try:
            return await self._client.is_model_ready(self.model, client_timeout=timeout)
        except InferenceServerException:
            return False

    async def close(self) -> None:
        await self._client.close()

    async def generate(self, prompt: str, params: SamplingParams, stream: bool, request_id: str,
                       prompt_token_ids: list[int] | None = None, lora_name: str | None = None,
                       images: list[str] = ()) -> AsyncIterator[Chunk]:
        """Responses of one request (the completion only, never the prompt); leaving the iteration early cancels
        it on the server. With prompt_token_ids the engine gets those ids as they are, and `prompt` is their text.
        params travel whole, kv_transfer_params included, as the sampling_parameters input."""
        inputs = [
            infer_input("text_input", prompt.encode()),
            infer_input("sampling_parameters", sampling_parameters_json(params, lora_name).encode()),
            infer_input("stream", stream),
            infer_input("exclude_input_in_output", True),
            infer_input("return_finish_reason", True),
            infer_input("return_num_input_tokens", True),
            infer_input("return_num_output_tokens", True),
            infer_input("return_logprobs", params.logprobs is not None),
        ]
        if prompt_token_ids is not None:
            ids = grpcclient.InferInput("prompt_token_ids", [len(prompt_token_ids)], "INT64")
            ids.set_data_from_numpy(np.array(prompt_token_ids, dtype=np.int64))
            inputs.append(ids)
        if images:  # (vllm_backend's `image` input: base64 text, one image an element)
            image = grpcclient.InferInput("image", [len(images)], "BYTES")
            image.set_data_from_numpy(np.array([i.encode() for i in images], dtype=np.object_))
            inputs.append(image)

        request = {"model_name": self.model, "inputs": inputs, "request_id": request_id}

        async def requests():
            yield request

        responses = self._client.stream_infer(inputs_iterator=requests())
        done = False
        try:
            async for result, error in responses:
                if error is not None:
                    done = True
                    raise _request_error(error)
                chunk = _chunk(result)
                if chunk.final:
                    done = True
                yield chunk
                if done:
                    return
        except (InferenceServerException, grpc.RpcError) as e:  # transport failures, not request errors
            raise self._unavailable(e) from e
        finally:
            if not done:  # the client went away: cancel, so the engine aborts and frees the request's blocks
                responses.cancel()

    async def admin(self, action: str, **arguments: str) -> dict:
        """An engine admin action (backend/triton/contract.py ADMIN_ACTIONS), with its arguments; the model's JSON
        answer."""
        parameters = {**arguments, ADMIN_PARAMETER: action}
        if key := control_key():  # (set by `npu-llm up`, or by hand beside `npu-llm serve`'s)
            parameters[CONTROL_KEY_PARAMETER] = key

        async def requests():
            yield {"model_name": self.model, "inputs": [infer_input("text_input", b"")], "parameters": parameters}

        try:
            async for result, error in self._client.stream_infer(inputs_iterator=requests()):
                if error is not None:
                    raise _request_error(error)
                return json.loads(result.as_numpy("text_output")[0])
        except (InferenceServerException, grpc.RpcError) as e:
            raise self._unavailable(e) from e
        raise RuntimeError("Triton closed the stream without a response")

    def _unavailable(self, e: InferenceServerException | grpc.RpcError) -> TritonUnavailable:
        detail = e.message() if isinstance(e, InferenceServerException) else e.details()
        return TritonUnavailable(f"Triton at {self.url} is unreachable: {detail}")


def _request_error(error: InferenceServerException) -> Exception:
    """A request's error response: InvalidRequest for content the engine rejected, TritonUnavailable when the
    engine (or the model) is not there to serve it, else RuntimeError."""
    message = error.message()
    if message.startswith(INVALID_REQUEST):
        return InvalidRequest(message[len(INVALID_REQUEST):])
    if is_lora_refusal(message):  # (vllm_backend's texts, without the prefix)
        return InvalidRequest(message)
    if message.startswith(ENGINE_UNAVAILABLE) or "unknown model" in message or "no available versions" in message:
        return TritonUnavailable(message)
    return RuntimeError(message)


def _chunk(result) -> Chunk:
    response = result.get_response()
    names = {o.name for o in response.outputs}

    def strings(name):
        return [v.decode() for v in result.as_numpy(name)] if name in names else []

    texts = strings("text_output")
    counts = result.as_numpy("num_output_tokens").tolist() if "num_output_tokens" in names else [0] * len(texts)
    reasons = [None if r == "None" else r for r in strings("finish_reason")] or [None] * len(texts)
    num_input = int(result.as_numpy("num_input_tokens")[0]) if "num_input_tokens" in names else None
    logprobs = [json.loads(v) for v in strings("logprobs")]
    prompt_logprobs = json.loads(strings("prompt_logprobs")[0]) if "prompt_logprobs" in names else None
    prompt_ids = result.as_numpy("prompt_token_ids").tolist() if "prompt_token_ids" in names else None
    transfer = json.loads(strings("kv_transfer_params")[0]) if "kv_transfer_params" in names else None
    # every sequence has a finish reason only in the last response of a request
    return Chunk(texts, counts, reasons, num_input, logprobs, final=bool(reasons) and all(reasons),
                 prompt_logprobs=prompt_logprobs, prompt_token_ids=prompt_ids, kv_transfer_params=transfer)
