"""LLMEngine: add_request / abort_request / step, as in vLLM: the step loop. Its parts keep their own jobs, where
vLLM v1 keeps them: start-up, KV sizing and warm-up (startup.py), input processing (input_processor.py), the
grammars' lifecycle (structured_outputs.py), the stats' counters (scheduler.py), the ranks (executor.py).

A step is schedule -> execute -> sample -> update. A failure is confined to the requests it
belongs to: a forward pass that raises fails the requests in it, a sample, detokenize or
stop check that raises fails its own request, and the rest of the batch goes on. Failed
requests are aborted (their blocks freed) and reported by take_failures().
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field

import torch

from backend.config import EngineConfig
from backend.distributed import SINGLE
from backend.engine import startup
from backend.engine.executor import start_workers
from backend.engine.input_processor import InputProcessor, PromptType
from backend.engine.kv_cache import KVCacheManager
from backend.engine.kv_transfer.connector import KVConnector, TransferStats, create_connector
from backend.engine.output_processor import OutputProcessor
from backend.engine.profiler import ProfileResult, Profiler
from backend.engine.outputs import RequestOutput
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.runner import ModelRunner, PromptScoring, SequenceChunk, StepOutput
from backend.engine.sampler import SampledToken, sample
from backend.engine.scheduler import ScheduledRequest, Scheduler
from backend.engine.spec_decode import MTPDrafter, SpecDecodeStats
from backend.engine.structured_outputs import StructuredOutputs
from backend.engine.workers import RankFailedError
from backend.models.llama import check_model
from backend.models.loader import load_config, max_model_len_of
from backend.models.registry import resolve_model
from backend.platform import resolve_platform, tune_host_allocator
from npu_llm_kernels.timing import scope

log = logging.getLogger(__name__)

# An idle step waits this long for a grammar being compiled, instead of spinning.
GRAMMAR_WAIT_S = 0.01

# An idle step waits this long for a KV transfer to end (disaggregated prefill), instead of spinning.
TRANSFER_WAIT_S = 0.002

# Forward passes failing this many times in a row mean the device (not a request) is broken: the
# engine stops (AsyncEngine reports it dead), as vLLM's does on a device error.
MAX_FAILED_STEPS = 3


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
    expert_load: list[int] = field(default_factory=list)  # MoE: (token, expert) pairs served per rank
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding: drafts made and accepted
    kv_transfer: TransferStats | None = None  # with a KV connector: what it moved and held
    num_transferring: int = 0  # requests whose blocks a transfer holds: being pulled here, or kept for a consumer


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
        self._finalizer = weakref.finalize(self, _release, workers, runner, self.kv_connector)

    def _start(self, model_dir, tp, workers) -> None:
        """Load, size and allocate (backend/engine/startup.py), build the scheduler and what a step uses, warm up."""
        config = self.config
        started = startup.start(config, self.platform, model_dir, tp, workers)
        self.model, self.model_config, self.model_dir = started.model, started.model_config, started.model_dir
        self.tokenizer, self.eos_token_ids = started.tokenizer, started.eos_token_ids
        self.runner, self.memory_split = started.runner, started.memory_split
        self.kv = KVCacheManager(started.num_blocks, config.block_size, config.enable_prefix_caching)
        # disaggregated prefill: the connector's two sides (backend/engine/kv_transfer/), both in this process
        self.kv_connector: KVConnector | None = None
        if (transfer := config.kv_transfer) is not None:
            self.kv_connector = create_connector(transfer, config.block_size, self.platform.name)
            self.kv_connector.register_kv_caches(self.runner.kv_caches)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            drafting=config.speculative_config is not None, connector=self.kv_connector,
        )
        # speculative decoding: the checkpoint's MTP layer drafts a token a step (spec_decode.py)
        self.drafter = MTPDrafter(self.runner, self.kv) if config.speculative_config is not None else None
        self.inputs = InputProcessor(config, self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                     started.num_blocks)
        self.outputs = OutputProcessor(self.tokenizer)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self._aborted: list[RequestOutput] = []
        self._failures: dict[str, BaseException] = {}  # request id -> why it failed, until take_failures()
        self._failed_steps = 0  # forward passes that failed in a row
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

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None) -> str:
        """Queue a request; raises ValueError (naming the problem) for one that could never run."""
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
        text, children = self.inputs.process(child_ids, prompt, params)
        if params.structured_outputs is not None:
            self.structured_outputs.add(children, params.structured_outputs)
        self.outputs.add(request_id, text, children)
        for child in children:
            self.scheduler.add(child)
        return request_id

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
        """Schedule, run the model once, sample, update; outputs of the requests that changed."""
        self._check_running()
        start = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        self.structured_outputs.fail_bad_grammars(self._fail_sequence)
        with scope("step"):
            with scope("schedule"):
                scheduled = self.scheduler.schedule()
            if self.kv_connector is not None:
                self.kv_connector.start_load_kv(self.kv_connector.build_connector_meta())
            if scheduled:
                starts = [s.request.num_computed_tokens for s in scheduled]
                step = self._execute(scheduled)
                sampled = self._sample_next(scheduled, step.logits) if step is not None else {}
                self.structured_outputs.accept(scheduled, sampled, self._fail_sequence)
                advanced = self.scheduler.update_from_output(scheduled, {i: s.token_id for i, s in sampled.items()})
                touched = self._detokenize(advanced, sampled)
                num_generated = len(advanced)
                if self.drafter is not None and step is not None:
                    num_generated += self._take_verified_drafts(scheduled, step, sampled, touched)
                    self.drafter.draft(scheduled, starts, step)
                self.scheduler.record_step(scheduled, num_generated)
                outputs += self._outputs_of(touched)
            if self.kv_connector is not None:
                self._end_transfers(bool(scheduled))
        if not scheduled:  # nothing else to run: wait for a grammar being compiled, if any, instead of spinning
            self.structured_outputs.wait_while_compiling(GRAMMAR_WAIT_S)
        if scheduled and self.profiler is not None and self.profiler.active:
            decode_tokens = sum(1 for s in scheduled if s.num_new_tokens == 1)
            self.profiler.step_done(sum(s.num_new_tokens for s in scheduled) - decode_tokens, decode_tokens,
                                    time.perf_counter() - start)
        return outputs

    def _end_transfers(self, stepped: bool) -> None:
        """After the forward pass: the connector's saves, then the transfers that ended (a pull the producer refused
        fails its request). A step with nothing to run waits a moment for them instead of spinning."""
        self.kv_connector.wait_for_save()
        if not stepped:
            time.sleep(TRANSFER_WAIT_S)
        for request, error in self.scheduler.update_from_connector(self.kv_connector.get_finished()):
            self._fail_sequence(request, error)

    def _execute(self, scheduled: list[ScheduledRequest]) -> StepOutput | None:
        """The forward pass: logits for the rows that want them; None (their requests failed) if it raises."""
        chunks = [
            SequenceChunk(
                s.request.token_ids[s.request.num_computed_tokens:
                                    s.request.num_computed_tokens + s.num_new_tokens - s.num_drafts] + list(s.drafts),
                s.request.num_computed_tokens,
                self.kv.block_ids(s.request),
                s.wants_logits,
                self._prompt_scoring(s),
                s.num_drafts,
            )
            for s in scheduled
        ]
        try:
            step = self.runner.execute(chunks)
        except RankFailedError:
            raise  # without every rank no step can run: the engine stops
        except Exception as e:
            log.exception("forward pass failed")
            for parent_id in dict.fromkeys(self.outputs.parent_of(s.request).request_id for s in scheduled):
                self._fail(parent_id, e)
            self._failed_steps += 1
            if self._failed_steps >= MAX_FAILED_STEPS:  # the device, not a request: stop the engine
                raise RuntimeError(f"{self._failed_steps} forward passes in a row failed; last: {e!r}") from e
            return None
        self._failed_steps = 0
        for s, scored in zip(scheduled, step.prompt_logprobs):
            if scored is not None:
                self.outputs.states[s.request.request_id].add_prompt_logprobs(scored)
        return step

    def _prompt_scoring(self, s: ScheduledRequest) -> PromptScoring | None:
        """The prompt tokens this chunk scores: those its positions predict that have no logprob yet (so that a
        recomputation after preemption does not score them twice)."""
        request = s.request
        if request.params.prompt_logprobs is None:
            return None
        scored = len(self.outputs.states[request.request_id].prompt_logprobs)  # the next prompt position to score
        # position p predicts token p + 1: this chunk's positions that predict an unscored prompt token
        first = max(request.num_computed_tokens, scored - 1)
        last = min(request.num_computed_tokens + s.num_new_tokens, request.num_prompt_tokens - 1) - 1
        if first > last:
            return None
        return PromptScoring(first - request.num_computed_tokens, request.token_ids[first + 1 : last + 2],
                             request.params.prompt_logprobs)

    def _sample_next(self, scheduled: list[ScheduledRequest], logits) -> dict[str, SampledToken]:
        """The token after each sequence's last known one (which keeps its draft, if it has one, with the draft's
        probability: spec_decode.py)."""
        wanting = [s for s in scheduled if s.wants_logits]
        return self._sample([s.request for s in wanting], logits, [s.drafts[0] if s.drafts else None for s in wanting])

    def _sample(self, requests: list[Request], logits, drafts: list[int | None] | None = None) -> dict[str, SampledToken]:
        """Sequence request id -> its sampled token, a row of logits each. If the batch fails, each row is sampled
        alone, and only the rows that fail again fail their requests."""
        if not requests:
            return {}
        drafts = drafts or [None] * len(requests)
        with scope("sample"):
            # a failed batch may have drawn from seeded generators: rewind them, so seeded samples stay the same
            seeded = [(r.generator, r.generator.get_state()) for r in requests if r.generator is not None]
            try:
                return {r.request_id: token for r, token in zip(requests, sample(logits, requests, drafts))}
            except Exception:
                log.exception("sampling a batch failed; sampling its rows one by one")
            for generator, state in seeded:
                generator.set_state(state)
            sampled = {}
            for row, request in enumerate(requests):
                try:
                    [sampled[request.request_id]] = sample(logits[row : row + 1], [request], drafts[row : row + 1])
                except Exception as e:
                    self._fail_sequence(request, e)
            return sampled

    def _take_verified_drafts(self, scheduled, step: StepOutput, sampled: dict[str, SampledToken], touched) -> int:
        """Each request whose sampled token verified its draft gets the token sampled after the draft too; returns
        how many did."""
        verified = self.drafter.verified(scheduled, sampled)
        if not verified:
            return 0
        requests = [request for request, _ in verified]
        bonus = self._sample(requests, step.draft_logits[torch.tensor([row for _, row in verified])])
        advanced = [r for r in requests if r.request_id in bonus and not r.finished]  # (a sibling's failure ends it)
        self.scheduler.accept_drafts(advanced, {i: t.token_id for i, t in bonus.items()})
        touched.update(self._detokenize(advanced, bonus))
        return len(advanced)

    def _detokenize(self, advanced: list[Request], sampled: dict[str, SampledToken]) -> dict:
        """Detokenize and check stop strings for each sequence that got a token; their user requests, by id."""
        touched = {}
        for request in advanced:
            if request.request_id not in self.outputs.states:
                continue  # a sibling's failure ended its user request
            parent = self.outputs.parent_of(request)
            try:
                stop_string = self.outputs.add_token(request, sampled[request.request_id])
                if stop_string is not None:
                    self.scheduler.finish(request, "stop", stop_string)
                touched[parent.request_id] = parent
            except Exception as e:
                self._fail_sequence(request, e)
        return touched

    def _outputs_of(self, touched: dict) -> list[RequestOutput]:
        """One output per user request that changed this step."""
        outputs = []
        for parent in touched.values():
            if parent.request_id not in self.outputs.parents:
                continue  # failed meanwhile (a sibling's error)
            try:
                outputs.append(parent.output())
            except Exception as e:
                self._fail(parent.request_id, e)
                continue
            if parent.finished:
                self.outputs.pop(parent.request_id)
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.loading) + len(self.scheduler.loaded),
            kv_cache_usage=self.kv.usage,
            prefix_cache_hit_rate=self.kv.prefix_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_computed_tokens=self.scheduler.num_computed_tokens,
            num_prompt_tokens=self.scheduler.num_prompt_tokens,
            num_generation_tokens=self.scheduler.num_generation_tokens,
            num_steps=self.scheduler.num_steps,
            kv_cache_waste=self.scheduler.kv_cache_waste,
            num_kv_blocks=self.kv.num_blocks,
            expert_load=self.model.expert_load(),
            spec_decode=None if self.drafter is None else self.drafter.stats.copy(),
            kv_transfer=None if self.kv_connector is None else self.kv_connector.stats.copy(),
            num_transferring=len(self.scheduler.loading) + len(self.scheduler.sending),
        )


def _release(workers, runner: ModelRunner, kv_connector: KVConnector | None) -> None:
    """An engine's shutdown (its finalizer): the workers and their process group first, then the KV connector (its
    threads, sockets and registrations), then rank 0's KV cache."""
    try:
        if workers is not None:
            workers.shutdown()
    finally:
        try:
            if kv_connector is not None:
                kv_connector.shutdown()
        finally:
            runner.release_kv_cache()
