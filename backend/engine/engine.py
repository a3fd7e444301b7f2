"""LLMEngine (add_request / abort_request / step) and LLM, the offline API modelled on vLLM's."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from backend.config import EngineConfig
from backend.engine.detokenizer import IncrementalDetokenizer
from backend.engine.kv_cache import KVCacheManager
from backend.engine.profiler import ProfileResult, Profiler
from backend.engine.request import (
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from backend.engine.runner import ModelRunner, SequenceChunk
from backend.engine.sampler import sample
from backend.engine.scheduler import Scheduler
from backend.engine.tokenizer import chat_prompt_ids, eos_token_ids, load_tokenizer
from backend.models.loader import load_config, load_model, max_model_len_of
from backend.models.registry import resolve_model
from backend.platform import resolve_platform, tune_host_allocator
from kernels import ops_for
from kernels.timing import scope

log = logging.getLogger(__name__)

PromptType = str | list[int] | dict


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests
    prefix_cache_hit_rate: float  # prompt tokens found in the prefix cache / looked up
    num_preemptions: int
    num_computed_tokens: int  # tokens run through the model
    num_prompt_tokens: int  # prompt tokens of admitted requests
    num_generation_tokens: int
    num_steps: int
    kv_cache_waste: float  # allocated but unused slots / allocated, averaged over steps
    num_kv_blocks: int


class StepError(RuntimeError):
    """A forward pass failed; the requests in it were aborted (the others go on)."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids


