"""The I/O contract of Triton's vLLM backend, as plain functions over numpy values.

Kept free of triton_python_backend_utils, so the parsing rules are readable (and testable)
without a running Triton.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field

import numpy as np

from backend.config.control_key import CONTROL_KEY_ENV
from backend.config.json_object import json_object
from backend.engine.outputs import RequestOutput

from backend.engine.sampling_params import SamplingParams
from backend.triton.media import base64_bytes, decode_images

# Prefix of the error message of a request rejected for its content (a client error, HTTP 400 at the gateway).
# vllm_backend's own prefix for a request's errors, so that its clients read ours the same way.
INVALID_REQUEST = "Error generating stream: "
# Prefix of the error message when the engine cannot take requests: stopped, or shutting down (HTTP 503).
ENGINE_UNAVAILABLE = "engine unavailable: "

# A request whose Triton request parameters carry this key is an engine admin action, not a generation.
# The gateway's POST /start_profile and /stop_profile send it (vLLM's routes of the same names), its /tokenize and
# /v1/models ask for engine_info (the served max_model_len, the adapters), and its /v1/load_lora_adapter and
# /v1/unload_lora_adapter send those actions, with lora_name (and lora_path) as request parameters.
ADMIN_PARAMETER = "npu_llm_admin"
LORA_ACTIONS = ("load_lora_adapter", "unload_lora_adapter")
ADMIN_ACTIONS = ("start_profile", "stop_profile", "engine_info", *LORA_ACTIONS)
# The server's control key (backend/config/control_key.py), which `npu-llm serve` and `up` also restrict Triton's
# model-control APIs to. An admin action that changes the engine (a profile writes files and slows every request)
# must carry it too, as this request parameter; engine_info is a lookup, as open as vLLM's /v1/models. A Triton
# started by hand, without the variable, leaves its admin actions as open as its own APIs.
CONTROL_KEY_PARAMETER = "npu_llm_control_key"
KEYED_ADMIN_ACTIONS = ("start_profile", "stop_profile", *LORA_ACTIONS)

# A token a grammar forbids has logprob -inf, which JSON cannot carry: vLLM's serving layer clamps it to this.
MIN_LOGPROB = -9999.0

FLAGS = ("exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob", "return_logprobs",
         "return_num_input_tokens", "return_num_output_tokens")

# The model's inputs and outputs, in Triton's model-config form. The one home of the contract:
# TritonPythonModel.auto_complete_config adds them to config.pbtxt, and execute() reads these inputs.
INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    # npu-llm's extension: the prompt as token ids (then text_input is only its display text, and may be empty)
    {"name": "prompt_token_ids", "data_type": "TYPE_INT64", "dims": [-1], "optional": True},
    # vllm_backend's: a vision-language model's images, one base64-encoded image (PNG, JPEG, ...) an element; the
    # prompt carries the model's placeholder for each
    {"name": "image", "data_type": "TYPE_STRING", "dims": [-1], "optional": True},
    *({"name": flag, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for flag in FLAGS),
]
OUTPUTS = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    # npu-llm's extension, sent only to a request whose sampling parameters ask for prompt_logprobs (vLLM's), once:
    # the prompt tokens' logprobs as JSON, in vLLM's shape (null for the first token), and the prompt's token ids
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "prompt_token_ids", "data_type": "TYPE_INT64", "dims": [-1]},
    # npu-llm's extension, in the final response of a prefill on a kv_producer engine: the kv_transfer_params (JSON)
    # a decode engine needs to pull its KV (docs/disaggregation.md)
    {"name": "kv_transfer_params", "data_type": "TYPE_STRING", "dims": [1]},
]

# A request without the sampling_parameters input (Triton's HTTP generate endpoint) gives its sampling parameters as
# request parameters, where kv_transfer_params (disaggregated prefill) are JSON text under this name.
KV_TRANSFER_PARAMETER = "kv_transfer_params"
# vllm_backend's clients send these as JSON text inside the sampling parameters: decoded here, once.
JSON_TEXT_FIELDS = ("structured_outputs", "guided_decoding", KV_TRANSFER_PARAMETER)


@dataclass
class ParsedRequest:
    prompt: str  # text_input
    stream: bool
    params: SamplingParams
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    prompt_token_ids: list[int] | None = None
    lora_name: str | None = None  # vllm_backend's: the adapter to run with (backend/triton/loras.py)
    images: list = field(default_factory=list)  # the `image` input's, decoded (PIL images)

    @property
    def engine_prompt(self) -> str | dict:
        """What the engine gets: the token ids as they are when given, else the text; and the images, as vLLM's
        multi_modal_data."""
        if self.prompt_token_ids is None and not self.images:
            return self.prompt
        prompt = {"prompt": self.prompt} if self.prompt_token_ids is None else \
            {"prompt_token_ids": self.prompt_token_ids, "prompt": self.prompt or None}
        return {**prompt, "multi_modal_data": {"image": self.images}} if self.images else prompt


def _scalar(value: np.ndarray | None):
    return None if value is None else value.reshape(-1)[0]


def sampling_parameters_json(params: SamplingParams, lora_name: str | None = None) -> str:
    """The sampling_parameters input of a request, as the gateway sends it: every field the request sets (a default
    left out; max_tokens None, "up to max_model_len", is not the default and crosses), in vLLM's names, and the
    adapter it runs with as vllm_backend's clients name it."""
    values = params.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    return json.dumps(values if lora_name is None else {**values, "lora_name": lora_name})


