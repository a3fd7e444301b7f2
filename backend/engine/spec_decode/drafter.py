"""What every speculative method shares: after a step, the tokens its verification kept join their requests, the
drafts are counted (vLLM's spec-decode metrics, vllm:spec_decode_*), and the proposer drafts each request's next
ones; the blocks the rejected drafts took go back.

A request is drafted for when it decodes next, at most as many tokens as max_tokens leaves it; with a grammar, the
drafts are cut at the first its matcher refuses (and before one that would complete it), and each kept token is
the matcher's before it joins the request. A proposer's failure costs speed alone: the step
drafts nothing and the requests decode a token a step.

Greedy requests keep a draft exactly when it is their argmax, so their tokens are those of decoding without drafts
(up to rounding: a verification's attention is computed as a short prefill chunk). Seeded samples do differ from a
run without drafts: keeping a draft takes a draw from the request's generator.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from backend.engine.kv_cache import KVCacheManager
from backend.engine.request import Request
from backend.engine.sampler import SampledToken
from backend.engine.scheduler import ScheduledRequest, Scheduler
from backend.engine.step_runner import RunnerOutput
from backend.engine.workers import RankFailedError

log = logging.getLogger(__name__)


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps of a request, each with its drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class KeptPositions:
    """One scheduled request after a step: it computed and kept positions start .. num_computed_tokens - 1."""

    request: Request
    start: int
    first_row: int | None  # with the step's hidden states: the row of position `start`
    num_wanted: int  # drafts to propose for its next step (0: it does not decode next)
    block_ids: list[int]  # its block table (of a request the step finished: as the step ran it, its blocks freed)


class Proposer(Protocol):
    # it keeps state per position (a KV cache of its own), so it runs over every kept position, drafting or not
    runs_every_position: bool

    def propose(self, kept: list[KeptPositions]) -> list[list[int]]:
        """Each request's drafts, at most num_wanted (a request wanting none may still need its positions run)."""


class Drafter:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, kv: KVCacheManager):
        self.proposer, self.k, self.kv = proposer, num_speculative_tokens, kv
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def accept(self, scheduler: Scheduler, scheduled: list[ScheduledRequest], result: RunnerOutput,
               advanced: list[Request], new_tokens: dict[str, list[SampledToken]],
               fail_sequence: Callable[[Request, BaseException], None]) -> None:
        """After the scheduler took the step's sampled tokens (advanced: the requests that got one): the drafts are
        counted; the tokens after each request's verified drafts join it until one ends it (a failure to sample
        one fails the request); then the proposer drafts."""
        self._record(scheduled, result)
        for request in advanced:
            for token in result.bonus.get(request.request_id, ()):
                if request.finished:  # (a stop, its length, or a sibling's failure ended it)
                    break
                if request.grammar is not None:
                    try:
                        request.grammar.accept(token.token_id)
                    except Exception as e:
                        fail_sequence(request, e)
                        break
                scheduler.accept_draft(request, token.token_id)
                new_tokens[request.request_id].append(token)
            # a token that failed to sample after those fails the request, unless they ended it first
            if request.request_id in result.bonus_failures and not request.finished:
                fail_sequence(request, result.bonus_failures[request.request_id])
        self._propose(scheduled, result)

    def _record(self, scheduled: list[ScheduledRequest], result: RunnerOutput) -> None:
        """Count the step's drafts, and those its samples verified (a draft holds while every one before it did)."""
        stats = self.stats
        for s in scheduled:
            if not s.num_drafts:
                continue
            stats.num_drafts += 1
            stats.num_draft_tokens += s.num_drafts
            first = result.sampled.get(s.request.request_id)
            tokens = [first] + result.bonus.get(s.request.request_id, []) if first is not None else []
            for position, draft in enumerate(s.drafts):
                if position >= len(tokens) or tokens[position].token_id != draft:
                    break
                stats.num_accepted_tokens += 1
                stats.num_accepted_tokens_per_pos[position] += 1

    def _propose(self, scheduled: list[ScheduledRequest], result: RunnerOutput) -> None:
        """Each request's next drafts (request.draft_token_ids), from the positions the step kept; then its blocks
        beyond those the next step needs are returned."""
        kept, finished, first_rows = [], [], result.forward.first_rows
        for i, (s, start) in enumerate(zip(scheduled, result.starts)):
            request = s.request
            request.draft_token_ids = []
            if request.num_computed_tokens <= start:
                continue
            first_row = first_rows[i] if first_rows is not None else None
            if request.finished:
                finished.append(KeptPositions(request, start, first_row, 0, result.tables[i]))
            else:
                kept.append(KeptPositions(request, start, first_row, self._num_wanted(request), result.tables[i]))
        if finished and self.proposer.runs_every_position:
            self._catch_up(finished)
        if kept and (self.proposer.runs_every_position or any(p.num_wanted for p in kept)):
            try:
                drafts = self.proposer.propose(kept)
                for p, tokens in zip(kept, drafts):
                    tokens = list(tokens[:p.num_wanted])
                    if p.request.grammar is not None:
                        tokens = tokens[:p.request.grammar.valid_drafts(tokens)]
                    p.request.draft_token_ids = tokens
            except RankFailedError:
                raise  # (a rank is gone: no step can run, as a forward pass's RankFailedError says)
            except Exception:  # a draft is an optimisation: without one the requests decode a token a step
                log.exception("the %s proposer failed; this step drafts nothing", type(self.proposer).__name__)
                for p in kept:
                    p.request.draft_token_ids = []
        for p in kept:
            self.kv.trim(p.request, p.request.num_computed_tokens + 1 + len(p.request.draft_token_ids))

    def _catch_up(self, finished: list[KeptPositions]) -> None:
        """The proposer's own KV at the positions a request's last step computed: its full blocks are in the prefix
        cache now, and a later hit on them reads that KV. Run apart and first, before any allocation for drafts
        could hand the freed blocks to another request."""
        try:
            self.proposer.propose(finished)
        except RankFailedError:
            raise
        except Exception:  # (its KV there is then stale: later drafts from those blocks are worse, never wrong)
            log.exception("the %s proposer failed on finished requests' last positions", type(self.proposer).__name__)

    def _num_wanted(self, request: Request) -> int:
        if request.num_computed_tokens != len(request.token_ids) - 1:
            return 0
        # (as many as it has tokens left: the token after the last draft is then cut by max_tokens, as vLLM's is)
        return max(0, min(self.k, request.max_tokens - request.num_output_tokens))
