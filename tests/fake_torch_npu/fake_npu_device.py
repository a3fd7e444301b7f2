"""The fake torch_npu's device: tensors on "npu:N" whose data lives in host memory.

install() renames PrivateUse1 to "npu". NpuTensor is a wrapper subclass whose .device is the
process's current NPU (npu:0 unless set_current() chose another, as torch.npu.set_device does)
while its data lives in an inner CPU tensor (``t._inner``); __torch_dispatch__ runs
every aten op on the inner tensors and refuses to mix device and (non-scalar) host tensors
in one op, as torch does for a real device. Factories with device="npu" reach PrivateUse1
kernels registered here that run them on the CPU. Device memory is accounted per storage,
so memory_allocated / max_memory_allocated / mem_get_info answer as a caching allocator's would.

It lives outside the torch_npu package because a device type can be registered only once per
process, while the tests import and drop the fake torch_npu many times.
"""
import weakref

import torch

__all__ = ["install", "set_current", "NpuTensor", "inner", "memory"]

aten = torch.ops.aten
_CPU = torch.device("cpu")
_NPU = None  # the current device, torch.device("npu", 0) once installed
_LIBS = None  # keeps the registrations alive
_MIXED_OK = {aten.copy_.default, aten._to_copy.default}  # may mix npu and cpu
_INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
              aten._index_put_impl_.default}  # CPU indices (arg 1) allowed


class NpuTensor(torch.Tensor):
    @staticmethod
    def __new__(cls, t):
        r = torch.Tensor._make_wrapper_subclass(
            cls, t.size(), strides=t.stride(), storage_offset=t.storage_offset(),
            dtype=t.dtype, device=_NPU, requires_grad=False)
        r._inner = t
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None):
        s = repr(self._inner)
        return s[:-1] + f", device='{self.device}')"

    def tolist(self):  # Tensor.tolist refuses subclasses
        return self._inner.tolist()

    def data_ptr(self):  # the wrapper itself has no data (returns 0)
        return self._inner.data_ptr()

    def untyped_storage(self):  # NB: the storage reports device cpu
        return self._inner.untyped_storage()

    # `p.data = x` (nn.Module._apply, e.g. module.to(bf16)) copies only the
    # TensorImpl metadata, so the Python-side inner tensor is moved here.
    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        torch._C.TensorBase.data.__set__(self, new)
        self._inner = inner(new)

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        if func is aten._has_compatible_shallow_copy_type.default:
            return type(args[0]) is type(args[1])  # dispatched in inference_mode
        return _run(func, args, kwargs or {}, None)


def _run(func, args, kwargs, wrap):
    """Run ``func`` on inner CPU tensors. Tensor outputs become NpuTensor if
    ``wrap`` (None: if any input is npu, or as the device= kwarg says)."""
    dev = kwargs.get("device")
    if dev is not None:
        wrap = torch.device(dev).type == "npu"
        kwargs = dict(kwargs, device=_CPU) if wrap else kwargs
    seen = {}  # id(unwrapped tensor) -> original arg: keeps output aliasing
    npu = cpu = False  # saw an npu tensor / a CPU tensor that is not 0-dim
    uargs = list(args)
    items = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
    kwargs = dict(kwargs)
    for key, a in items:
        dst = uargs if isinstance(key, int) else kwargs
        if isinstance(a, NpuTensor):
            npu, dst[key], seen[id(a._inner)] = True, a._inner, a
        elif isinstance(a, torch.Tensor):
            seen[id(a)] = a
            cpu = cpu or (a.is_cpu and a.dim() > 0)
        elif isinstance(a, (list, tuple)) and a:  # Tensor[] / Tensor?[]
            idx = key == 1 and func in _INDEX_OPS
            if any(isinstance(x, NpuTensor) for x in a):
                npu, dst[key] = True, [inner(x) for x in a]
            cpu = cpu or any(isinstance(x, torch.Tensor) and not isinstance(x, NpuTensor)
                             and x.is_cpu and x.dim() > 0 and not idx for x in a)
    if npu and cpu and func not in _MIXED_OK:
        raise RuntimeError("Expected all tensors to be on the same device, but found "
                           f"at least two devices, npu:0 and cpu! (when running {func})")
    out = func(*uargs, **kwargs)
    wrap = npu if wrap is None else wrap
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, seen, wrap) for o in out)
    return _wrap(out, seen, wrap)


