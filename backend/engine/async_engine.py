"""AsyncEngine: the LLMEngine stepping on its own thread, one async stream per request.

The engine is single-threaded by design: it is built on the step thread, and every call into it (add, abort,
step) happens there, fed through a command queue. Built anywhere else, it would cost a fifth of the throughput on
the CPU: torch's OpenMP runtime (libgomp) keeps a pool of worker threads for each thread that runs parallel work,
and once it manages more threads than there are cores it stops its workers spinning between parallel regions, so
every small op pays to wake them (docs/performance.md, "One OpenMP pool"). Outputs travel back to each caller's event
loop with call_soon_threadsafe, one call a step for all of a loop's outputs, so the step loop never waits on asyncio
and asyncio never waits on a step. The step thread alone maps request ids to streams, in command order, so an
abort of a finished request can never reach a newer request that reuses its id.

A failure that belongs to requests ends those requests' streams with its error. Any other
failure stops the engine for good (its state can no longer be trusted, as in vLLM): every
stream ends with EngineDeadError, new requests get it at once, and on_dead is told.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from backend.config import EngineConfig
from backend.engine.engine import LLMEngine
from backend.engine.stats import EngineInfo, EngineStats
from backend.engine.input_processor import PromptType
from backend.engine.lora_request import LoRARequest
from backend.engine.profiler import ProfileResult
from backend.engine.outputs import RequestOutput
from backend.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's step thread has stopped: no request can run any more."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        _hand_over(self.loop, [(self.queue, item)])


def _hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, object]]) -> None:
    """Put each (queue, item) on its queue, on the queues' loop: one call (and one wakeup of that loop) for them all."""
    def put_all():
        for queue, item in items:
            queue.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the caller's loop is gone; nobody is listening
        pass


class _StepOutputs:
    """A step's outputs and errors, grouped by their callers' event loops and handed to each loop at once: one
    wakeup a step rather than one a request (a served step's 64 outputs all go to the same loop)."""

    def __init__(self):
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}

    def put(self, stream: _Stream, item) -> None:
        self._by_loop.setdefault(stream.loop, []).append((stream.queue, item))

    def hand_over(self) -> None:
        for loop, items in self._by_loop.items():
            _hand_over(loop, items)


# The commands the step thread takes, in the order they were sent.
@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | None
    stream: _Stream
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str
    stream: _Stream | None  # the stream that asks; None: whichever reads the request


@dataclass
class _Call:
    future: asyncio.Future
    method: Callable[[LLMEngine], object]


class _Stop:
    pass


