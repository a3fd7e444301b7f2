"""Structured outputs: xgrammar grammars that constrain sampling (vLLM's StructuredOutputManager).

A request's spec (backend/engine/sampling_params.py StructuredOutputsParams) compiles once per
distinct spec, on a thread of its own, so the step loop keeps decoding other requests meanwhile;
the scheduler holds the request back until its grammar is ready (vLLM's WAITING_FOR_FSM). Each
sequence then has its own matcher, which follows its sampled tokens. A step fills one bitmask
for all constrained rows and masks their logits before sampling; unconstrained rows are left
alone. The mask is plain torch, so the same code runs on CPU, CUDA and NPU.

xgrammar is imported on the first constrained request, on the compile thread.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager

import torch

from backend.engine.sampling_params import StructuredOutputsParams

# Distinct compiled grammars kept (vLLM's xgrammar cache is bounded in bytes; a count is simpler to reason about).
GRAMMAR_CACHE_SIZE = 256
# Longest run of whitespace between two JSON tokens. Uncapped (vLLM leaves it so), a small model sampling at
# temperature can loop on newlines until max_tokens and never close the object; 20 still allows indented JSON.
MAX_WHITESPACE = 20
# The C++ source location xgrammar puts before its messages ("[12:00:00] /project/cpp/x.cc:94: ...").
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """The spec does not compile: a bad JSON schema, regex or grammar (a client error)."""


class SequenceGrammar:
    """One sequence's grammar: the compiled grammar (a future until compiled), then its matcher."""

    def __init__(self, compiled: Future):
        self.compiled = compiled
        self._matcher = None

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def error(self) -> BaseException | None:
        return self.compiled.exception() if self.ready else None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(self.compiled.result())
        return self._matcher

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self._matcher is not None and self._matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} does not follow the request's grammar")

    def valid_drafts(self, tokens: list[int]) -> int:
        """How many of the draft tokens, in order, the grammar takes from where it is, short of the one that would
        complete it (after which nothing may be sampled); the matcher is left where it was (vLLM checks drafts so)."""
        taken = 0
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            if self.matcher.is_terminated():
                self.matcher.rollback(1)
                break
            taken += 1
        if taken:
            self.matcher.rollback(taken)
        return taken


class StructuredOutputs:
    """The grammars' lifecycle, as vLLM v1's structured-output manager runs it: specs compiled for one tokenizer, off
    the step loop, and cached (LRU by spec); each constrained sequence's matcher made, watched while it compiles,
    and advanced by the tokens it samples. What fails (a spec that does not compile, a token a matcher refuses) is
    handed to the engine's `fail(request, error)`."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._compiler = None  # made on the compile thread, on first use
        self._executor: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()  # the step thread's alone
        self._compiling: list = []  # sequences (Requests) whose grammar is being compiled

    def add(self, requests: list, spec: StructuredOutputsParams) -> None:
        """Requests of one spec (a user request's samples): one matcher each, from one compilation."""
        for request in requests:
            request.grammar = self.grammar_for(spec)
        self._compiling += requests

    def fail_bad_grammars(self, fail: Callable) -> None:
        """Requests whose spec did not compile fail with the compiler's message (a client error)."""
        for request in self._compiling:
            if request.grammar is not None and request.grammar.error is not None:
                fail(request, request.grammar.error)  # (and its siblings: their grammar goes too)
        # what is left: still compiling, and not finished meanwhile (finish releases the grammar)
        self._compiling = [r for r in self._compiling if r.grammar is not None and not r.grammar.ready]

    def accept(self, scheduled: list, sampled: dict, fail: Callable) -> None:
        """Each constrained sequence's matcher takes its sampled token (before the scheduler appends it); a token it
        refuses fails the sequence, and leaves `sampled`."""
        for s in scheduled:
            request, token = s.request, sampled.get(s.request.request_id)
            if request.grammar is None or token is None:
                continue
            try:
                request.grammar.accept(token.token_id)
            except Exception as e:
                del sampled[request.request_id]
                fail(request, e)

    def wait_while_compiling(self, timeout_s: float) -> None:
        """Up to timeout_s for a grammar being compiled (an idle step waits, instead of spinning)."""
        if self._compiling:
            wait([r.grammar.compiled for r in self._compiling if r.grammar], timeout_s, FIRST_COMPLETED)

    def grammar_for(self, spec: StructuredOutputsParams) -> SequenceGrammar:
        """A new sequence's grammar; compiles the spec unless an earlier request already did (or is doing it)."""
        future = self._cache.get(spec.key)
        if future is None or _failed_unexpectedly(future):  # only a spec's own error is worth remembering
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="npu-llm-grammar")
            future = self._cache[spec.key] = self._executor.submit(self._compile, spec)
        self._cache.move_to_end(spec.key)
        while len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        return SequenceGrammar(future)

    def _compile(self, spec: StructuredOutputsParams):
        compiler = self._compiler or self._make_compiler()
        kind, value = spec.kind, spec.spec_value(spec.kind)
        try:
            if kind == "json":
                return compiler.compile_json_schema(json.dumps(value), any_whitespace=not spec.disable_any_whitespace,
                                                    max_whitespace_cnt=MAX_WHITESPACE)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(value))
            return compiler.compile_grammar(value)
        except RuntimeError as e:  # xgrammar's parse and conversion errors
            raise GrammarError(f"structured_outputs.{kind}: {_XGRAMMAR_PREFIX.sub('', str(e)).strip()}") from None

    def _make_compiler(self):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                       stop_token_ids=self._eos_token_ids)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # our cache is above
        return self._compiler


def _failed_unexpectedly(future: Future) -> bool:
    return future.done() and future.exception() is not None and not isinstance(future.exception(), GrammarError)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON string escapes are xgrammar's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@contextmanager
def grammars_ahead(requests: list, ahead: list[list[int]]):
    """For the block, each constrained request's matcher past the tokens ahead of it (verified drafts, which it
    takes: they were checked), so that the rows sampled after them are masked as they will be; then put back."""
    advanced: list[list] = []  # [grammar, tokens it took], counted as it takes them
    try:
        for request, tokens in zip(requests, ahead):
            if request.grammar is not None and tokens:
                advanced.append([request.grammar, 0])
                for token in tokens:
                    request.grammar.accept(token)
                    advanced[-1][1] += 1
        yield
    finally:
        for grammar, count in advanced:
            if count:
                grammar.matcher.rollback(count)


def apply_grammars(logits: torch.Tensor, grammars: list[SequenceGrammar | None]) -> None:
    """Mask, in place, each constrained row's logits to the tokens its grammar allows next."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(rows), logits.shape[1])
    for k, row in enumerate(rows):
        grammars[row].matcher.fill_next_token_bitmask(bitmask, k)
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [R, ceil(V/32)] (bit j of word w: token 32w+j allowed) as bools [R, V]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.bool().reshape(bitmask.shape[0], -1)[:, :vocab_size]