class _Group:
    """A user request: n sequences sharing one prompt (and, through the prefix cache, its blocks)."""

    def __init__(self, request_id: str, prompt: str | None, children: list[Request], detokenizers):
        self.request_id = request_id
        self.prompt = prompt
        self.children = children
        self.detokenizers = detokenizers

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def output(self) -> RequestOutput:
        outputs = []
        for index, (child, detok) in enumerate(zip(self.children, self.detokenizers)):
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=detok.text,
                    delta=detok.take_delta(child.finished),
                    token_ids=child.output_token_ids,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                    cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
                    logprobs=child.logprobs,
                )
            )
        first = self.children[0]
        first_times = [c.first_token_time for c in self.children if c.first_token_time]
        finish_times = [c.finish_time for c in self.children if c.finish_time]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_token_time=min(first_times) if first_times else None,
            finish_time=max(finish_times) if self.finished and finish_times else None,
            num_cached_tokens=first.num_cached_tokens,
        )
        return RequestOutput(self.request_id, self.prompt, first.prompt_token_ids, outputs, self.finished, metrics)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **engine_args):
        self.config = config = config or EngineConfig(**engine_args)
        self.platform = resolve_platform(config.device)
        tune_host_allocator()
        torch.manual_seed(config.seed)
        model_dir = resolve_model(config.model)
        config.finalize(self.platform.name, max_model_len_of(load_config(model_dir)))
        self.model, self.model_config, self.model_dir = load_model(
            model_dir, ops_for(self.platform.name), self.platform.device, config.dtype, config.max_model_len
        )
        self.tokenizer = load_tokenizer(config.tokenizer or model_dir)
        self.eos_token_ids = eos_token_ids(model_dir, self.model_config, self.tokenizer)
        num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.platform.device)
        if not config.enforce_eager:
            max_len = min(config.max_model_len, config.max_seq_len_to_capture)
            self.runner.capture_decode_graphs(self.platform, config.max_num_seqs, max_len)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill
        )
        self.groups: dict[str, _Group] = {}
        self._owner: dict[int, tuple[_Group, int]] = {}  # id(child) -> its group and index
        self._aborted: list[RequestOutput] = []
        self._ids = itertools.count()
        self._num_steps = self._num_computed = self._num_prompt = self._num_generated = 0
        self._waste_sum = 0.0
        self.profiler = Profiler(self.platform, config.profile_dir) if config.profile_dir else None
        self._warm_up()
        log.info("engine ready: %s on %s, %d KV blocks of %d tokens", self.model_dir, self.platform.device,
                 num_blocks, config.block_size)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """All one-time work before the first request: the first prefill and decode step build the
        kernels (the CPU extension compiles on first use) and the matmul primitives; the first sample
        and the first tokenizer call load their code too."""
        start = time.perf_counter()
        logits = self.runner.warm_up(min(self.config.max_num_batched_tokens, self.config.max_model_len - 1))
        probe = Request("warm-up", [0], SamplingParams(temperature=1.0, top_p=0.9, seed=0), 1, self.eos_token_ids)
        sample(logits[:1], [probe])
        self.tokenizer.decode(self.tokenizer.encode("warm-up"))
        log.info("warm-up took %.1f s", time.perf_counter() - start)

    def _blocks_that_fit(self) -> int:
        per_block = ModelRunner.bytes_per_block(self.model, self.config.block_size)
        if self.platform.name == "cpu":
            budget = self.config.kv_cache_memory_gb * 2**30
        else:
            device_module = getattr(torch, self.platform.name)
            free, total = device_module.mem_get_info(self.platform.device)
            budget = free - total * (1 - self.config.gpu_memory_utilization)
        blocks = int(budget // per_block) - 1  # the runner adds a scratch block
        if blocks < 1:
            raise ValueError("no memory left for the KV cache: raise gpu_memory_utilization or kv_cache_memory_gb")
        return blocks

    # -- requests ---------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            # A prompt rendered by a chat template carries its own BOS: don't add a second one.
            bos = self.tokenizer.bos_token
            special = not (bos and prompt.startswith(bos))
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=special) if prompt else []
        return None, list(prompt)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None) -> str:
        """Queue a request; raises ValueError (naming the problem) for one that could never run."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {limit}, which leaves no room to generate")
        max_tokens = params.max_tokens or limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({limit})"
            )
        if -(-(len(ids) + max_tokens) // self.config.block_size) > self.kv.num_blocks:
            raise ValueError(f"prompt + max_tokens needs more KV blocks than the cache has ({self.kv.num_blocks})")

        children = [
            Request(f"{request_id}" if params.n == 1 else f"{request_id}#{i}", ids, params.for_child(i), max_tokens,
                    self.eos_token_ids)
            for i in range(params.n)
        ]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, c.params) for c in children]
        group = _Group(request_id, text, children, detoks)
        self.groups[request_id] = group
        for index, child in enumerate(children):
            self._owner[id(child)] = (group, index)
            self.scheduler.add(child)
            self._num_prompt += len(ids)
        return request_id

    def abort_request(self, request_id: str, emit_output: bool = True) -> None:
        """Stop a request now and free its blocks; its final output (finish_reason "abort") comes from the next step."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for child in group.children:
            if not child.finished:
                self.scheduler.remove(child)
                child.finish("abort")
            self._owner.pop(id(child), None)
        if emit_output:
            self._aborted.append(group.output())

    # -- profiling --------------------------------------------------------------------------------

    def start_profile(self) -> None:
        """Start a capture (trace + step breakdown) into config.profile_dir; see backend/engine/profiler.py."""
        self._configured_profiler().start()

    def stop_profile(self) -> ProfileResult:
        """End the capture: writes the trace and the breakdown table, and returns them."""
        return self._configured_profiler().stop()

    def _configured_profiler(self) -> Profiler:
        if self.profiler is None:
            raise ValueError("profiling is off: set the profile_dir engine argument to the directory for traces")
        return self.profiler

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._aborted)

    # -- the step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; outputs of the requests that changed."""
        start = time.perf_counter()
        with scope("step"):
            outputs, self._aborted = self._aborted, []
            with scope("schedule"):
                scheduled = self.scheduler.schedule()
            if scheduled:
                outputs += self._run(scheduled)
        if scheduled and self.profiler is not None and self.profiler.active:
            decode_tokens = sum(1 for s in scheduled if s.num_new_tokens == 1)
            self.profiler.step_done(sum(s.num_new_tokens for s in scheduled) - decode_tokens, decode_tokens,
                                    time.perf_counter() - start)
        return outputs

    def _run(self, scheduled) -> list[RequestOutput]:
        outputs = []
        chunks = [
            SequenceChunk(
                s.request.token_ids[s.request.num_computed_tokens : s.request.num_computed_tokens + s.num_new_tokens],
                s.request.num_computed_tokens,
                s.request.block_ids,
                s.wants_logits,
            )
            for s in scheduled
        ]
        try:
            logits = self.runner.execute(chunks)
        except Exception as e:
            failed = list(dict.fromkeys(self._owner[id(s.request)][0].request_id for s in scheduled))
            for request_id in failed:
                self.abort_request(request_id, emit_output=False)
            raise StepError(failed, e) from e
        sampling = [s.request for s, chunk in zip(scheduled, chunks) if chunk.wants_logits]
        self.scheduler.advance(scheduled)
        self._account(scheduled)

        touched: dict[str, _Group] = {}
        if sampling:
            with scope("sample"):
                result = sample(logits, sampling)
            for row, request in enumerate(sampling):
                self._append_token(request, result.token_ids[row], result.logprobs[row], result.sampled_logprobs[row])
                group = self._owner[id(request)][0]
                touched[group.request_id] = group
        for group in touched.values():
            with scope("detokenize"):  # the output takes each sequence's new text from its detokenizer
                outputs.append(group.output())
            if group.finished:
                del self.groups[group.request_id]
                for child in group.children:
                    self._owner.pop(id(child), None)
        return outputs

    def _append_token(self, request: Request, token: int, logprobs, sampled_logprob: float) -> None:
        request.token_ids.append(token)
        self._num_generated += 1
        if request.first_token_time is None:
            request.first_token_time = time.time()
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
            request.cumulative_logprob += sampled_logprob
        group, index = self._owner[id(request)]
        detok = group.detokenizers[index]
        can_stop = request.num_output_tokens >= request.params.min_tokens
        if can_stop and token in request.stop_token_ids:
            if request.params.include_stop_str_in_output:
                with scope("detokenize"):
                    detok.add_token(token)
            request.finish("stop", None if token in self.eos_token_ids and not request.params.ignore_eos else token)
        else:
            with scope("detokenize"):
                stop_string = detok.add_token(token)
            if can_stop and stop_string is not None:
                request.finish("stop", stop_string)
            elif request.num_output_tokens >= request.max_tokens or len(request.token_ids) >= self.config.max_model_len:
                request.finish("length")
        if request.finished:
            self.scheduler.remove(request)

    def _account(self, scheduled) -> None:
        self._num_steps += 1
        self._num_computed += sum(s.num_new_tokens for s in scheduled)
        running = self.scheduler.running
        allocated = sum(len(r.block_ids) for r in running) * self.config.block_size
        used = sum(r.num_computed_tokens for r in running)
        self._waste_sum += 1 - used / allocated if allocated else 0.0

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_hit_rate=self.kv.prefix_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_computed_tokens=self._num_computed,
            num_prompt_tokens=self._num_prompt,
            num_generation_tokens=self._num_generated,
            num_steps=self._num_steps,
            kv_cache_waste=self._waste_sum / self._num_steps if self._num_steps else 0.0,
            num_kv_blocks=self.kv.num_blocks,
        )


class LLM:
    """Offline batch generation: LLM(model=...).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str | None = None, **engine_args):
        if model is not None:
            engine_args["model"] = model
        self.engine = LLMEngine(EngineConfig(**engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def start_profile(self) -> None:
        self.engine.start_profile()

    def stop_profile(self) -> ProfileResult:
        return self.engine.stop_profile()

    def generate(
        self, prompts: PromptType | list[PromptType], sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Outputs in input order. A prompt is a string, a list of token ids or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        ids = [self.engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for output in self.engine.step():
                if output.finished:
                    done[output.request_id] = output
        return [done[i] for i in ids]

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": chat_prompt_ids(self.engine.tokenizer, c)} for c in conversations]
        return self.generate(prompts, sampling_params)
