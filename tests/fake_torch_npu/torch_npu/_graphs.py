"""The fake's torch.npu graph API: NPUGraph capture and replay, and ATB task groups with updates.

A real NPUGraph records the kernels launched between capture_begin and capture_end, with the
device addresses they read and write, and replay relaunches exactly those kernels: whatever the
input buffers hold at replay is what they compute on, and host-side values (shapes, Python
numbers, CPU tensors such as the paged-attention op's context_lens) stay as they were at
capture. This fake gives the same semantics on the CPU by recording every aten op issued during
capture (a TorchDispatchMode) with the very tensors it used, and re-running them on replay with
each result written back into the tensor the capture produced, so later ops read the new values.

Task groups (Ascend/pytorch torch_npu/csrc/core/npu/NPUGraph.h): ops issued between
graph_task_group_begin and graph_task_group_end form a group whose handle lets them be re-issued
between graph_task_update_begin and graph_task_update_end with new host arguments; the update
replaces the group's launches in the graph (vllm-ascend compilation/acl_graph.py,
_update_attn_pa_params).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class NpuGraphError(RuntimeError):
    pass


@dataclass
class _Launch:
    """One kernel: the op, the tensors it was given, and the outputs it wrote at capture."""

    func: object
    args: tuple
    kwargs: dict
    outputs: list

    def run(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        for captured, fresh in zip(self.outputs, _tensors(result)):
            # In-place ops and views already act on the captured memory; anything new goes into it.
            if fresh is not captured and fresh.data_ptr() != captured.data_ptr():
                captured.copy_(fresh)


@dataclass
class _TaskGroup:
    launches: list[_Launch] = field(default_factory=list)


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


_HOST_READS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default,
               torch.ops.aten.is_nonzero.default)


class _Recorder(TorchDispatchMode):
    """Runs every op as usual and appends it to `sink` (a list, swapped by task groups).

    Reading a value computed inside the graph back to the host (.item(), int(), a Python branch
    on it) needs a device sync, which a real capture refuses, so it raises here too.
    Host constants (torch.tensor(...) of Python data, lifted into the graph) may be read.
    """

    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink
        self.computed: set[int] = set()  # data_ptrs of the tensors ops produced during the capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS and args[0].data_ptr() in self.computed:
            raise NpuGraphError(f"{func}: reading a value computed in the graph on the host syncs the "
                                "device, which a graph capture does not allow")
        result = func(*args, **kwargs)
        self.sink.append(_Launch(func, args, kwargs, _tensors(result)))
        if func not in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.computed.update(t.data_ptr() for t in _tensors(result))
        return result


class _Stream:
    """The one stream of the fake device; it carries the capture or update in progress."""

    def __init__(self):
        self.capturing: NPUGraph | None = None
        self.recorder: _Recorder | None = None
        self.group: _TaskGroup | None = None
        self.updating: _TaskGroup | None = None

    def __repr__(self) -> str:
        return "<fake npu stream>"


_STREAM = _Stream()


def current_stream(device=None) -> _Stream:
    return _STREAM


class NPUGraph:
    def __init__(self):
        self._items: list[_Launch | _TaskGroup] = []
        self._captured = False

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        if _STREAM.capturing is not None:
            raise NpuGraphError("capture_begin: another graph is being captured on this stream")
        if self._captured:
            raise NpuGraphError("capture_begin: this graph was already captured (reset() it first)")
        _STREAM.capturing = self
        _STREAM.recorder = _Recorder(self._items)
        _STREAM.recorder.__enter__()

    def capture_end(self) -> None:
        if _STREAM.capturing is not self:
            raise NpuGraphError("capture_end: this graph is not being captured")
        if _STREAM.group is not None:
            raise NpuGraphError("capture_end: a task group is still open")
        _STREAM.recorder.__exit__(None, None, None)
        _STREAM.capturing, _STREAM.recorder = None, None
        self._captured = True

    def replay(self) -> None:
        if not self._captured:
            raise NpuGraphError("replay: nothing captured")
        for item in self._items:
            for launch in item.launches if isinstance(item, _TaskGroup) else [item]:
                launch.run()

    def reset(self) -> None:
        self._items, self._captured = [], False

    def pool(self):
        return ("fake-npu-pool", id(self))


class graph:  # noqa: N801  (torch.npu.graph is a context-manager class)
    def __init__(self, npu_graph: NPUGraph, pool=None, stream=None, auto_dispatch_capture=False,
                 capture_error_mode: str = "global"):
        self.npu_graph, self.pool = npu_graph, pool

    def __enter__(self):
        self.npu_graph.capture_begin(pool=self.pool)
        return self.npu_graph

    def __exit__(self, *exc):
        self.npu_graph.capture_end()
        return False


def graph_pool_handle():
    return ("fake-npu-pool", object())


def graph_task_group_begin(stream: _Stream) -> None:
    if stream.capturing is None:
        raise NpuGraphError("graph_task_group_begin: only valid while capturing a graph")
    if stream.group is not None:
        raise NpuGraphError("graph_task_group_begin: task groups do not nest")
    stream.group = _TaskGroup()
    stream.capturing._items.append(stream.group)
    stream.recorder.sink = stream.group.launches


def graph_task_group_end(stream: _Stream) -> _TaskGroup:
    if stream.group is None:
        raise NpuGraphError("graph_task_group_end: no task group is open")
    handle, stream.group = stream.group, None
    stream.recorder.sink = stream.capturing._items
    return handle


def graph_task_update_begin(stream: _Stream, handle: _TaskGroup) -> None:
    if not isinstance(handle, _TaskGroup):
        raise NpuGraphError("graph_task_update_begin: not a task group handle")
    if stream.capturing is not None or stream.updating is not None:
        raise NpuGraphError("graph_task_update_begin: not valid during a capture or another update")
    stream.updating = handle
    stream.recorder = _Recorder([])
    stream.recorder.__enter__()


def graph_task_update_end(stream: _Stream) -> None:
    if stream.updating is None:
        raise NpuGraphError("graph_task_update_end: no update is open")
    stream.recorder.__exit__(None, None, None)
    if not stream.recorder.sink:
        raise NpuGraphError("graph_task_update_end: the update issued no op")
    stream.updating.launches = stream.recorder.sink
    stream.updating, stream.recorder = None, None


def is_capturing() -> bool:
    return _STREAM.capturing is not None