def _wrap(o, seen, wrap):
    if not isinstance(o, torch.Tensor):
        return o
    a = seen.get(id(o))
    if a is not None:  # in-place / out= / no-op: return the same object
        if isinstance(a, NpuTensor):
            if not wrap:  # aten.to(device=cpu) in inference_mode returns self
                return o.clone()
            if a.shape != o.shape or a.stride() != o.stride() or (
                    a.storage_offset() != o.storage_offset()):
                # resize_/out=/t_/unsqueeze_ changed the inner's metadata;
                # `.data =` copies sizes/strides into the wrapper in place
                torch._C.TensorBase.data.__set__(a, _new_device_tensor(o))
        return a
    if not wrap:
        return o
    if o.is_inference() != torch.is_inference_mode_enabled():
        # e.g. a view of a normal tensor inside inference_mode is a normal
        # tensor; a mismatched wrapper breaks autograd's view bookkeeping
        with torch._C._InferenceMode(o.is_inference()):
            return _new_device_tensor(o)
    return _new_device_tensor(o)


class _Memory:
    """Bytes held by live device storages, the peak since the last reset, and what a caching allocator
    would hold: freed blocks stay reserved (counted as used by mem_get_info) until empty_cache()."""

    def __init__(self):
        self.allocated = self.peak = self.reserved = 0
        self.live: set[int] = set()

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.live or storage.nbytes() == 0:
            return
        self.live.add(key)
        self.allocated += storage.nbytes()
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)
        weakref.finalize(storage, self._release, key, storage.nbytes())

    def _release(self, key: int, nbytes: int) -> None:
        self.live.discard(key)
        self.allocated -= nbytes


memory = _Memory()


def _new_device_tensor(o: torch.Tensor) -> "NpuTensor":
    memory.track(o)
    return NpuTensor(o)


def _copy_from(src, dst, non_blocking=False):
    inner(dst).copy_(inner(src))
    return dst


def _kernel(op):
    return lambda *args, **kwargs: _run(op, args, kwargs, True)


# torch.tensor(data, device="npu") works with the Python key excluded, so ops
# reach PrivateUse1 with NpuTensor args or while a TorchDispatchMode is active;
# the boxed fallback then fails an INTERNAL ASSERT (it looks up a per-op Python
# registration), so these ops get per-op kernels.
_PER_OP = {"empty.memory_format": None, "empty_strided.default": None,
           "_local_scalar_dense.default": None, "_copy_from.default": _copy_from,
           "_copy_from_and_resize.default": _copy_from}


def inner(t):
    """The CPU tensor holding ``t``'s data (``t`` itself if not an NpuTensor)."""
    return t._inner if isinstance(t, NpuTensor) else t


def install(backend_module) -> None:
    """Register the fake npu device, once per process; backend_module becomes torch's module for it."""
    global _NPU, _LIBS
    if _LIBS is not None:
        return
    if torch._C._get_privateuse1_backend_name() != "npu":
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(rename="npu", backend_module=backend_module)
    _NPU = torch.device("npu", 0)
    _LIBS = (torch.library.Library("_", "IMPL"), torch.library.Library("aten", "IMPL"))
    _LIBS[0].fallback(lambda op, *a, **k: _run(op, a, k, True), "PrivateUse1")
    for name, fn in _PER_OP.items():
        op = getattr(getattr(aten, name.split(".")[0]), name.split(".")[1])
        _LIBS[1].impl(name.replace(".default", ""), fn or _kernel(op), "PrivateUse1")


def set_current(index: int) -> None:
    """The device new tensors are placed on (one device per process, as every npu-llm rank uses)."""
    global _NPU
    _NPU = torch.device("npu", index)
