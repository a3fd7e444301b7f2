"""From sampled tokens to RequestOutputs: text, stop strings, logprobs and n > 1 groups (vLLM v1's OutputProcessor).

The scheduler decides when a sequence ends by token (stop token, length); this module owns
everything about text: incremental detokenization, stop strings (which also end a sequence),
the logprobs each sequence collects, and one RequestOutput per user request, however many
sequences it has. State is keyed by request id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from backend.engine.detokenizer import IncrementalDetokenizer
from backend.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from backend.engine.request import Request
from backend.engine.sampler import SampledToken
from npu_llm_kernels.timing import scope


class RequestState:
    """One sequence's output side: its detokenizer and the logprobs it has collected."""

    def __init__(self, request: Request, index: int, parent: "ParentRequest", tokenizer, token_text):
        self.request = request
        self.index = index
        self.parent = parent
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.params)
        self.logprobs: list[dict[int, Logprob]] | None = [] if request.params.logprobs is not None else None
        # the prompt's, as they are computed (the first token has none)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if request.params.prompt_logprobs is not None else None)
        self.token_text = token_text
        self.cumulative_logprob = 0.0

    def add(self, sampled: SampledToken, num_after: int = 0) -> str | None:
        """Take one of the sequence's new tokens (num_after of them come after it, already appended by the
        scheduler); returns the stop string it completed, if any."""
        request = self.request
        if self.logprobs is not None:
            for token_id, logprob in sampled.logprobs.items():  # each token's own text, as vLLM gives it
                logprob.decoded_token = self.token_text(token_id)
            self.logprobs.append(sampled.logprobs)
            self.cumulative_logprob += sampled.logprob
        stopped_by_token = num_after == 0 and request.finished and request.finish_reason == "stop"
        if stopped_by_token and not request.params.include_stop_str_in_output:
            return None  # the stop token's text is not part of the output
        with scope("detokenize"):  # a sequence a stop token ended is not also ended by a stop string
            return self.detokenizer.add_token(sampled.token_id,
                                              check_stop=request.can_stop(num_after) and not stopped_by_token)

    def add_prompt_logprobs(self, entries: list[dict[int, Logprob]]) -> None:
        """The next prompt tokens' logprobs, from one chunk (each token's own text, as for the sampled ones)."""
        for entry in entries:
            for token_id, logprob in entry.items():
                logprob.decoded_token = self.token_text(token_id)
        self.prompt_logprobs += entries
        self.request.num_scored_prompt_tokens += len(entries)

    @property
    def prompt_scored(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) == self.request.num_prompt_tokens

    def completion(self) -> CompletionOutput:
        request = self.request
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.text,
            delta=self.detokenizer.take_delta(request.finished),
            token_ids=request.output_token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,  # a snapshot, not the live list
            last_token_time=request.last_token_time,
        )


@dataclass
class ParentRequest:
    """A user request: n sequences sharing one prompt."""

    request_id: str
    prompt: str | None
    states: list[RequestState]

    @property
    def finished(self) -> bool:
        return all(s.request.finished for s in self.states)

    def output(self) -> RequestOutput:
        children = [s.request for s in self.states]
        first = children[0]
        first_times = [c.first_token_time for c in children if c.first_token_time]
        scheduled_times = [c.scheduled_time for c in children if c.scheduled_time]
        finish_times = [c.finish_time for c in children if c.finish_time]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_token_time=min(first_times) if first_times else None,
            finish_time=max(finish_times) if self.finished and finish_times else None,
            num_cached_tokens=first.num_cached_tokens,
            scheduled_time=min(scheduled_times) if scheduled_times else None,
        )
        with scope("detokenize"):  # the output takes each sequence's new text from its detokenizer
            outputs = [s.completion() for s in self.states]
        scorer = self.states[0]  # (the sequence that scores the prompt, if asked)
        prompt_logprobs = list(scorer.prompt_logprobs) if scorer.prompt_scored else None
        return RequestOutput(self.request_id, self.prompt, first.prompt_token_ids, outputs, self.finished, metrics,
                             prompt_logprobs, first.kv_transfer_params_out, first.max_tokens)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.states: dict[str, RequestState] = {}  # sequence (child) request id -> its state
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprobs' decoded_token), bounded by the vocabulary

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        parent = ParentRequest(request_id, prompt, [])
        parent.states = [RequestState(child, i, parent, self.tokenizer, self.token_text)
                         for i, child in enumerate(children)]
        self.parents[request_id] = parent
        for state in parent.states:
            self.states[state.request.request_id] = state

    def pop(self, request_id: str) -> ParentRequest | None:
        """Forget a user request (finished or aborted); returns it."""
        parent = self.parents.pop(request_id, None)
        for state in parent.states if parent else ():
            self.states.pop(state.request.request_id, None)
        return parent

    def parent_of(self, child: Request) -> ParentRequest:
        return self.states[child.request_id].parent

    def process(self, new_tokens: dict[str, list[SampledToken]], stop: Callable[[Request, str, int], None],
                fail_sequence: Callable[[Request, BaseException], None],
                fail: Callable[[str, BaseException], None]) -> list[RequestOutput]:
        """Each sequence's new tokens (already appended by the scheduler) detokenized, in order, until a stop
        string ends it (stop(request, stop_string, tokens after it)); then one output per user request that changed,
        and those finished forgotten. A sequence whose text fails fails its user request (fail_sequence); a user
        request whose output fails, itself (fail); the others go on."""
        touched = {}
        for request_id, tokens in new_tokens.items():
            state = self.states.get(request_id)
            if state is None:
                continue  # a sibling's failure ended its user request
            try:
                for i, token in enumerate(tokens):
                    stop_string = state.add(token, num_after=len(tokens) - 1 - i)
                    if stop_string is not None:
                        stop(state.request, stop_string, len(tokens) - 1 - i)
                        break
                touched[state.parent.request_id] = state.parent
            except Exception as e:
                fail_sequence(state.request, e)
        outputs = []
        for parent in touched.values():
            if parent.request_id not in self.parents:
                continue  # failed meanwhile (a sibling's error)
            try:
                outputs.append(parent.output())
            except Exception as e:
                fail(parent.request_id, e)
                continue
            if parent.finished:
                self.pop(parent.request_id)
        return outputs
