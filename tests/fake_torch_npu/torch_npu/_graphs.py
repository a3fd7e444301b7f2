"""The fake's torch.npu graph API: NPUGraph capture and replay, and ATB task groups with updates.

A real NPUGraph records the kernels launched between capture_begin and capture_end, with the
device addresses they read and write, and replay relaunches exactly those kernels: whatever the
input buffers hold at replay is what they compute on, and host-side values (shapes, Python
numbers, CPU tensors such as the paged-attention op's context_lens) stay as they were at
capture. This fake gives the same semantics on the CPU by recording every aten op issued during
capture (a TorchDispatchMode) with the very tensors it used, and re-running them on replay with
each result written back into the tensor the capture produced, so later ops read the new values.
A fused op is one kernel: the fake's ATB ops issue theirs through launch(), which the capture
records as one launch rather than as the aten ops the fake computes it with.

Task groups (Ascend/pytorch torch_npu/csrc/core/npu/NPUGraph.h): ops issued between
graph_task_group_begin and graph_task_group_end form a group whose handle lets them be re-issued
between graph_task_update_begin and graph_task_update_end with new host arguments; the update
replaces the group's launches in the graph (vllm-ascend compilation/acl_graph.py,
_update_attn_pa_params). As torch.npu.graph does, a capture runs on a capture stream of its own,
and an update must be issued on another stream than the one its group was captured on.

A graph holds device addresses, not references: memory the capture read but did not allocate
(weights, caches, input buffers) must be kept alive by its owner. The fake holds such tensors
weakly, through their storage, so a replay that would read freed memory raises instead of
quietly working on a tensor only the fake kept alive.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack


class NpuGraphError(RuntimeError):
    pass


class _External:
    """A tensor the capture read but did not allocate, held through a weak reference to its storage."""

    def __init__(self, t: torch.Tensor):
        self.storage = weakref.ref(t.untyped_storage())
        self.view = (t.dtype, t.device, t.size(), t.stride(), t.storage_offset())

    def get(self, func) -> torch.Tensor:
        storage = self.storage()
        if storage is None:
            raise NpuGraphError(f"replay: {func} reads a tensor freed after the capture (a real graph would read "
                                "freed memory): keep every tensor a graph reads alive as long as the graph")
        dtype, _, size, stride, offset = self.view
        with torch.inference_mode(False), torch.no_grad():
            return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)  # the memory underneath


@dataclass
class _Launch:
    """One kernel: the op, the tensors it was given, and the outputs it wrote at capture.

    A replay runs it on the host memory underneath the device tensors: its arguments passed the device's
    checks when it was captured, and a real graph relaunches its kernels without checking them again."""

    func: object
    args: tuple
    kwargs: dict
    outputs: list

    def __post_init__(self):
        self.reads_external = any(isinstance(v, _External) for v in _leaves((self.args, self.kwargs, self.outputs)))
        self._host = _map(_underneath, (self.args, self.kwargs, self.outputs))

    def run(self) -> None:
        args, kwargs, outputs = self._host
        if self.reads_external:
            args, kwargs, outputs = _map(self._resolve, (args, kwargs, outputs))
        result = self.func(*args, **kwargs)
        for captured, fresh in zip(outputs, _tensors(result)):
            # In-place ops and views already act on the captured memory; anything new goes into it.
            if fresh is not captured and fresh.data_ptr() != captured.data_ptr():
                captured.copy_(fresh)

    def _resolve(self, value):
        return value.get(self.func) if isinstance(value, _External) else value


@dataclass
class _TaskGroup:
    stream: "_Stream"  # the stream it was captured on
    launches: list[_Launch] = field(default_factory=list)


# Op arguments are tuples, lists and dicts of values, a level or two deep. These walk them without pytree,
# whose generality costs more than the ops themselves on replays of thousands of launches.
def _leaves(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value


def _map(fn, value):
    if type(value) in (list, tuple):
        return type(value)(_map(fn, v) for v in value)
    if type(value) is dict:
        return {k: _map(fn, v) for k, v in value.items()}
    return fn(value)


def _underneath(value):
    """A fake device tensor's host tensor (fake_npu_device.NpuTensor._inner); anything else as it is. (The graphs
    record the CUDA kernels on host tensors in tests/test_decode_graphs.py, where no fake device exists.)"""
    return getattr(value, "_inner", value) if isinstance(value, torch.Tensor) else value


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in _leaves(value) if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
_HOST_READS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default,
               torch.ops.aten.is_nonzero.default)


class _Recorder(TorchDispatchMode):
    """Runs every op as usual and appends it to `sink` (a list, swapped by task groups).

    Reading a value computed inside the graph back to the host (.item(), int(), a Python branch
    on it) needs a device sync, which a real capture refuses, so it raises here too.
    Host constants (torch.tensor(...) of Python data, lifted into the graph) may be read.
    `updating`: it records a task-group update, whose fused ops (launch) are recorded without running.
    """

    def __init__(self, sink: list, updating: bool = False):
        super().__init__()
        self.sink, self.updating = sink, updating
        self.computed: set[int] = set()  # data_ptrs of the tensors ops produced during the capture
        self.owned: set[int] = set()  # device storages allocated during the capture (the graph's pool)

    def record(self, func, args, kwargs, outputs) -> None:
        def hold(value):  # device memory from outside the capture is only addressed, not owned
            outside = isinstance(value, torch.Tensor) and value.device.type != "cpu" and _storage(value) not in self.owned
            return _External(value) if outside else value

        self.sink.append(_Launch(func, *_map(hold, (args, kwargs, outputs))))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS and args[0].data_ptr() in self.computed:
            raise NpuGraphError(f"{func}: reading a value computed in the graph on the host syncs the "
                                "device, which a graph capture does not allow")
        inputs = {_storage(t) for t in _tensors((args, kwargs))}
        result = func(*args, **kwargs)
        if func in _LIFTS:  # a constant made during the capture: the graph's own memory
            inputs = set()
        self.owned.update(_storage(t) for t in _tensors(result) if _storage(t) not in inputs)
        self.record(func, args, kwargs, _tensors(result))
        if func not in _LIFTS:
            self.computed.update(t.data_ptr() for t in _tensors(result))
        return result


def launch(kernel, writes: tuple[str, ...], **args) -> None:
    """A fused op's kernel: `kernel(**args)` on the host memory under the device tensors (the op has checked
    them), writing in place the arguments named in `writes`. Its temporaries are host tensors, opaque to every
    dispatch mode and to the device's memory accounting, as a fused kernel's are. Run now; while a graph is
    captured, also recorded as one launch. While a task group is updated, only recorded: an update replaces
    the group's launches and runs no fused op."""
    recorder = next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, _Recorder)), None)
    if recorder is None or not recorder.updating:
        with _disable_current_modes():
            result = kernel(**_map(_underneath, args))
        assert result is None, f"{kernel.__name__}: a kernel writes its outputs in place"
    if recorder is not None:
        recorder.record(kernel, (), args, [])
        if not recorder.updating:  # what it wrote is computed in the graph: the host may not read it back
            recorder.computed.update(args[name].data_ptr() for name in writes)


