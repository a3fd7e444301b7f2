"""Mooncake's listeners kept on this host when the KV moves over loopback.

Mooncake's transfer engine listens on every interface whatever address it is given (its handshake daemon binds
0.0.0.0, its TCP transport ::), and its memory is the engine's KV cache: even `npu-llm up --disaggregate 1P1D` on
one machine would let other hosts read and write it. In the peer-to-peer handshake mode the engine uses, no Mooncake
setting moves those listeners (MC_TCP_BIND_ADDRESS tried with 0.3.13), so a small preload library (loopback_only.c)
turns the wildcard binds of Mooncake's own libraries into loopback binds. `npu-llm serve` and `up` preload it into
Triton when every KV transfer the server runs is on a loopback kv_ip (backend/triton/launcher.py); an engine started
otherwise, or where the preload did not take, warns that its listeners are open (docs/disaggregation.md).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
from pathlib import Path

from backend.models.registry import cache_dir

SOURCE = Path(__file__).with_name("loopback_only.c")
SCOPE_ENV = "NPU_LLM_LOOPBACK_ONLY_FROM"  # (read by loopback_only.c)


def preload_library() -> Path:
    """loopback_only.c compiled (once per version of its source and machine architecture, in npu-llm's cache)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    library = cache_dir() / "preload" / f"loopback_only-{platform.machine()}-{digest}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("keeping Mooncake's listeners on loopback needs a C compiler (cc), as the CPU kernels do")
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    built = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl"],
                           capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"building {SOURCE.name} failed: {built.stderr.strip()[-500:]}")
    os.replace(partial, library)  # (whole or not at all, for servers starting side by side)
    return library


def loopback_environment() -> dict[str, str]:
    """The environment additions that keep a process's Mooncake listeners on loopback (none without Mooncake)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return {}
    package = Path(next(iter(spec.submodule_search_locations))).resolve()
    # the package, and the libraries its wheel vendors beside it (auditwheel's <distribution>.libs)
    scopes = [package, *package.parent.glob("mooncake*.libs")]
    preload = [str(preload_library()), *filter(None, [os.environ.get("LD_PRELOAD")])]
    return {"LD_PRELOAD": " ".join(preload), SCOPE_ENV: ":".join(f"{p.resolve()}{os.sep}" for p in scopes)}


def listeners_are_local() -> bool:
    """Whether the library was preloaded into this process and has a scope (so its Mooncake listeners stay on
    loopback): its marker symbol is there, which a preload that failed to load would not leave."""
    try:
        ctypes.CDLL(None).npu_llm_loopback_only  # noqa: B018  (a lookup: AttributeError when absent)
    except AttributeError:
        return False
    return bool(os.environ.get(SCOPE_ENV))
