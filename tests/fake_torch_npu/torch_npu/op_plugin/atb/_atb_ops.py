"""torch_npu.op_plugin.atb._atb_ops: loading the ATB op library (op-plugin op_plugin/python/atb/_atb_ops.py).

The real module tries to load libop_plugin_atb.so (which links CANN NNAL's libatb.so) at import,
keeps an OSError instead of raising it, and raises it from _register_atb_extensions(), which
every `torch_npu._npu_*` call runs first. The fake host has NNAL unless FAKE_NPU_NNAL=0.
"""
from __future__ import annotations

import os


def _nnal_error() -> OSError | None:
    if os.environ.get("FAKE_NPU_NNAL", "1") != "0":
        return None
    cause = OSError("libatb.so: cannot open shared object file: No such file or directory")
    error = OSError(None, "Please check that the nnal package is installed. "
                          "Please run 'source set_env.sh' in the NNAL installation path.")
    error.__cause__ = cause
    return error


def _register_atb_extensions() -> None:
    error = _nnal_error()
    if error is not None:
        raise error
