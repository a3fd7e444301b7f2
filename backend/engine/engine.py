"""LLMEngine: add_request / abort_request / step, as in vLLM: the step loop. Its parts keep their own jobs, where
vLLM v1 keeps them: start-up, KV sizing and warm-up (startup.py), input processing (input_processor.py), the
forward pass and sampling (step_runner.py), the grammars' lifecycle (structured_outputs.py), text and outputs
(output_processor.py), the stats (stats.py), the ranks (executor.py).

A step is four calls: schedule, execute and sample, update from the output, process the outputs. A failure is
confined to the requests it belongs to: a forward pass that raises fails the requests in it, a sample, detokenize
or stop check that raises fails its own request, and the rest of the batch goes on. Failed requests are aborted
(their blocks freed) and reported by take_failures().
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.distributed import SINGLE
from backend.engine import startup
from backend.engine.executor import start_workers
from backend.engine.image_inputs import ImageProcessor
from backend.engine.input_processor import InputProcessor, PromptType
from backend.engine.kv_cache import KVCacheManager
from backend.engine.kv_transfer.connector import KVConnector, create_connector
from backend.engine.lora_request import LoRARequest
from backend.engine.output_processor import OutputProcessor
from backend.engine.profiler import ProfileResult, Profiler
from backend.engine.outputs import RequestOutput
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import ScheduledRequest, Scheduler
from backend.engine.spec_decode import make_drafter
from backend.engine.stats import EngineInfo, EngineStats, collect_stats
from backend.engine.step_runner import RunnerOutput, StepRunner
from backend.engine.structured_outputs import StructuredOutputs
from backend.models.llama import check_model
from backend.models.loader import load_config, max_model_len_of
from backend.models.registry import resolve_model
from backend.platform import resolve_platform, tune_host_allocator
from npu_llm_kernels.timing import scope

log = logging.getLogger(__name__)

# An idle step waits this long for a grammar being compiled, instead of spinning.
GRAMMAR_WAIT_S = 0.01


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **engine_args):
        self.config = config = config or EngineConfig(**engine_args)
        self.platform = resolve_platform(config.device)
        tune_host_allocator()
        torch.manual_seed(config.seed)
        model_dir = resolve_model(config.model)
        model_config = load_config(model_dir)
        config.finalize(self.platform.name, max_model_len_of(model_config))
        check_model(model_config, config.tensor_parallel_size, config.enable_expert_parallel)
        tp, workers = SINGLE, None
        if config.tensor_parallel_size > 1:  # the other ranks start now, and load their shards alongside ours
            tp, workers = start_workers(config, self.platform.device)
        try:
            self._start(model_dir, tp, workers)
        except BaseException:
            if workers is not None:  # no worker outlives a start that failed
                workers.stop(graceful=False)
            if getattr(self, "kv_connector", None) is not None:  # nor the connector's side channel and threads
                self.kv_connector.shutdown()
            raise
        # What the engine holds outside this process's heap, released by shutdown() or, failing that, when the
        # engine is collected or the interpreter exits. The finalizer holds those resources, never the engine
        # itself (which it would then keep alive).
        runner = self.runner.runner if workers is not None else self.runner
        self._finalizer = weakref.finalize(self, startup.release, workers, runner, self.kv_connector,
                                           self.draft_runner)

    def _start(self, model_dir, tp, workers) -> None:
        """Load, size and allocate (backend/engine/startup.py), build the scheduler and what a step uses, warm up."""
        config, spec = self.config, self.config.speculative
        started = startup.start(config, self.platform, model_dir, tp, workers)
        self.model, self.model_config, self.model_dir = started.model, started.model_config, started.model_dir
        self.tokenizer, self.eos_token_ids = started.tokenizer, started.eos_token_ids
        self.runner, self.memory_split = started.runner, started.memory_split
        self.draft_runner = started.draft_runner  # speculative decoding with a draft model: its model and KV
        self.kv = KVCacheManager(started.num_blocks, config.block_size, config.enable_prefix_caching)
        # disaggregated prefill or a KV pool: the connector's two sides (backend/engine/kv_transfer/), both in this
        # process
        self.kv_connector: KVConnector | None = None
        if (transfer := config.kv_transfer) is not None:
            self.kv_connector = create_connector(transfer, config.block_size, self.platform.name,
                                                 Path(config.model).name, self.model_dir, config.quantization)
            self.kv_connector.register_kv_caches(self.runner.kv_caches)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            recompute_last_hit=spec is not None and spec.drafts_from_hidden_states, connector=self.kv_connector,
            max_loras=config.max_loras if config.enable_lora else None,
        )
        # speculative decoding: a proposer drafts after each step, the next verifies (backend/engine/spec_decode/)
        self.drafter = None if spec is None else make_drafter(spec, self.runner, self.draft_runner, self.kv)
        self.step_runner = StepRunner(self.runner, self.kv, drafting=self.drafter is not None)
        images = ImageProcessor(self.model_dir, self.model_config.vision_language, config.image_limit) \
            if self.model.is_multimodal else None
        self.inputs = InputProcessor(config, self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                     started.num_blocks, self.runner.add_lora if config.enable_lora else None, images)
        self.outputs = OutputProcessor(self.tokenizer)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self._aborted: list[RequestOutput] = []
        self._failures: dict[str, BaseException] = {}  # request id -> why it failed, until take_failures()
        self.iteration_tokens = self.scheduler.iteration_tokens  # (for vllm:iteration_tokens_total)
        self._ids = itertools.count()
        self.profiler = Profiler(self.platform, config.profile_dir) if config.profile_dir else None
        startup.warm_up(started, config)
        self.model.init_expert_load()  # (counting from here: warm-up's tokens are not served ones)
        startup.log_ready(started, config, self.platform)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if there are any), leave their process group, and free the KV cache.
        The engine takes no requests after; calling it again does nothing."""
        self._finalizer()

    def _check_running(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("the engine has been shut down")

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request (run with `lora_request`'s adapter, if given); raises ValueError (naming the problem) for
        one that could never run."""
        self._check_running()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        # (a prefill held for a consumer, or a request aborted mid-pull, keeps its id's blocks for a while)
        taken = self.outputs.states.keys() | self.scheduler.sending.keys() | self.scheduler.loading.keys()
        if request_id in self.outputs.parents or any(c in taken for c in child_ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            text, children = self.inputs.process(child_ids, prompt, params, lora_request)
        except ValueError:
            # a remote prefill refused here (prompt + max_tokens too long, ...): its producer would hold the blocks
            # until its timeout, and a client repeating it could pin them all
            if self.kv_connector is not None and (refused := self.inputs.refused_pull(prompt, params)):
                self.kv_connector.release_refused(*refused)
            raise
        if params.structured_outputs is not None:
            self.structured_outputs.add(children, params.structured_outputs)
        self.outputs.add(request_id, text, children)
        for child in children:
            self.scheduler.add(child)
        return request_id

    # -- adapters (vLLM's LLMEngine.add_lora / remove_lora / list_loras) ----------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check the adapter now (ValueError naming what is wrong) and keep it loaded."""
        self._check_running()
        self.inputs.check_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a loaded adapter; whether it was loaded. Requests running with it go on: a step that needs it reads
        its folder again, as vLLM's workers do (so the folder must stay while they run)."""
        self._check_running()
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need an engine started with enable_lora")
        loaded = lora_int_id in self.list_loras()
        self.runner.remove_lora(lora_int_id)
        return loaded

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded (in host memory or in a slot)."""
        lora = self.runner.lora
        return set() if lora is None else set(lora.cpu) | set(lora.slots)

    def abort_request(self, request_id: str, emit_output: bool = True) -> RequestOutput | None:
        """Stop a request now and free its blocks. Returns its final output (finish_reason "abort"), which the
        next step also emits unless emit_output is False; None for an unknown or finished request."""
        parent = self._discard(request_id)
        if parent is None:
            return None
        output = parent.output()
        if emit_output:
            self._aborted.append(output)
        return output

    def _discard(self, request_id: str):
        """Finish a user request's unfinished sequences as aborted, free their blocks, forget it."""
        parent = self.outputs.pop(request_id)
        for state in parent.states if parent else ():
            if not state.request.finished:
                self.scheduler.finish(state.request, "abort")
        return parent

    def take_failures(self) -> dict[str, BaseException]:
        """Requests that failed since the last call (already aborted, blocks freed), with the error of each."""
        failures, self._failures = self._failures, {}
        return failures

    def _fail_sequence(self, request: Request, error: BaseException) -> None:
        """One sequence failed: its whole user request fails (once, however many of its sequences fail)."""
        if request.request_id in self.outputs.states:
            self._fail(self.outputs.parent_of(request).request_id, error)

    def _fail(self, request_id: str, error: BaseException) -> None:
        log.error("request %s failed: %r", request_id, error)
        self._discard(request_id)  # no output: building it may be what failed
        self._failures[request_id] = error

    # -- profiling --------------------------------------------------------------------------------

    def start_profile(self) -> None:
        """Start a capture (trace + step breakdown) into config.profile_dir; see backend/engine/profiler.py."""
        self._configured_profiler().start(self.model.expert_load())

    def stop_profile(self) -> ProfileResult:
        """End the capture: writes the trace and the breakdown table, and returns them."""
        return self._configured_profiler().stop(self.model.expert_load())

    def _configured_profiler(self) -> Profiler:
        if self.profiler is None:
            raise ValueError("profiling is off: set the profile_dir engine argument to the directory for traces")
        return self.profiler

    def has_unfinished_requests(self) -> bool:
        """Requests to step, or KV transfers to see through (a prefill's blocks held for a consumer)."""
        return bool(self.outputs.parents) or bool(self._aborted) or self.scheduler.has_pending_transfers

    # -- the step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, execute and sample, update from the output, process the outputs (vLLM's EngineCore.step);
        the outputs of the requests that changed."""
        self._check_running()
        started = time.perf_counter()
        with scope("step"):
            scheduled = self._schedule()
            result = self.step_runner.execute_and_sample(scheduled) if scheduled else None
            new_tokens = self._update_from_output(scheduled, result)
            outputs = self._process_outputs(new_tokens)
        self._after_step(scheduled, started)
        return outputs

    def _schedule(self) -> list[ScheduledRequest]:
        """Requests whose grammar failed to compile fail; the scheduler picks the step; the connector starts pulling
        the KV of the requests it admitted for that."""
        self.structured_outputs.fail_bad_grammars(self._fail_sequence)
        with scope("schedule"):
            scheduled = self.scheduler.schedule()
        if self.kv_connector is not None:
            self.kv_connector.start_load_kv(self.kv_connector.build_connector_meta())
        return scheduled

    def _update_from_output(self, scheduled: list[ScheduledRequest], result: RunnerOutput | None) -> dict:
        """The requests' and the scheduler's state after the step: what failed fails, prompt logprobs are kept,
        grammars take their tokens, each sequence gets its token (and those after its verified drafts), the drafter
        drafts the next, and the KV transfers that ended are settled. Returns each sequence's new tokens, in order."""
        new_tokens = {}
        if result is not None:
            self._fail_from(scheduled, result)
            for request_id, entries in result.prompt_logprobs.items():
                if request_id in self.outputs.states:
                    self.outputs.states[request_id].add_prompt_logprobs(entries)
            self.structured_outputs.accept(scheduled, result.sampled, self._fail_sequence)
            advanced = self.scheduler.update_from_output(scheduled, {i: t.token_id for i, t in result.sampled.items()})
            new_tokens = {r.request_id: [result.sampled[r.request_id]] for r in advanced}
            if self.drafter is not None and result.forward is not None:
                self.drafter.accept(self.scheduler, scheduled, result, advanced, new_tokens, self._fail_sequence)
            self.scheduler.record_step(scheduled, sum(len(tokens) for tokens in new_tokens.values()))
        if self.kv_connector is not None:  # (a pull the producer refused fails its request)
            for request, error in self.scheduler.end_transfers(stepped=bool(scheduled)):
                self._fail_sequence(request, error)
        return new_tokens

    def _fail_from(self, scheduled: list[ScheduledRequest], result: RunnerOutput) -> None:
        """A forward pass that raised fails every user request in it (and one that keeps failing stops the engine);
        a sample that did, its own."""
        if result.error is not None:
            for parent_id in dict.fromkeys(self.outputs.parent_of(s.request).request_id for s in scheduled):
                self._fail(parent_id, result.error)
            if result.device_error is not None:
                raise result.device_error
        requests = {s.request.request_id: s.request for s in scheduled}
        for request_id, error in result.failures.items():
            self._fail_sequence(requests[request_id], error)

    def _process_outputs(self, new_tokens: dict) -> list[RequestOutput]:
        """Text and stop strings (the output processor), then one output per user request that changed: those
        aborted since the last step first."""
        aborted, self._aborted = self._aborted, []
        return aborted + self.outputs.process(new_tokens, self.scheduler.finish_at_stop_string, self._fail_sequence,
                                              self._fail)

    def _after_step(self, scheduled: list[ScheduledRequest], started: float) -> None:
        """With nothing to run, wait for a grammar being compiled (if any) instead of spinning; profile the step."""
        if not scheduled:
            self.structured_outputs.wait_while_compiling(GRAMMAR_WAIT_S)
        elif self.profiler is not None and self.profiler.active:
            # (a decode verifying drafts counts as a decode of its k + 1 tokens)
            decode_tokens = sum(s.num_new_tokens for s in scheduled if s.num_new_tokens - s.num_drafts == 1)
            self.profiler.step_done(sum(s.num_new_tokens for s in scheduled) - decode_tokens, decode_tokens,
                                    time.perf_counter() - started)

    def stats(self) -> EngineStats:
        return collect_stats(self.scheduler, self.kv, self.model, self.drafter, self.kv_connector)

    def engine_info(self) -> EngineInfo:
        return EngineInfo(str(self.platform.device), self.platform.name, self.kv.num_blocks,
                          str(self.model.dtype).removeprefix("torch."))

    def unfinished_ids(self) -> list[str]:
        """The user requests not finished yet."""
        return list(self.outputs.parents)

