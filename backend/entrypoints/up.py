"""`npu-llm up`: Triton, the gateway and the UI from one command, each started once the one below is ready.

With --disaggregate xPyD, x prefill Tritons (kv_producer engines) and y decode Tritons (kv_consumer), each on ports
of its own, and the gateway as their proxy (docs/disaggregation.md).

Children run in their own sessions, so the terminal's Ctrl-C reaches only us; we stop them in
reverse order (UI, gateway, Triton), give each a grace period, then kill what is left of its
process group (the Triton python stub included), so no process or port outlives us.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

from backend.config.kv_transfer import MOONCAKE_MASTER_ENV
from backend.entrypoints.kv_pool_master import start_master
from backend.entrypoints.serve import (
    checked_engine_args, client_host, lora_modules_of, start_server, stop_process_group, wait_http, wait_ready,
)

# --kv-pool: every engine's connector (a disaggregated layout's prefill servers save to the pool, decode servers load)
POOL_CONNECTOR = {"kv_connector": "MooncakeStoreConnector"}

# Server k of a disaggregated layout listens on the given ports + k * PORT_STRIDE, its KV side channel on
# --kv-port + k * PORT_STRIDE (room for a server's data-parallel engines, kv_port + instance each).
PORT_STRIDE = 10


@dataclass
class TritonServer:
    """One Triton of the stack: its role ("serve", or "prefill" / "decode" when disaggregated), ports and engine
    arguments."""

    role: str
    name: str
    http_port: int
    grpc_port: int
    metrics_port: int
    engine_args: dict

    def url(self, host: str, port: int) -> str:
        return f"{client_host(host)}:{port}"


def parse_layout(text: str) -> tuple[int, int]:
    """"2P1D" -> (2, 1): prefill and decode servers."""
    match = re.fullmatch(r"(\d+)P(\d+)D", text.strip().upper())
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"--disaggregate takes xPyD with x, y >= 1 (e.g. 1P1D, 2P1D), got {text!r}")
    return int(match[1]), int(match[2])


def plan_servers(args, engine_args: dict) -> list[TritonServer]:
    """The Tritons to start: one, or a disaggregated layout's prefill servers then decode servers."""
    ports = (args.http_port, args.grpc_port, args.metrics_port)
    layout = getattr(args, "disaggregate", None)
    pool = getattr(args, "kv_pool", False)
    given = engine_args.get("kv_transfer_config") or {}  # a user's whole config (its abort_timeout_s, ...)
    if not layout:
        if pool:
            engine_args = {**engine_args, "kv_transfer_config": {**POOL_CONNECTOR, **given, "kv_role": "kv_both"}}
        return [TritonServer("serve", "triton", *ports, engine_args)]
    num_prefill, num_decode = parse_layout(layout)
    roles = [("prefill", "kv_producer", i) for i in range(num_prefill)] + \
            [("decode", "kv_consumer", i) for i in range(num_decode)]
    connector = POOL_CONNECTOR if pool else {"kv_connector": "MooncakeConnectorV1"}
    servers = []
    for k, (role, kv_role, i) in enumerate(roles):
        transfer = {**connector, "kv_ip": client_host(args.triton_host), **given,
                    "kv_role": kv_role, "kv_port": args.kv_port + k * PORT_STRIDE, "engine_id": f"{role}-{i}"}
        servers.append(TritonServer(role, f"{role}-{i}", *(p + k * PORT_STRIDE for p in ports),
                                    {**engine_args, "kv_transfer_config": transfer}))
    return servers


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "backend.entrypoints.cli", *args], start_new_session=True)