class _Stream:
    """A stream of the fake device; it carries the capture or update in progress on it."""

    def __init__(self, name: str):
        self.name = name
        self.capturing: NPUGraph | None = None
        self.recorder: _Recorder | None = None
        self.group: _TaskGroup | None = None
        self.updating: _TaskGroup | None = None

    def __repr__(self) -> str:
        return f"<fake npu {self.name} stream>"


# The default stream, and the one torch.npu.graph captures on unless given another.
_DEFAULT, _CAPTURE = _Stream("default"), _Stream("capture")


def current_stream(device=None) -> _Stream:
    return _CAPTURE if _CAPTURE.capturing is not None else _DEFAULT


class NPUGraph:
    def __init__(self):
        self._items: list[_Launch | _TaskGroup] = []
        self._captured = False

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        if _CAPTURE.capturing is not None:
            raise NpuGraphError("capture_begin: another graph is being captured on this stream")
        if self._captured:
            raise NpuGraphError("capture_begin: this graph was already captured (reset() it first)")
        _CAPTURE.capturing = self
        _CAPTURE.recorder = _Recorder(self._items)
        _CAPTURE.recorder.__enter__()

    def capture_end(self) -> None:
        if _CAPTURE.capturing is not self:
            raise NpuGraphError("capture_end: this graph is not being captured")
        if _CAPTURE.group is not None:
            raise NpuGraphError("capture_end: a task group is still open")
        _CAPTURE.recorder.__exit__(None, None, None)
        _CAPTURE.capturing, _CAPTURE.recorder = None, None
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
    stream.group = _TaskGroup(stream)
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
    if stream is handle.stream:
        raise NpuGraphError("graph_task_update_begin: issue the update on another stream than the one its "
                            "task group was captured on")
    stream.updating = handle
    stream.recorder = _Recorder([], updating=True)
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
    return _CAPTURE.capturing is not None