def request_parameters(raw: str | None) -> dict:
    """Triton's request parameters (its JSON text), decoded once for everything that reads them."""
    return json_object(raw or "{}", "request parameters")


class AdminRefused(ValueError):
    """An admin action without the server's control key."""


def admin_action(parameters: dict, control_key: str | None = None) -> str | None:
    """The admin action a request asks for, or None for an ordinary generation request. With a control_key, a
    keyed action (KEYED_ADMIN_ACTIONS) whose request lacks that key raises AdminRefused."""
    action = parameters.get(ADMIN_PARAMETER)
    if action is None:
        return None
    if action not in ADMIN_ACTIONS:
        raise ValueError(f"{ADMIN_PARAMETER} must be one of {', '.join(ADMIN_ACTIONS)}; got {action!r}")
    given = str(parameters.get(CONTROL_KEY_PARAMETER, ""))
    if control_key and action in KEYED_ADMIN_ACTIONS and not hmac.compare_digest(given.encode(), control_key.encode()):
        raise AdminRefused(f"{action} needs this server's control key (the {CONTROL_KEY_PARAMETER} parameter; "
                           f"the gateway sends {CONTROL_KEY_ENV} from its environment)")
    return action


def parse_request(inputs: dict[str, np.ndarray | None], parameters: dict) -> ParsedRequest:
    """inputs: the contract's input tensors by name (None when absent); parameters: Triton's request parameters.

    Raises ValueError with a message naming what is wrong.
    """
    text = _scalar(inputs.get("text_input"))
    if text is None:
        raise ValueError("missing input 'text_input'")
    try:
        prompt = text.decode("utf-8", errors="strict") if isinstance(text, bytes) else str(text)
    except UnicodeDecodeError as e:
        raise ValueError(f"text_input is not valid UTF-8: {e}") from None
    ids = inputs.get("prompt_token_ids")
    prompt_token_ids = None if ids is None else [int(t) for t in ids.reshape(-1)]
    encoded = [] if inputs.get("image") is None else list(inputs["image"].reshape(-1))
    wheres = [f"image[{i}]" for i in range(len(encoded))]
    images = decode_images([base64_bytes(data, where) for data, where in zip(encoded, wheres)], wheres)

    # Sampling parameters come as a JSON string input, or (generate endpoint) as request parameters: one or the
    # other, as vllm_backend reads them, never merged.
    raw = _scalar(inputs.get("sampling_parameters"))
    if raw is None:
        values = dict(parameters)
    else:
        values = json_object(raw, "sampling_parameters")
        if KV_TRANSFER_PARAMETER in parameters:
            raise ValueError(f"{KV_TRANSFER_PARAMETER} belong inside the sampling_parameters input when it is given")

    stream_input = _scalar(inputs.get("stream"))
    stream_param = values.pop("stream", False)
    stream = bool(stream_input) if stream_input is not None else bool(_as_bool(stream_param, "stream"))
    flags = {}
    for name in FLAGS:
        value = _scalar(inputs.get(name))
        flags[name] = bool(value) if value is not None else _as_bool(values.pop(name, None), name)
    # vllm_backend: a streaming request never echoes its prompt, and asking it to is an error
    if stream and flags["exclude_input_in_output"] is False:
        raise ValueError("When streaming, `exclude_input_in_output` = False is not allowed.")
    flags = {name: bool(value) for name, value in flags.items()}
    lora_name = values.pop("lora_name", None)
    if lora_name is not None and not isinstance(lora_name, str):
        raise ValueError(f"lora_name must be a string, got {lora_name!r}")
    _objects_from_text(values)
    _from_guided_decoding(values)
    try:
        params = SamplingParams(**values)
    except ValueError as e:  # pydantic's message names each offending field
        raise ValueError(f"invalid sampling parameters: {e}") from None
    return ParsedRequest(prompt=prompt, stream=stream, params=params, prompt_token_ids=prompt_token_ids,
                         lora_name=lora_name, images=images, **flags)