@contextlib.contextmanager
def running_stack(args, with_ui: bool = True, stop: threading.Event | None = None):
    """Triton + gateway (+ UI) on the ports in args; yields (children, what llm runs as: ModelJson); stops them
    all on exit.
    A set `stop` cuts the start short (the caller sees it set)."""
    repository, engine_args, model = checked_engine_args(args)
    servers = plan_servers(args, engine_args)
    children: list[subprocess.Popen] = []
    work_dirs = []
    try:
        if getattr(args, "kv_pool", False):  # (first, so that the engines find it; stopped last)
            children.append(start_master(args.kv_pool_port, args.kv_pool_port + 1, client_host(args.triton_host)))
            # (the Tritons inherit it)
            os.environ[MOONCAKE_MASTER_ENV] = f"{client_host(args.triton_host)}:{args.kv_pool_port}"
        for server in servers:  # (all at once: each loads its model while the others do)
            triton, work_dir = start_server(repository, server.engine_args, server.http_port, server.grpc_port,
                                            server.metrics_port, args.triton_arg or [], new_session=True,
                                            host=args.triton_host, lora_modules=lora_modules_of(args))
            children.append(triton)
            work_dirs.append(work_dir)
        for server, triton in zip(servers, children):
            if not (stop and stop.is_set()):
                wait_ready(server.http_port, triton, host=args.triton_host, stop=stop)
        if not (stop and stop.is_set()):
            children += _start_front(args, model.config, with_ui, servers)
        yield children, model
    finally:
        for child in reversed(children):
            stop_process_group(child)
        for work_dir in work_dirs:
            shutil.rmtree(work_dir, ignore_errors=True)


def _start_front(args, config, with_ui: bool, servers: list[TritonServer]) -> list[subprocess.Popen]:
    """The gateway (and the UI) in front of the ready Tritons, each started once the one below answers."""
    host, front = args.triton_host, client_host(args.host)

    def urls(role: str, port: str, form: str = "{}") -> list[str]:
        return [form.format(s.url(host, getattr(s, port))) for s in servers if s.role == role]

    if len(servers) == 1:
        upstream = ["--triton-url", servers[0].url(host, servers[0].grpc_port)]
        metrics = ["--metrics-url", f"http://{servers[0].url(host, servers[0].metrics_port)}/metrics"]
    else:
        upstream = ["--prefill", *urls("prefill", "grpc_port"), "--decode", *urls("decode", "grpc_port")]
        metrics = ["--metrics-url", *urls("decode", "metrics_port", "http://{}/metrics"),
                   "--prefill-metrics-url", *urls("prefill", "metrics_port", "http://{}/metrics")]
    gateway = _spawn("gateway", *upstream, "--host", args.host, "--port", str(args.gateway_port),
                     "--tokenizer", config.model)
    started = [gateway]
    try:
        wait_http(f"http://{front}:{args.gateway_port}/health", gateway, "gateway", timeout=120)
        if with_ui:
            ui = _spawn("ui", "--gateway-url", f"http://{front}:{args.gateway_port}", "--host", args.host,
                        *metrics, "--port", str(args.ui_port))
            started.append(ui)
            wait_http(f"http://{front}:{args.ui_port}/", ui, "ui", timeout=120)
    except BaseException:
        for child in reversed(started):
            stop_process_group(child)
        raise
    return started


def up(args) -> int:
    from ui.exposure import checked_login

    try:  # (the UI would refuse it too, but only once Triton and the gateway had started)
        checked_login(args.host, os.environ.get("NPU_LLM_API_KEY"))
    except ValueError as e:
        print(f"npu-llm up: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with running_stack(args, stop=stop) as (children, model):
        if stop.is_set():
            return 130
        servers = plan_servers(args, {})
        layout = model.layout if len(servers) == 1 else f"{args.disaggregate.upper()}, each {model.layout}"
        lines = [f"npu-llm is up ({model.config.model}, {layout}):",
                 f"  chat UI      http://{args.host}:{args.ui_port}",
                 f"  OpenAI API   http://{args.host}:{args.gateway_port}/v1"]
        for server in servers:
            title = "Triton" if server.role == "serve" else server.name
            lines.append(f"  {title:<12} http://{server.url(args.triton_host, server.http_port)} "
                         f"(gRPC {server.url(args.triton_host, server.grpc_port)}, "
                         f"metrics http://{server.url(args.triton_host, server.metrics_port)}/metrics)")
        if args.kv_pool:
            lines.append(f"  KV pool      Mooncake master {os.environ[MOONCAKE_MASTER_ENV]} "
                         f"(metrics http://{client_host(args.triton_host)}:{args.kv_pool_port + 1}/metrics)")
        print("\n".join(lines + ["Ctrl-C stops them all."]), flush=True)
        while not stop.wait(0.5):
            exited = [c for c in children if c.poll() is not None]
            if exited:
                print(f"npu-llm: a service exited (status {exited[0].returncode}); stopping the others",
                      file=sys.stderr)
                return 1
    return 0
