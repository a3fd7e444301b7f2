"""One rule for prefill and decode (vLLM v1): each request's num_computed_tokens catches up
with its tokens under a per-step token budget and a sequence cap. Decodes and prefill chunks
share a step; chunked prefill is just a budget smaller than the prompt. Out of blocks: the
most recently admitted running request is preempted (blocks freed, recomputed later).

After the forward pass, update_from_output moves each scheduled request on: its tokens are
in the cache now, its sampled token is appended, and a stop token or its length finishes it.

With a KV connector (disaggregated prefill or a KV pool, backend/engine/kv_transfer/), a request whose prompt KV
another engine or the pool holds is admitted with blocks for its prompt and waits, taking no step, while that KV loads
(`loading`); once it has it (`loaded`) it runs the rest of its prompt (a remote prefill: its last token), before any
request waiting for blocks (it needs none). A finished request whose blocks a consumer will pull, or a pool will save,
keeps them until released (`sending`).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from backend.engine.kv_cache import KVCacheManager
from backend.engine.kv_transfer.connector import FinishedTransfers, KVConnector
from backend.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)

# An idle step waits this long for a KV transfer to end (disaggregated prefill), instead of spinning.
TRANSFER_WAIT_S = 0.002


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # drafts included
    drafts: tuple[int, ...] = ()  # draft tokens to verify after the last known one (speculative decoding)

    @property
    def num_drafts(self) -> int:
        return len(self.drafts)

    @property
    def wants_logits(self) -> bool:
        """The chunk reaches the last known token, so the step samples the next one."""
        return self.request.num_computed_tokens + self.num_new_tokens - self.num_drafts == len(self.request.token_ids)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, enable_chunked_prefill: bool,
                 recompute_last_hit: bool = False, connector: KVConnector | None = None, max_loras: int | None = None):
        self.kv = kv
        self.max_loras = max_loras  # with enable_lora: adapters among the running requests, at most
        self.connector = connector
        self.loading: dict[str, Request] = {}  # request id -> request whose prompt KV is being pulled into its blocks
        self.loaded: deque[Request] = deque()  # requests whose prompt KV has arrived, to run first
        self.sending: dict[str, Request] = {}  # request id -> finished request whose blocks a consumer will pull
        # With an MTP drafter the draft layer's KV at a block's last position was computed from the token after the
        # block, which a prefix-cache hit does not match: the last hit block is computed again (as vLLM does).
        self.recompute_last_hit = recompute_last_hit
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        # The counters of the engine's stats (vLLM's scheduler stats): admissions, steps and their tokens
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests
        self.num_steps = self.num_computed_tokens = self.num_generation_tokens = 0
        self._waste_sum = 0.0
        # tokens of each recent step, for vllm:iteration_tokens_total (read and drained by another thread)
        self.iteration_tokens: deque[int] = deque(maxlen=4096)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.num_prompt_tokens += len(request.prompt_token_ids)

    def record_step(self, scheduled: list[ScheduledRequest], num_generated: int) -> None:
        """Count a step that ran: its tokens, those it generated, and the KV slots its requests hold unused."""
        self.num_steps += 1
        step_tokens = sum(s.num_new_tokens for s in scheduled)
        self.num_computed_tokens += step_tokens
        self.num_generation_tokens += num_generated
        self.iteration_tokens.append(step_tokens)
        allocated = sum(len(self.kv.block_ids(r)) for r in self.running) * self.kv.block_size
        used = sum(r.num_computed_tokens for r in self.running)
        self._waste_sum += 1 - used / allocated if allocated else 0.0

    @property
    def kv_cache_waste(self) -> float:
        """Allocated but unused KV slots over allocated ones, averaged over the steps."""
        return self._waste_sum / self.num_steps if self.num_steps else 0.0

    @property
    def has_pending_transfers(self) -> bool:
        return bool(self.loading or self.sending)

    @property
    def num_holding(self) -> int:
        """Sequences that hold blocks for a step: running, being pulled, or pulled and about to run."""
        return len(self.running) + len(self.loading) + len(self.loaded)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and give its blocks back (a request being loaded
        keeps them until its load ends: they are being written)."""
        if request.request_id in self.loading:
            return
        self._dequeue(request)
        self.kv.free(request)

    def _dequeue(self, request: Request) -> None:
        for queue in (self.running, self.waiting, self.loaded):
            if request in queue:
                queue.remove(request)
                return

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(len(request.token_ids) - request.num_computed_tokens, budget)
            # a decode verifies its drafts in the same step, as many as the budget has room for
            drafts = tuple(request.draft_token_ids[:budget - 1]) if num_new == 1 else ()
            num_new += len(drafts)
            while not self.kv.allocate(request, num_new):
                if drafts:  # a draft's slot is never worth a preemption
                    num_new, drafts = num_new - len(drafts), ()
                    continue
                if self._drop_drafts(self.running[i + 1:]):  # (nor another's, not scheduled yet)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new, drafts))
                budget -= num_new
                i += 1

        # Loaded requests next: their blocks cover their whole prompt already, and only what was not loaded runs (a
        # remote prefill's last prompt token; the rest of a prompt whose head came from a KV pool).
        while self.loaded and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.loaded[0]
            num_new = len(request.token_ids) - request.num_computed_tokens
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            self.loaded.popleft()
            self.kv.allocate(request, num_new)  # (covered by its table)
            self._run(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

        # New requests only when nobody had to make room this step, nor waits with its prompt loaded (without chunked
        # prefill, new short requests would otherwise keep a loaded one's rest from fitting the budget).
        computing: set[bytes] = set()  # hashes of the full blocks that requests admitted in this step will fill
        # passed over for now: a grammar being compiled (vLLM's WAITING_FOR_FSM), or an adapter beyond max_loras
        passed_over: list[Request] = []
        adapters = {r.lora_int_id for r in self.running if r.lora_int_id is not None}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted and \
                not self.loaded:
            request = self.waiting[0]
            if request.waiting_for_grammar or self._lora_full(request, adapters):
                passed_over.append(self.waiting.popleft())
                continue
            hits = self.kv.find_cached_prefix(request)
            if self.recompute_last_hit:
                hits = hits[:-1]
            num_cached = len(hits) * self.kv.block_size
            if self._next_block_being_computed(request, len(hits), computing):
                break  # wait one step and take it from the prefix cache (n > 1 siblings, repeated prompts)
            num_new = len(request.token_ids) - num_cached
            num_external = self.connector.get_num_new_matched_tokens(request, num_cached) \
                if self.connector and not request.external_load_failed else 0
            if num_external:
                if self.num_holding >= self.max_num_seqs or not self._start_loading(request, hits, num_external):
                    break
                continue
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            request.num_computed_tokens = num_cached
            if not self.kv.allocate(request, num_new, hits):
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
                self.kv.record_lookup(request, num_cached)
            if self.kv.enable_prefix_caching:
                computing.update(self.kv.block_hashes(request, (num_cached + num_new) // self.kv.block_size))
            self._run(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            if request.lora_int_id is not None:
                adapters.add(request.lora_int_id)
        self.waiting.extendleft(reversed(passed_over))
        return scheduled

    def _drop_drafts(self, requests: list[Request]) -> bool:
        """Take back the drafts of these requests and the blocks only their slots took (the drafter allocates a
        request's next drafts with it); whether any block came back."""
        before = self.kv.num_free_blocks
        for request in requests:
            if request.draft_token_ids:
                request.draft_token_ids = []
                self.kv.trim(request, request.num_computed_tokens + 1)
        return self.kv.num_free_blocks > before

    def _lora_full(self, request: Request, adapters: set[int]) -> bool:
        """Its adapter would be one more than max_loras among the running requests (as vLLM's scheduler skips it;
        by id, as the slots are kept)."""
        return self.max_loras is not None and request.lora_int_id is not None and \
            request.lora_int_id not in adapters and len(adapters) >= self.max_loras

    def _run(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.scheduled_time = request.scheduled_time or time.time()
        self.running.append(request)

    def _start_loading(self, request: Request, hits: list[int], num_external: int) -> bool:
        """Admit a request whose prompt KV (past its local hits) another engine or a KV pool holds: blocks for its
        whole prompt, then it waits for the load, taking no step. False (nothing changed) if the blocks are not
        free."""
        num_cached = len(hits) * self.kv.block_size
        request.num_computed_tokens = num_cached
        request.num_external_computed_tokens = num_external
        if not self.kv.allocate(request, len(request.token_ids) - num_cached, hits):
            request.num_computed_tokens = 0
            return False
        self.waiting.popleft()
        if request.status is RequestStatus.WAITING:  # (a preempted one was counted and scheduled before)
            request.num_cached_tokens = num_cached
            self.kv.record_lookup(request, num_cached)
        self.connector.update_state_after_alloc(request, self.kv.block_ids(request), num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.scheduled_time = request.scheduled_time or time.time()
        self.loading[request.request_id] = request
        return True

    def end_transfers(self, stepped: bool) -> list[tuple[Request, BaseException]]:
        """After the forward pass: the connector's saves, then the transfers that ended (update_from_connector). A step
        with nothing to run waits a moment for them instead of spinning."""
        self.connector.wait_for_save()
        if not stepped:
            time.sleep(TRANSFER_WAIT_S)
        return self.update_from_connector(self.connector.get_finished())

    def update_from_connector(self, finished: FinishedTransfers) -> list[tuple[Request, BaseException]]:
        """Transfers that ended: released blocks are freed; pulled requests queue first, their prompt computed but
        its last token; a failed pull is recomputed here, unless the producer refused it (the request's
        kv_transfer_params were wrong). Returns the requests that fail, with why."""
        for request_id in finished.sending:
            request = self.sending.pop(request_id, None)
            if request is not None:
                self.kv.free(request)
        failed = []
        for request_id in finished.recving | finished.failed.keys():
            request = self.loading.pop(request_id, None)
            if request is None:
                continue
            request.kv_transfer_params = None  # pulled once, never again (a preemption recomputes)
            error = finished.failed.get(request_id)
            if request.finished:  # aborted while its blocks were being written
                self.kv.free(request)
            elif error is None:  # (the last token runs here, to give the first token's logits)
                request.num_computed_tokens = min(request.num_computed_tokens + request.num_external_computed_tokens,
                                                  len(request.token_ids) - 1)
                self.kv.cache_full_blocks(request)
                self.loaded.append(request)
            else:
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.PREEMPTED  # (recomputed: its prefix lookup is counted already)
                request.external_load_failed = True  # (computed here from now on, not loaded again)
                if isinstance(error, ValueError) or self.connector.fail_on_load_error:
                    failed.append((request, error))
                else:
                    log.warning("computing request %s's prompt here instead: %s", request_id, error)
                    self.waiting.appendleft(request)
        return failed

    def _next_block_being_computed(self, request: Request, num_hits: int, computing: set[bytes]) -> bool:
        if not computing or (len(request.token_ids) - 1) // self.kv.block_size <= num_hits:
            return False
        return self.kv.block_hashes(request, num_hits + 1)[num_hits] in computing

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []  # (drafted from positions it no longer holds)
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def update_from_output(self, scheduled: list[ScheduledRequest], sampled: dict[str, int]) -> list[Request]:
        """After the forward pass: record the computed tokens, append each sampled token (sampled: request id ->
        token), finish the requests that reached a stop token or their length. Returns the requests that got a
        token. A request finished meanwhile (aborted because its sampling failed) is left as it is."""
        advanced = []
        for item in scheduled:
            request = item.request
            if request.finished:
                continue
            request.num_computed_tokens += item.num_new_tokens - item.num_drafts  # a draft counts once verified
            self.kv.cache_full_blocks(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            self._append(request, token)
            advanced.append(request)
        return advanced

    def accept_draft(self, request: Request, token: int) -> None:
        """A verified draft (the request's last token already) is computed now, and the token sampled after it joins
        the request. (The rejected drafts' KV is garbage, overwritten by later steps; the drafter returns the blocks
        only they took.)"""
        request.num_computed_tokens += 1
        self.kv.cache_full_blocks(request)
        self._append(request, token)

    def _append(self, request: Request, token: int) -> None:
        """A sampled token joins the request; a stop token or its length finishes it."""
        request.append_output_token(token)
        grammar_ended = request.grammar is not None and request.grammar.terminated  # min_tokens yielded to it
        if (request.can_stop() or grammar_ended) and token in request.stop_token_ids:
            self.finish(request, "stop", None if token in request.eos_token_ids and not request.params.ignore_eos
                        else token)
        elif request.num_output_tokens >= request.max_tokens:
            self.finish(request, "length")

    def finish_at_stop_string(self, request: Request, stop_string: str, num_after: int) -> None:
        """The output processor found a stop string num_after tokens before the request's end: the tokens after it
        (a verified draft's next one) are not the request's, nor counted as generated."""
        del request.token_ids[len(request.token_ids) - num_after:]
        self.num_generation_tokens -= num_after
        if request.finished:  # (a token after the stop string ended it: its blocks are back already)
            request.finish("stop", stop_string)
        else:
            self.finish(request, "stop", stop_string)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (stop, length or abort) and give its blocks back, unless a consumer will pull them."""
        request.finish(reason, stop_reason)
        if self.connector is not None and request.request_id not in self.loading:
            hold, request.kv_transfer_params_out = self.connector.request_finished(request, self.kv.block_ids(request))
            if hold:
                self._dequeue(request)
                self.sending[request.request_id] = request
                return
        self.remove(request)
