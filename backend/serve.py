"""`npu-llm serve`: run the model repository with tritonserver, wait until ready, print the endpoints."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from backend.config import EngineConfig
from backend.models.registry import resolve_model
from backend.triton.launcher import (
    DEFAULT_REPOSITORY,
    LaunchError,
    find_tritonserver,
    make_work_dir,
    run_copy,
    server_command,
)

READY_TIMEOUT_S = 600


def parse_engine_args(pairs: list[str]) -> dict:
    """KEY=VALUE strings; VALUE is read as JSON where it parses (numbers, booleans), else as a string."""
    values = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg expects KEY=VALUE, got {pair!r}")
        try:
            values[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            values[key.replace("-", "_")] = raw
    return values


def check_port_free(port: int, name: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            raise LaunchError(f"{name} port {port} is already in use") from None


def wait_http(url: str, process: subprocess.Popen, name: str, timeout: float = READY_TIMEOUT_S) -> None:
    """Until `url` answers 200; fails early if the process serving it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LaunchError(f"{name} exited with status {process.returncode} before it was ready (see its log above)")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise LaunchError(f"{name} not ready after {timeout:.0f} s")


def wait_ready(http_port: int, process: subprocess.Popen, timeout: float = READY_TIMEOUT_S) -> None:
    wait_http(f"http://127.0.0.1:{http_port}/v2/health/ready", process, "tritonserver", timeout)


def start_server(repository: Path, engine_args: dict, http_port: int, grpc_port: int, metrics_port: int,
                 extra: list[str] = (), log_file=None, new_session: bool = False) -> tuple[subprocess.Popen, Path]:
    """Start tritonserver on a run copy of the repository (not waiting for it); returns the process and its work dir."""
    for port, name in ((http_port, "HTTP"), (grpc_port, "gRPC"), (metrics_port, "metrics")):
        check_port_free(port, name)
    work_dir = make_work_dir()
    server = find_tritonserver(work_dir)
    argv, env = server_command(server, run_copy(repository, work_dir, engine_args), http_port, grpc_port,
                               metrics_port, list(extra))
    process = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT if log_file else None,
                               start_new_session=new_session)
    return process, work_dir


def stop_process_group(process: subprocess.Popen, grace_s: float = 8.0) -> None:
    """SIGTERM, a grace period, then SIGKILL for whatever is left of the process's group (started with
    new_session=True), so children such as Triton's python stub never outlive it."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def checked_engine_args(args) -> tuple[Path, dict, EngineConfig]:
    """(repository, engine-arg overrides, the resulting config), failing here in one line rather than inside Triton."""
    repository = Path(args.model_repository).resolve()
    engine_args = parse_engine_args(args.engine_arg or [])
    if args.model:
        engine_args["model"] = args.model
    model_json = repository / "llm" / "1" / "model.json"
    base = json.loads(model_json.read_text()) if model_json.exists() else {}
    config = EngineConfig.from_dict({**base, **engine_args})
    resolve_model(config.model)
    return repository, engine_args, config


def serve(args) -> int:
    repository, engine_args, config = checked_engine_args(args)

    process, work_dir = start_server(repository, engine_args, args.http_port, args.grpc_port, args.metrics_port,
                                     args.triton_arg or [])
    forward = lambda signum, _frame: process.send_signal(signum)  # noqa: E731
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        wait_ready(args.http_port, process)
        print(f"npu-llm: Triton is ready ({config.model})\n"
              f"  HTTP     http://localhost:{args.http_port}/v2/models/llm/generate_stream\n"
              f"  gRPC     localhost:{args.grpc_port}\n"
              f"  metrics  http://localhost:{args.metrics_port}/metrics", flush=True)
        return process.wait()
    except LaunchError:
        process.terminate()
        process.wait()
        raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def add_serve_args(parser) -> None:
    parser.add_argument("--model", default=None, help="overrides model.json's model (path, .gguf or name)")
    parser.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--engine-arg", action="append", metavar="KEY=VALUE", help="override a model.json key")
    parser.add_argument("--triton-arg", action="append", metavar="ARG", help="extra tritonserver argument")

