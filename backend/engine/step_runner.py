"""The runner's side of a step (vLLM's execute_model and sample_tokens): scheduled requests in, a RunnerOutput out.

It builds each request's chunk, runs the forward pass (on every rank, with tensor parallelism), scores the prompt
tokens asked for, samples the next token of each request that reached its last known one, and verifies drafts
(speculative decoding: backend/engine/spec_decode/): where the sampled token is a request's first draft, the token
after it is sampled from the logits after the draft, as the request would be once the draft is its own, and so on
while the samples equal the drafts; after the last draft, that is the bonus token.

A failure is confined to the requests it belongs to, and reported, not acted on: a forward pass that raises fails
every request in it (RunnerOutput.error); a batch whose sampling raises is sampled a row at a time, and only the
rows that fail again fail their requests (RunnerOutput.failures). Forward passes failing MAX_FAILED_STEPS times in
a row mean the device, not a request, is broken: the engine stops, as vLLM's does on a device error.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from backend.engine.kv_cache import KVCacheManager
from backend.engine.outputs import Logprob
from backend.engine.request import Request
from backend.engine.runner import ModelRunner, PromptScoring, SequenceChunk, StepOutput
from backend.engine.sampler import SampledToken, sample
from backend.engine.scheduler import ScheduledRequest
from backend.engine.structured_outputs import grammars_ahead
from backend.engine.workers import RankFailedError
from npu_llm_kernels.timing import scope

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3


@dataclass
class RunnerOutput:
    """What one step computed, by sequence (child) request id."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)  # the token after each one's last known token
    # drafts verified: the tokens after the sampled one (each verified draft's next token, the last not a draft)
    bonus: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)  # the prompt tokens scored
    failures: dict[str, BaseException] = field(default_factory=dict)  # sequences whose sampling failed
    # sequences whose token after a verified draft failed: their failure, once the tokens before it are theirs (unless
    # those ended the sequence)
    bonus_failures: dict[str, BaseException] = field(default_factory=dict)
    error: BaseException | None = None  # the forward pass failed: so did every scheduled request
    device_error: RuntimeError | None = None  # and it failed MAX_FAILED_STEPS times in a row: the engine stops
    forward: StepOutput | None = None  # the forward pass's output (the drafter's pass reads its hidden states)
    starts: list[int] = field(default_factory=list)  # each scheduled request's num_computed_tokens before the step
    # each scheduled request's block table as the step ran it (still there for a request the step finished and freed)
    tables: list[list[int]] = field(default_factory=list)