class AsyncEngine:
    engine: LLMEngine  # built on, and used only from, the step thread (after __init__: read-only elsewhere)

    def __init__(self, config: EngineConfig, on_dead: Callable[[BaseException], None] | None = None):
        """Builds the engine on its step thread; a failure to build raises here. on_dead(error) is called (on the
        step thread) if that thread ever stops on an error."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._routes: dict[str, _Stream] = {}  # step thread only: request id -> the stream that reads it
        self._ids = itertools.count()
        self._stopping = False
        self._lock = threading.Lock()  # a command is either queued before the thread stops (or dies), or refused
        self.dead_error: BaseException | None = None
        self._on_dead = on_dead
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(config, built), name="npu-llm-engine", daemon=True)
        self._thread.start()
        built.result()  # the engine, its stats and info are set once this returns

    @classmethod
    def from_config(cls, config: EngineConfig, on_dead: Callable[[BaseException], None] | None = None) -> "AsyncEngine":
        return cls(config, on_dead)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def iteration_tokens(self):
        """Tokens of each recent step (a deque the step thread appends to; vllm:iteration_tokens_total drains it)."""
        return self.engine.iteration_tokens

    @property
    def is_running(self) -> bool:
        """False once the engine is dead or shutting down: new requests fail at once."""
        return self.dead_error is None and not self._stopping and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (never waits for the engine)."""
        return self._stats

    # -- the caller's side ------------------------------------------------------------------------

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None, request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs as tokens arrive; the last has finished=True. Invalid requests raise ValueError here, a failure
        of this request in the engine raises its error, and a dead engine raises EngineDeadError.

        Leaving the iteration early (break, cancellation, a closed connection) aborts the request.
        """
        self._check_accepting()
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._send(_Add(request_id, prompt, sampling_params, stream, lora_request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # abort it, unless its id already belongs to a newer request
                self._send(_Abort(request_id, stream), quiet=True)

    async def start_profile(self) -> None:
        await self._call(LLMEngine.start_profile)

    async def stop_profile(self) -> ProfileResult:
        return await self._call(LLMEngine.stop_profile)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self._call(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call(lambda engine: engine.remove_lora(lora_int_id))

    async def _call(self, method):
        """method(engine) on the step thread, between two steps; its result or exception comes back here."""
        self._check_accepting()
        future = asyncio.get_running_loop().create_future()
        self._send(_Call(future, method))
        return await future

    def abort(self, request_id: str) -> None:
        """Abort a request; its stream (if still read) ends with finish_reason "abort"."""
        self._send(_Abort(request_id, None), quiet=True)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the step thread."""
        with self._lock:
            if not self._stopping and self.dead_error is None:
                self._commands.put(_Stop())
            self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.shutdown()

    def _unavailable(self) -> EngineDeadError | None:
        if self.dead_error is not None:
            return EngineDeadError(f"the engine has stopped: {self.dead_error!r}")
        if self._stopping:
            return EngineDeadError("the engine is shutting down")
        return None

    def _check_accepting(self) -> None:
        error = self._unavailable()
        if error is not None:
            raise error

    def _send(self, command, quiet: bool = False) -> None:
        with self._lock:
            error = self._unavailable()
            if error is not None:
                if quiet:
                    return
                raise error
            self._commands.put(command)
        self._wakeup.set()

    # -- the step thread --------------------------------------------------------------------------

    def _run(self, config: EngineConfig, built: concurrent.futures.Future) -> None:
        try:
            self.engine = LLMEngine(config)
            self._stats = self.engine.stats()
            self._info = self.engine.engine_info()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        try:
            self._serve()
        except BaseException as e:  # a failure no request owns: the engine's state can't be trusted any more
            log.exception("the engine stopped")
            self._die(e)
            return
        stopped = EngineDeadError("the engine is shutting down")
        for stream in self._routes.values():
            stream.put(stopped)
        self._routes.clear()
        self._refuse_queued(stopped)

    def _serve(self) -> None:
        engine = self.engine
        while self._drain_commands():
            if not engine.has_unfinished_requests():
                self._stats = engine.stats()  # aborts change it too
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            outputs = _StepOutputs()
            try:
                for output in engine.step():
                    self._deliver(output.request_id, output, outputs)
                for request_id, error in engine.take_failures().items():
                    self._deliver(request_id, error, outputs)
            finally:  # (a final output has left its route already: it must reach its stream whatever happens)
                outputs.hand_over()
            self._stats = engine.stats()
        for request_id in engine.unfinished_ids():
            self._deliver(request_id, engine.abort_request(request_id, emit_output=False))
        self._stats = engine.stats()

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self.dead_error = error
        if self._on_dead is not None:  # first, so the model is out of service before its clients hear
            try:
                self._on_dead(error)
            except Exception:
                log.exception("on_dead callback failed")
        dead = EngineDeadError(f"the engine has stopped: {error!r}")
        for stream in self._routes.values():
            stream.put(dead)
        self._routes.clear()
        self._refuse_queued(dead)

    def _refuse_queued(self, error: EngineDeadError) -> None:
        """Answer the commands queued before the thread stopped (later ones are refused by _send)."""
        with self._lock:
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    return
                if isinstance(command, _Add):
                    command.stream.put(error)
                elif isinstance(command, _Call):
                    self._settle(command.future, error, failed=True)

    def _drain_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Call):
                self._answer(command.future, command.method)
            elif isinstance(command, _Abort):
                self._abort(command.request_id, command.stream)
            else:
                self._add(command)

    def _add(self, command: _Add) -> None:
        if command.request_id in self._routes:
            command.stream.put(ValueError(f"request_id {command.request_id!r} is already in use"))
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.lora_request)
        except Exception as e:  # ValueError: a request that can never run
            command.stream.put(e)
            return
        self._routes[command.request_id] = command.stream

    def _abort(self, request_id: str, stream: _Stream | None) -> None:
        route = self._routes.get(request_id)
        if route is None or (stream is not None and route is not stream):
            return  # finished already, or the id now names a newer request
        output = self.engine.abort_request(request_id, emit_output=False)
        if output is None:  # unknown to the engine: end the stream anyway
            self._routes.pop(request_id, None)
        self._deliver(request_id, output)

    def _answer(self, future: asyncio.Future, method) -> None:
        try:
            self._settle(future, method(self.engine), failed=False)
        except Exception as e:
            self._settle(future, e, failed=True)

    @staticmethod
    def _settle(future: asyncio.Future, result, failed: bool) -> None:
        def resolve():
            if not future.done():
                (future.set_exception if failed else future.set_result)(result)

        try:
            future.get_loop().call_soon_threadsafe(resolve)
        except RuntimeError:  # the caller's loop is gone
            pass

    def _deliver(self, request_id: str, item, step_outputs: _StepOutputs | None = None) -> None:
        """An output or an error for a request's stream (now, or with the rest of `step_outputs`); a final one
        (finished, or an error) ends the route."""
        if item is None:
            return
        final = isinstance(item, BaseException) or item.finished
        stream = self._routes.pop(request_id, None) if final else self._routes.get(request_id)
        if stream is None:
            return
        if step_outputs is None:
            stream.put(item)
        else:
            step_outputs.put(stream, item)
