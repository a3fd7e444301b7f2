"""AsyncEngine: the LLMEngine stepping on its own thread, one async stream per request.

The engine is single-threaded by design: every call into it (add, abort, step) happens on
the step thread, fed through a command queue. Outputs travel back to each caller's event
loop with call_soon_threadsafe, so the step loop never waits on asyncio and asyncio never
waits on a step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from backend.config import EngineConfig
from backend.engine.engine import EngineStats, LLMEngine, PromptType, StepError
from backend.engine.profiler import ProfileResult
from backend.engine.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone; nobody is listening
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stats = engine.stats()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="npu-llm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (never waits for the engine)."""
        return self._stats

    # -- the caller's side ------------------------------------------------------------------------

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs as tokens arrive; the last has finished=True. Invalid requests raise ValueError here.

        Leaving the iteration early (break, cancellation, a closed connection) aborts the request.
        """
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, sampling_params))
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
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def start_profile(self) -> None:
        await self._call(LLMEngine.start_profile)

    async def stop_profile(self) -> ProfileResult:
        return await self._call(LLMEngine.stop_profile)

    async def _call(self, method):
        """method(engine) on the step thread, between two steps; its result or exception comes back here."""
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        future = asyncio.get_running_loop().create_future()
        self._send(("call", future, method))
        return await future

    def abort(self, request_id: str) -> None:
        """Abort a request; its stream (if still read) ends with finish_reason "abort"."""
        self._send(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the step thread."""
        self._stopping = True
        self._send(("stop",))
        self._thread.join(timeout)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- the step thread --------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            if not self._drain_commands():
                break
            if not engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except StepError as e:
                log.exception("engine step failed")
                for request_id in e.request_ids:
                    self._deliver(request_id, e)
                outputs = []
            except Exception as e:  # a bug outside the forward pass: fail everything, keep the thread alive
                log.exception("engine step failed outside the model")
                for request_id in list(engine.groups):
                    engine.abort_request(request_id, emit_output=False)
                    self._deliver(request_id, e)
                outputs = []
            for output in outputs:
                self._deliver(output.request_id, output)
            self._stats = engine.stats()
        for request_id in list(engine.groups):
            engine.abort_request(request_id)
        for output in engine.step():
            self._deliver(output.request_id, output)
        self._stats = engine.stats()

    def _drain_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            kind, request_id = command[0], command[1] if len(command) > 1 else None
            if kind == "stop":
                return False
            if kind == "call":
                self._answer(command[1], command[2])
            if kind == "abort":
                self.engine.abort_request(request_id)
            elif kind == "add":
                try:
                    self.engine.add_request(request_id, command[2], command[3])
                except ValueError as e:
                    self._deliver(request_id, e)

    def _answer(self, future: asyncio.Future, method) -> None:
        try:
            result, settle = method(self.engine), future.set_result
        except Exception as e:
            result, settle = e, future.set_exception

        def resolve():
            if not future.done():
                settle(result)

        try:
            future.get_loop().call_soon_threadsafe(resolve)
        except RuntimeError:  # the caller's loop is gone
            pass

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)
