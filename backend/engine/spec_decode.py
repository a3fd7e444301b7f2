"""Speculative decoding with the checkpoint's multi-token-prediction layer (vLLM's "deepseek_mtp", one token).

A step verifies each decode's draft: the scheduler runs it after the last known token, so the step computes the
logits after both. The token sampled after the last known one keeps the draft with probability p(draft)
(sampler.sample: rejection sampling of a one-hot draft, whose result is distributed as p); where it equals the
draft, the draft's position holds, and a second token is sampled from the logits after it. Greedy requests keep a
draft exactly when it is their argmax, so their tokens are those of decoding without drafts.

Then the MTP layer (backend/models/mtp.py) runs over every position the step computed and kept, prompt chunks
included, so its own KV cache follows the target's, and drafts the next token of each request that decodes next.
A draft never changes the distribution of what is sampled, only how many tokens a step yields: a stale or poor
draft costs speed alone. (Seeded samples do differ from a run without drafts: keeping a draft takes a draw from the
request's generator. Greedy tokens are the same up to rounding: a verify chunk's attention is computed as a short
prefill chunk.) Requests with a grammar are not drafted for (the draft would have to pass their matcher first).

The counts are vLLM's spec-decode metrics (vllm:spec_decode_*).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from backend.engine.kv_cache import KVCacheManager
from backend.engine.request import Request
from backend.engine.runner import DraftChunk, ModelRunner, StepOutput
from backend.engine.sampler import SampledToken
from backend.engine.scheduler import ScheduledRequest, Scheduler
from backend.engine.step_runner import RunnerOutput

log = logging.getLogger(__name__)


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps of a request, each with its drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=lambda: [0])  # accepted at draft position k

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.num_accepted_tokens_per_pos))


class MTPDrafter:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager):
        self.runner, self.kv = runner, kv
        self.stats = SpecDecodeStats()

    def record(self, scheduled: list[ScheduledRequest], sampled: dict[str, SampledToken]) -> None:
        """Count the step's drafts, and those its sampled tokens verified."""
        for s in scheduled:
            if s.num_drafts:
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += s.num_drafts
                token = sampled.get(s.request.request_id)
                if token is not None and token.token_id == s.drafts[0]:
                    self.stats.num_accepted_tokens += 1
                    self.stats.num_accepted_tokens_per_pos[0] += 1

    def accept(self, scheduler: Scheduler, scheduled: list[ScheduledRequest], result: RunnerOutput,
               advanced: list[Request], new_tokens: dict[str, list[SampledToken]],
               fail_sequence: Callable[[Request, BaseException], None]) -> None:
        """After the scheduler took the step's sampled tokens (advanced: the requests that got one): the step's
        drafts counted; the token after each verified draft joins its request, unless the draft ended it (or its
        sampling failed: that fails the request); then the MTP layer drafts the next token of each."""
        self.record(scheduled, result.sampled)
        for request in advanced:
            if request.request_id in result.bonus_failures and not request.finished:
                fail_sequence(request, result.bonus_failures[request.request_id])
        verified = [r for r in advanced if r.request_id in result.bonus and not r.finished]  # (a sibling's failure ends it)
        scheduler.accept_drafts(verified, {r.request_id: result.bonus[r.request_id].token_id for r in verified})
        for request in verified:
            new_tokens[request.request_id].append(result.bonus[request.request_id])
        self.draft(scheduled, result.starts, result.forward)

    def draft(self, scheduled: list[ScheduledRequest], starts: list[int], step: StepOutput) -> None:
        """The MTP pass over what each scheduled request computed and kept this step (from starts[i] on); the next
        token drafted for each that decodes next."""
        chunks, drafting = [], []
        for s, start, first_row in zip(scheduled, starts, step.first_rows):
            request = s.request
            request.draft_token_ids = []
            kept = request.num_computed_tokens - start
            if request.finished or kept <= 0:
                continue
            wants = (request.grammar is None and request.num_computed_tokens == len(request.token_ids) - 1
                     and request.num_output_tokens + 1 < request.max_tokens)  # room for the draft and one more
            chunks.append(DraftChunk(request.token_ids[start + 1:start + kept + 1], start, self.kv.block_ids(request),
                                     list(range(first_row, first_row + kept)), wants))
            if wants:
                drafting.append(request)
        if not chunks:
            return
        try:
            drafts = self.runner.draft(chunks, step.hidden)
        except Exception:  # a draft is an optimisation: without one the requests decode a token a step
            log.exception("the MTP draft pass failed; this step drafts nothing")
            return
        for request, token in zip(drafting, drafts):
            request.draft_token_ids = [token]