# guided_decoding.backend values vllm_backend lets through (it maps them all to xgrammar, as we do)
XGRAMMAR_BACKENDS = ("xgrammar", "xgrammar:no-fallback", "auto", "xgrammar:_auto")


def _objects_from_text(values: dict) -> None:
    """The fields vllm_backend's clients send as JSON text (JSON_TEXT_FIELDS), as objects, in place."""
    for name in JSON_TEXT_FIELDS:
        if isinstance(values.get(name), str):
            try:
                values[name] = json.loads(values[name])
            except json.JSONDecodeError as e:
                raise ValueError(f"{name} is not valid JSON: {e}") from None


def _from_guided_decoding(values: dict) -> None:
    """vLLM's older guided_decoding key (an object or its JSON text), as structured_outputs, in place, as
    vllm_backend maps it; structured_outputs wins when both are given."""
    guided = values.pop("guided_decoding", None)  # (its JSON text decoded already: _objects_from_text)
    if guided is None:
        return
    if not isinstance(guided, dict):
        raise ValueError("guided_decoding must be a JSON object")
    guided = dict(guided)
    backend = guided.pop("backend", None)
    if backend is not None and backend not in XGRAMMAR_BACKENDS:
        raise ValueError(f"guided_decoding.backend {backend!r} is not available; this server uses xgrammar")
    if values.get("structured_outputs") is None:
        values["structured_outputs"] = guided


def _as_bool(value, name: str) -> bool | None:
    """A flag's value; None when it was not given."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{name} must be a boolean, got {value!r}")


def response_tensors(parsed: ParsedRequest, output: RequestOutput, sent_tokens: list[int]) -> dict[str, np.ndarray]:
    """Output tensors for one response. Streaming responses carry the text (and token count) new since
    the previous response; a non-streaming one carries everything, prompt first unless excluded.
    sent_tokens (per sequence, updated here) remembers what earlier responses carried.
    """
    completions = output.outputs
    if parsed.stream:
        texts = [c.delta for c in completions]
    else:
        prefix = "" if parsed.exclude_input_in_output else parsed.prompt
        texts = [prefix + c.text for c in completions]
    tensors = {"text_output": np.array([t.encode("utf-8") for t in texts], dtype=np.object_)}
    if parsed.return_finish_reason:
        tensors["finish_reason"] = np.array([str(c.finish_reason).encode() for c in completions], dtype=np.object_)
    if parsed.return_cumulative_logprob:
        # NaN when the request asked for no logprobs: vLLM has none then (its None, in a float tensor)
        tensors["cumulative_logprob"] = np.array(
            [np.nan if c.cumulative_logprob is None else c.cumulative_logprob for c in completions], dtype=np.float32)
    if parsed.return_num_input_tokens:
        tensors["num_input_tokens"] = np.array([len(output.prompt_token_ids)], dtype=np.uint32)
    counts = [len(c.token_ids) for c in completions]
    starts = sent_tokens if parsed.stream else [0] * len(completions)
    if parsed.return_num_output_tokens:
        tensors["num_output_tokens"] = np.array([n - s for n, s in zip(counts, starts)], dtype=np.uint32)
    if parsed.return_logprobs:
        tensors["logprobs"] = np.array(
            [json.dumps(_logprobs(c, start)).encode() for c, start in zip(completions, starts)], dtype=np.object_
        )
    # the prompt's, complete once its first token is sampled: in the first response that carries tokens (the
    # sequence that scores the prompt, the first, is admitted first, so that response has its token)
    if output.prompt_logprobs is not None and not any(starts):
        scored = [None] + [_entry(position) for position in output.prompt_logprobs[1:]]
        tensors["prompt_logprobs"] = np.array([json.dumps(scored).encode()], dtype=np.object_)
        tensors["prompt_token_ids"] = np.array(output.prompt_token_ids, dtype=np.int64)
    if output.kv_transfer_params is not None:
        tensors["kv_transfer_params"] = np.array([json.dumps(output.kv_transfer_params).encode()], dtype=np.object_)
    sent_tokens[:] = counts
    return tensors


def _logprobs(completion, start: int) -> list[dict] | None:
    """vLLM's shape, per generated token from `start` on: {token id: {"logprob", "rank", "decoded_token"}}, the
    sampled token first (it is always there, with its true rank), then the top alternatives."""
    if completion.logprobs is None:
        return None
    return [_entry(position) for position in completion.logprobs[start:]]


def _entry(position: dict) -> dict:
    """One position's logprobs, vLLM's JSON: {token id: {"logprob", "rank", "decoded_token"}}."""
    return {str(t): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in position.items()}
