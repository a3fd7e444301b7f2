"""A user's request as the engine's sequences, as vLLM v1's input processor makes them before the engine core sees
them: the prompt as token ids (a string tokenized, ids taken as they are), checked against the model and the engine's
limits, and fanned out into one Request per sample (n > 1). Whatever could never run fails here, with a ValueError that
names the problem, before anything is queued."""
from __future__ import annotations

import operator
from collections.abc import Callable

from backend.config import EngineConfig
from backend.config.control_key import control_key
from backend.engine.image_inputs import ImageProcessor, MultiModalInputs
from backend.engine.kv_transfer.params import KVTransferParams
from backend.engine.lora_request import LoRARequest
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.tokenizer import encode_prompt
from npu_llm_kernels.metadata import cdiv

PromptType = str | list[int] | dict


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, eos_token_ids: set[int], num_kv_blocks: int,
                 add_lora: Callable[[LoRARequest], None] | None = None, images: ImageProcessor | None = None):
        self.config, self.tokenizer, self.vocab_size = config, tokenizer, vocab_size
        self.images = images  # a vision-language model's image processor (backend/engine/image_inputs.py)
        self.add_lora = add_lora  # with enable_lora: reads and checks an adapter (the runner's add_lora)
        self.eos_token_ids, self.num_kv_blocks = eos_token_ids, num_kv_blocks
        self.kv_transfer = config.kv_transfer  # (parsed once: read by each request that carries kv_transfer_params)
        # with it, a remote prefill's params must carry a producer's signature (backend/config/control_key.py)
        self.control_key = control_key() if self.kv_transfer is not None else None

    def process(self, child_ids: list[str], prompt: PromptType, params: SamplingParams,
                lora_request: LoRARequest | None = None) -> tuple[str | None, list[Request]]:
        """(the prompt's text where it has one, a Request per sample: `child_ids`)."""
        text, ids = self._prompt_ids(prompt)
        ids, mm = self._images(prompt, ids)
        if mm is not None and mm.images and params.kv_transfer_params is not None:
            raise ValueError("kv_transfer_params: prompts with images are not served with disaggregated prefill")
        max_tokens = self._check(ids, params)
        self.check_lora(lora_request)
        return text, [Request(cid, ids, params.for_child(i), max_tokens, self.eos_token_ids, lora_request, mm)
                      for i, cid in enumerate(child_ids)]

    def _images(self, prompt: PromptType, ids: list[int]) -> tuple[list[int], MultiModalInputs | None]:
        """The prompt's images (vLLM's {"multi_modal_data": {"image": ...}}, one PIL image or a list), processed, and
        its ids with their placeholders expanded; a vision-language model's text-only prompt gets its M-RoPE
        positions too, and anything else passes as it is."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is not None and self.images is None:
            raise ValueError("multi_modal_data: this model takes text only")
        if self.images is None:
            return ids, None
        data = data or {}
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError('multi_modal_data must be {"image": <a PIL image or a list of them>}')
        images = data.get("image", [])
        return self.images.process(ids, images if isinstance(images, (list, tuple)) else [images])

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """An adapter the engine can serve: read now (kept loaded), so that a bad one fails here, not in a step."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.add_lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora")
        self.add_lora(lora_request)

    def refused_pull(self, prompt: PromptType, params: SamplingParams) -> tuple[KVTransferParams, list[int]] | None:
        """For a request refused here that a producer of this deployment prefilled for this engine: (its params, its
        prompt's ids), so that the producer can be told to free the blocks it holds for it. Else None."""
        transfer = params.kv_transfer_params
        if self.kv_transfer is None or transfer is None or not transfer.do_remote_prefill or \
                not transfer.issued_with(self.control_key):
            return None
        try:
            return transfer, self._prompt_ids(prompt)[1]
        except ValueError:
            return None

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            return prompt, encode_prompt(self.tokenizer, prompt)
        return None, _token_ids(prompt)

    def _check(self, ids: list[int], params: SamplingParams) -> int:
        """The limits that depend on the model and the engine; returns the resolved max_tokens."""
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab})")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n}: at most max_num_seqs={self.config.max_num_seqs} samples per request")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {limit}, which leaves no room to generate")
        max_tokens = params.max_tokens or limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({limit})"
            )
        if cdiv(len(ids) + max_tokens, self.config.block_size) > self.num_kv_blocks:
            raise ValueError(f"prompt + max_tokens needs more KV blocks than the cache has ({self.num_kv_blocks})")
        if params.kv_transfer_params is not None:
            self._check_kv_transfer(ids, params)
        return max_tokens

    def _check_kv_transfer(self, ids: list[int], params: SamplingParams) -> None:
        """kv_transfer_params this engine can act on: its role, one sequence, a block table the prompt fills."""
        transfer, role = params.kv_transfer_params, self.kv_transfer
        if role is None:
            raise ValueError("kv_transfer_params need an engine started with kv_transfer_config")
        if transfer.do_remote_prefill and not role.is_consumer:
            raise ValueError(f"do_remote_prefill needs a kv_consumer (or kv_both) engine; this one is {role.kv_role}")
        if transfer.do_remote_decode and not role.is_producer:
            raise ValueError(f"do_remote_decode needs a kv_producer (or kv_both) engine; this one is {role.kv_role}")
        if params.n != 1:
            raise ValueError("kv_transfer_params need n=1")
        if transfer.do_remote_prefill:
            if not transfer.issued_with(self.control_key):
                raise ValueError("kv_transfer_params were not signed by a producer of this deployment (one holding "
                                 "its NPU_LLM_CONTROL_KEY): this engine pulls KV from no one else")
            if transfer.remote_tp_size != self.config.tensor_parallel_size:
                raise ValueError(f"the prefill engine runs tensor_parallel_size={transfer.remote_tp_size} and this "
                                 f"one {self.config.tensor_parallel_size}: the KV layouts must match (one rank each)")
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs cannot be computed from a remote prefill: ask the prefill engine")
            num_blocks = cdiv(len(ids), self.config.block_size)
            if len(transfer.remote_block_ids) != num_blocks:
                raise ValueError(f"remote_block_ids has {len(transfer.remote_block_ids)} blocks; a prompt of "
                                 f"{len(ids)} tokens fills {num_blocks} of {self.config.block_size} tokens")


def _token_ids(ids) -> list[int]:
    """A prompt given as token ids (any integers: Python, numpy, torch): a list of ints, or a ValueError."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"prompt token ids must be a list of ints, got {type(ids).__name__}")
    ids = list(ids)
    try:
        if any(isinstance(t, bool) for t in ids):
            raise TypeError("a bool is not a token id")
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt token ids must be a list of ints") from None
