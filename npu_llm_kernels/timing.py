"""Named timing scopes around the work of a step (matmuls, attention, sampling, ...).

Outside a profile capture a scope costs one global read. During a capture (backend/engine/profiler.py
installs a recorder) each scope waits for the device at both ends, so that its time is its own work,
shows up as a `record_function` range in the trace, and adds its *self* time (its time less the
scopes nested in it) to the recorder's totals. Self times of nested scopes therefore add up to the
outermost scope's time with nothing counted twice.

Kernels import this module and never the engine: the recorder is installed from above.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable

import torch

_NULL = contextlib.nullcontext()
_recorder: "Recorder | None" = None


class Recorder:
    """Self time per scope name, in seconds, since the last `take()`."""

    def __init__(self, synchronize: Callable[[], None]):
        self.synchronize = synchronize
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open scope: [start, time spent in nested scopes]

    def take(self) -> dict[str, float]:
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals


class _Scope:
    __slots__ = ("name", "recorder", "range")

    def __init__(self, name: str, recorder: Recorder):
        self.name, self.recorder = name, recorder
        self.range = torch.profiler.record_function(name)

    def __enter__(self):
        self.recorder.synchronize()
        self.range.__enter__()
        self.recorder._stack.append([time.perf_counter(), 0.0])

    def __exit__(self, *exc):
        self.recorder.synchronize()
        start, nested = self.recorder._stack.pop()
        elapsed = time.perf_counter() - start
        self.recorder.totals[self.name] += elapsed - nested
        if self.recorder._stack:
            self.recorder._stack[-1][1] += elapsed
        self.range.__exit__(*exc)
        return False


def scope(name: str):
    """A context manager timing `name` while a recorder is installed, else a no-op."""
    recorder = _recorder
    return _NULL if recorder is None else _Scope(name, recorder)


def install(recorder: Recorder | None) -> None:
    global _recorder
    _recorder = recorder
