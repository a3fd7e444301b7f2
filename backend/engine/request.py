"""Request: one sequence's state, from admission to its finish."""
from __future__ import annotations

import enum
import time

import torch

from backend.engine.image_inputs import MultiModalInputs
from backend.engine.lora_request import LoRARequest
from backend.engine.sampling_params import SamplingParams

class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # holding blocks while another engine's prefill is pulled into them (backend/engine/kv_transfer/)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED = "finished"


class Request:
    """One sequence: its tokens, how many of them sit in the KV cache, and when it stops.

    Its block table belongs to the KVCacheManager; its text and logprobs to the OutputProcessor.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int, eos_ids,
                 lora_request: LoRARequest | None = None, mm_inputs: MultiModalInputs | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # resolved: params.max_tokens or what max_model_len leaves
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        # prompt tokens, past the prefix-cache hits, that another engine or a KV pool gave it; and whether a load of
        # them failed (its prompt is then computed here)
        self.num_external_computed_tokens = 0
        self.external_load_failed = False
        self.block_hashes: list[bytes] = []  # prefix-cache hash chain over its full blocks of tokens
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.eos_token_ids = frozenset(eos_ids)
        self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.arrival_time = time.time()
        self.scheduled_time: float | None = None  # first admitted to a step
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.grammar = None  # a SequenceGrammar when params.structured_outputs asks for one (set by the engine)
        self.draft_token_ids: list[int] = []  # speculative decoding: tokens drafted after the last one, to verify
        # with prompt_logprobs: prompt tokens scored so far (the first has no logprob, so it counts as scored), so
        # that a recomputation after preemption does not score them again
        self.num_scored_prompt_tokens = 1
        # disaggregated prefill: what the request came with (dropped once its KV is pulled, or given up on), and the
        # params a producer returns for the consumer (backend/engine/kv_transfer/)
        self.kv_transfer_params = params.kv_transfer_params
        self.kv_transfer_params_out: dict | None = None
        self.lora_request = lora_request  # the adapter it runs with (None: the base model)
        self.mm_inputs = mm_inputs  # a vision-language model's prompt: its images and M-RoPE positions

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def lora_int_id(self) -> int | None:
        """The adapter's id: what the slots are kept by, and so what max_loras counts."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def waiting_for_grammar(self) -> bool:
        return self.grammar is not None and not self.grammar.ready

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def can_stop(self, num_after: int = 0) -> bool:
        """The output up to the token checked (num_after tokens before its end) is longer than min_tokens: only then
        do stop strings count (as in vLLM), and stop tokens (vLLM checks >= min_tokens, which is the same since the
        sampler masks stop tokens until then)."""
        return self.num_output_tokens - num_after > self.params.min_tokens

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token_time = time.time()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.time()
        self.grammar = None  # its matcher is no longer needed
