"""`npu-llm serve`: run the model repository with tritonserver, wait until ready, print the endpoints."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from backend.config import EngineConfig, parse_engine_args
from backend.config.control_key import CONTROL_KEY_ENV, control_key, ensure_control_key
from backend.models.registry import resolve_model
from backend.triton.loras import parse_lora_modules
from backend.triton.model_json import ModelJson, parse_model_json
from backend.triton.launcher import (
    DEFAULT_REPOSITORY,
    LaunchError,
    find_tritonserver,
    loopback_listeners,
    make_work_dir,
    run_copy,
    server_command,
)

READY_TIMEOUT_S = 600
# After SIGTERM or Ctrl-C: how long Triton gets to abort what is in flight and exit before it is killed.
SHUTDOWN_GRACE_S = 12.0


def check_port_free(port: int, name: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            raise LaunchError(f"{name} port {port} is already in use") from None


def wait_http(url: str, process: subprocess.Popen, name: str, timeout: float = READY_TIMEOUT_S,
              stop: threading.Event | None = None, headers: dict[str, str] | None = None) -> None:
    """Until `url` answers 200 (or `stop` is set); fails early if the process serving it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (stop and stop.is_set()):
        if process.poll() is not None:
            raise LaunchError(f"{name} exited with status {process.returncode} before it was ready (see its log above)")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    if stop and stop.is_set():
        return
    raise LaunchError(f"{name} not ready after {timeout:.0f} s")


def wait_ready(http_port: int, process: subprocess.Popen, timeout: float = READY_TIMEOUT_S,
               stop: threading.Event | None = None, host: str = "127.0.0.1") -> None:
    wait_http(f"http://{client_host(host)}:{http_port}/v2/health/ready", process, "tritonserver", timeout, stop)


def client_host(host: str) -> str:
    """Where to reach a server bound to host (a wildcard address is reachable on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def start_server(repository: Path, engine_args: dict, http_port: int, grpc_port: int, metrics_port: int,
                 extra: list[str] = (), log_file=None, new_session: bool = False,
                 host: str = "127.0.0.1", lora_modules: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """Start tritonserver on a run copy of the repository (not waiting for it), with lora_modules added to its
    adapters; returns the process and its work dir."""
    for port, name in ((http_port, "HTTP"), (grpc_port, "gRPC"), (metrics_port, "metrics")):
        check_port_free(port, name)
    key = ensure_control_key()
    work_dir = make_work_dir()
    server = find_tritonserver(work_dir)
    copy = run_copy(repository, work_dir, engine_args, lora_modules)
    argv, env = server_command(server, copy, http_port, grpc_port, metrics_port, list(extra), host, key)
    env.update(loopback_listeners(copy))
    process = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT if log_file else None,
                               start_new_session=new_session)
    return process, work_dir


def stop_process_group(process: subprocess.Popen, grace_s: float = SHUTDOWN_GRACE_S) -> None:
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


def checked_engine_args(args) -> tuple[Path, dict, ModelJson]:
    """(repository, engine-arg overrides, what the llm model runs as), failing here in one line rather than inside
    Triton."""
    repository = Path(args.model_repository).resolve()
    engine_args = {**EngineConfig.cli_overrides(args), **parse_engine_args(args.engine_arg or [])}
    if args.model:
        engine_args["model"] = args.model
    if lora_modules_of(args):  # (adapters are served only with it)
        engine_args["enable_lora"] = True
    # every model's model.json, as the run copy will have it (llm/1 first: its config is the one printed)
    found = sorted(repository.glob("*/[0-9]*/model.json"), key=lambda p: p.parts[-3:] != ("llm", "1", "model.json"))
    models = [parse_model_json({**json.loads(p.read_text()), **engine_args}) for p in found]
    models = models or [parse_model_json(engine_args)]
    for model in models:
        resolve_model(model.config.model)
    return repository, engine_args, models[0]


def lora_modules_of(args) -> dict[str, str]:
    """--lora-modules, parsed (a ValueError naming a bad one)."""
    return parse_lora_modules(getattr(args, "lora_modules", None) or [])


def serve(args) -> int:
    repository, engine_args, model = checked_engine_args(args)
    transfer = model.config.kv_transfer
    if transfer is not None and not transfer.is_pool and not control_key():
        raise ValueError(f"kv_transfer_config: the servers of a disaggregated deployment and its gateway share one "
                         f"{CONTROL_KEY_ENV} (a consumer pulls only KV a producer holding it signed): set the same "
                         f"value, 16 or more of A-Z a-z 0-9 - _, for each `npu-llm serve` and the gateway "
                         f"(`npu-llm up --disaggregate` does it for you)")

    # Its own session, so that stopping it can take its python stub along (stop_process_group).
    process, work_dir = start_server(repository, engine_args, args.http_port, args.grpc_port, args.metrics_port,
                                     args.triton_arg or [], new_session=True, host=args.triton_host,
                                     lora_modules=lora_modules_of(args))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        wait_ready(args.http_port, process, stop=stop, host=args.triton_host)
        if not stop.is_set():
            shown = "localhost" if args.triton_host == "127.0.0.1" else args.triton_host
            print(f"npu-llm: Triton is ready ({model.config.model}, {model.layout})\n"
                  f"  HTTP     http://{shown}:{args.http_port}/v2/models/llm/generate_stream\n"
                  f"  gRPC     {shown}:{args.grpc_port}\n"
                  f"  metrics  http://{shown}:{args.metrics_port}/metrics", flush=True)
        while process.poll() is None and not stop.wait(0.5):
            pass
        return process.returncode if process.returncode is not None else 0
    finally:
        stop_process_group(process)  # SIGTERM, SHUTDOWN_GRACE_S, then SIGKILL for whatever is left
        shutil.rmtree(work_dir, ignore_errors=True)


def add_serve_args(parser, engine_flags: bool = True) -> None:
    """The flags of a command that starts Triton; with engine_flags, the engine's own (--dtype, --max-model-len,
    --tensor-parallel-size, ...), as `vllm serve` takes them, each overriding model.json's key."""
    if engine_flags:
        EngineConfig.add_cli_args(parser.add_argument_group("engine arguments (override model.json)"), overrides=True)
    parser.add_argument("--model", default=None, help="overrides model.json's model (path, .gguf or name)")
    parser.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--triton-host", default="127.0.0.1",
                        help="address Triton's HTTP, gRPC and metrics ports listen on (0.0.0.0: every interface; "
                             "Triton has no authentication, so open it only on a trusted network)")
    parser.add_argument("--engine-arg", action="append", metavar="KEY=VALUE", help="override a model.json key")
    parser.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                        help="LoRA adapters to serve, as vLLM takes them (NAME=PATH, or JSON {\"name\": ..., "
                             "\"path\": ...}): added to multi_lora.json, enable_lora set (docs/lora.md)")
    parser.add_argument("--triton-arg", action="append", metavar="ARG", help="extra tritonserver argument")