class StepRunner:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, drafting: bool):
        self.runner, self.kv, self.drafting = runner, kv, drafting
        self._failed_steps = 0  # forward passes that failed in a row

    def execute_and_sample(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        output = RunnerOutput(starts=[s.request.num_computed_tokens for s in scheduled])
        chunks = [self._chunk(s) for s in scheduled]
        output.tables = [c.block_ids for c in chunks]
        try:
            output.forward = forward = self.runner.execute(chunks)
        except RankFailedError:
            raise  # without every rank no step can run: the engine stops
        except Exception as e:
            log.exception("forward pass failed")
            output.error = e
            self._failed_steps += 1
            if self._failed_steps >= MAX_FAILED_STEPS:  # the device, not a request: the engine stops
                output.device_error = RuntimeError(f"{self._failed_steps} forward passes in a row failed; last: {e!r}")
                output.device_error.__cause__ = e
            return output
        self._failed_steps = 0
        output.prompt_logprobs = {s.request.request_id: scored for s, scored in zip(scheduled, forward.prompt_logprobs)
                                  if scored is not None}
        wanting = [s for s in scheduled if s.wants_logits]
        output.sampled = self._sample([s.request for s in wanting], forward.logits,
                                      [s.drafts[0] if s.drafts else None for s in wanting], output.failures)
        if self.drafting:
            self._verify_drafts(scheduled, forward, output)
        return output

    def _chunk(self, s: ScheduledRequest) -> SequenceChunk:
        request, start = s.request, s.request.num_computed_tokens
        chunk = SequenceChunk(request.token_ids[start : start + s.num_new_tokens - s.num_drafts] + list(s.drafts),
                              start, self.kv.block_ids(request), s.wants_logits, self._prompt_scoring(s), s.num_drafts,
                              request.lora_request)
        if (mm := request.mm_inputs) is not None:  # (a vision-language model's: this chunk's share of its images)
            stop = start + s.num_new_tokens
            chunk.positions = mm.positions_of(start, stop)
            chunk.images = mm.images_in(start, stop)
        return chunk

    @staticmethod
    def _prompt_scoring(s: ScheduledRequest) -> PromptScoring | None:
        """The prompt tokens this chunk scores: those its positions predict that have no logprob yet (so that a
        recomputation after preemption does not score them twice)."""
        request = s.request
        if request.params.prompt_logprobs is None:
            return None
        # position p predicts token p + 1: this chunk's positions that predict an unscored prompt token
        first = max(request.num_computed_tokens, request.num_scored_prompt_tokens - 1)
        last = min(request.num_computed_tokens + s.num_new_tokens, request.num_prompt_tokens - 1) - 1
        if first > last:
            return None
        return PromptScoring(first - request.num_computed_tokens, request.token_ids[first + 1 : last + 2],
                             request.params.prompt_logprobs)

    def _verify_drafts(self, scheduled: list[ScheduledRequest], forward: StepOutput, output: RunnerOutput) -> None:
        """Each request whose sampled token is its first draft: the token after each verified draft, position by
        position, while the samples equal the drafts (output.bonus). forward.draft_logits holds the logits after
        each draft, chunk after chunk."""
        alive, row = [], 0  # (request's scheduled entry, its first row of draft logits) while its drafts hold
        for s in scheduled:
            if s.num_drafts:  # (a drafted chunk is a decode: it always wants logits)
                token = output.sampled.get(s.request.request_id)
                if token is not None and token.token_id == s.drafts[0]:
                    alive.append((s, row))
                row += s.num_drafts
        position = 0  # the draft whose next token is sampled, counted from 0
        while alive:
            requests = [s.request for s, _ in alive]
            logits = forward.draft_logits[torch.tensor([row + position for _, row in alive])]
            drafts = [s.drafts[position + 1] if position + 1 < s.num_drafts else None for s, _ in alive]
            ahead = [[output.sampled[r.request_id].token_id] + [t.token_id for t in output.bonus.get(r.request_id, ())]
                     for r in requests]
            with grammars_ahead(requests, ahead):  # (constrained rows: masked as after the drafts kept)
                sampled = self._sample(requests, logits, drafts, output.bonus_failures, ahead)
            still = []
            for (s, row), draft in zip(alive, drafts):
                token = sampled.get(s.request.request_id)
                if token is not None:
                    output.bonus.setdefault(s.request.request_id, []).append(token)
                    if token.token_id == draft:
                        still.append((s, row))
            alive, position = still, position + 1

    @staticmethod
    def _sample(requests: list[Request], logits, drafts: list[int | None] | None,
                failures: dict[str, BaseException], ahead: list[list[int]] | None = None) -> dict[str, SampledToken]:
        """Sequence request id -> its sampled token, a row of logits each (see sampler.sample for drafts and ahead).
        If the batch fails, each row is sampled alone, and only the rows that fail again are failures."""
        if not requests:
            return {}
        drafts, ahead = drafts or [None] * len(requests), ahead or [[]] * len(requests)
        with scope("sample"):
            # a failed batch may have drawn from seeded generators: rewind them, so seeded samples stay the same
            seeded = [(r.generator, r.generator.get_state()) for r in requests if r.generator is not None]
            try:
                return {r.request_id: token for r, token in zip(requests, sample(logits, requests, drafts, ahead))}
            except Exception:
                log.exception("sampling a batch failed; sampling its rows one by one")
            for generator, state in seeded:
                generator.set_state(state)
            sampled = {}
            for row, request in enumerate(requests):
                try:
                    [sampled[request.request_id]] = sample(logits[row : row + 1], [request], drafts[row : row + 1],
                                                           ahead[row : row + 1])
                except Exception as e:
                    failures[request.request_id] = e
            return sampled
