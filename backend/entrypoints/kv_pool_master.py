"""Mooncake Store's master (`mooncake_master`, which the pd extra's Mooncake wheel installs) for `npu-llm up
--kv-pool` and the tests: on loopback, on ports of its own, ready once its admin server answers."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from backend.entrypoints.serve import LaunchError, check_port_free, wait_http

MASTER_BINARY = "mooncake_master"
READY_TIMEOUT_S = 30


def find_master() -> str:
    """The master's binary: on PATH, or beside this Python (a virtual environment's bin/)."""
    found = shutil.which(MASTER_BINARY) or shutil.which(MASTER_BINARY, path=str(Path(sys.executable).parent))
    if found is None:
        raise LaunchError(f"{MASTER_BINARY} is not installed: `make install` installs it with Mooncake "
                          f"(pip's mooncake-transfer-engine-non-cuda, the pd extra)")
    return found


def start_master(rpc_port: int, admin_port: int, host: str = "127.0.0.1", log_file=None) -> subprocess.Popen:
    """mooncake_master serving on host:rpc_port (what MOONCAKE_MASTER names), its admin and metrics server on
    admin_port; returns once it answers. Its own session, so that stop_process_group takes it down whole."""
    for port, name in ((rpc_port, "Mooncake master"), (admin_port, "Mooncake master's admin")):
        check_port_free(port, name)
    process = subprocess.Popen(
        [find_master(), f"--rpc_port={rpc_port}", f"--rpc_address={host}", f"--metrics_host={host}",
         f"--metrics_port={admin_port}"],
        stdout=log_file or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://{host}:{admin_port}/health", process, MASTER_BINARY, READY_TIMEOUT_S)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process
