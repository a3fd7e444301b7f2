"""`npu-llm up`: Triton, the gateway and the UI from one command, each started once the one below is ready.

Children run in their own sessions, so the terminal's Ctrl-C reaches only us; we stop them in
reverse order (UI, gateway, Triton), give each a grace period, then kill what is left of its
process group (the Triton python stub included), so no process or port outlives us.
"""
from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import threading

from backend.serve import checked_engine_args, client_host, start_server, stop_process_group, wait_http, wait_ready


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "backend.cli", *args], start_new_session=True)


@contextlib.contextmanager
def running_stack(args, with_ui: bool = True, stop: threading.Event | None = None):
    """Triton + gateway (+ UI) on the ports in args; yields (children, what llm runs as: ModelJson); stops them
    all on exit.
    A set `stop` cuts the start short (the caller sees it set)."""
    repository, engine_args, model = checked_engine_args(args)
    children: list[subprocess.Popen] = []
    work_dir = None
    try:
        triton, work_dir = start_server(repository, engine_args, args.http_port, args.grpc_port, args.metrics_port,
                                        args.triton_arg or [], new_session=True, host=args.triton_host)
        children.append(triton)
        wait_ready(args.http_port, triton, host=args.triton_host, stop=stop)
        if not (stop and stop.is_set()):
            children += _start_front(args, model.config, with_ui)
        yield children, model
    finally:
        for child in reversed(children):
            stop_process_group(child)
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)


def _start_front(args, config, with_ui: bool) -> list[subprocess.Popen]:
    """The gateway (and the UI) in front of a ready Triton, each started once the one below answers."""
    triton, front = client_host(args.triton_host), client_host(args.host)
    gateway = _spawn("gateway", "--triton-url", f"{triton}:{args.grpc_port}", "--host", args.host,
                     "--port", str(args.gateway_port), "--tokenizer", config.model)
    started = [gateway]
    try:
        wait_http(f"http://{front}:{args.gateway_port}/health", gateway, "gateway", timeout=120)
        if with_ui:
            ui = _spawn("ui", "--gateway-url", f"http://{front}:{args.gateway_port}", "--host", args.host,
                        "--metrics-url", f"http://{triton}:{args.metrics_port}/metrics", "--port", str(args.ui_port))
            started.append(ui)
            wait_http(f"http://{front}:{args.ui_port}/", ui, "ui", timeout=120)
    except BaseException:
        for child in reversed(started):
            stop_process_group(child)
        raise
    return started


def up(args) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with running_stack(args, stop=stop) as (children, model):
        if stop.is_set():
            return 130
        triton = client_host(args.triton_host)
        print(f"npu-llm is up ({model.config.model}, {model.layout}):\n"
              f"  chat UI      http://{args.host}:{args.ui_port}\n"
              f"  OpenAI API   http://{args.host}:{args.gateway_port}/v1\n"
              f"  Triton       http://{triton}:{args.http_port} (gRPC {triton}:{args.grpc_port}, "
              f"metrics http://{triton}:{args.metrics_port}/metrics)\n"
              "Ctrl-C stops all three.", flush=True)
        while not stop.wait(0.5):
            exited = [c for c in children if c.poll() is not None]
            if exited:
                print(f"npu-llm: a service exited (status {exited[0].returncode}); stopping the others",
                      file=sys.stderr)
                return 1
    return 0
