"""`npu-llm loadtest`: locust, headless, against a running stack (or one it starts), then the report."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

from backend.models.registry import DEFAULT_MODEL

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
TARGETS = {  # target -> (user class, default host)
    "gateway": ("ChatSSEUser", "http://127.0.0.1:{gateway_port}"),
    "triton-grpc": ("TritonGrpcUser", "localhost:{grpc_port}"),
    "triton-http": ("TritonHttpUser", "http://127.0.0.1:{http_port}"),
}


def locust_command(args, out: Path) -> list[str]:
    user_class, default_host = TARGETS[args.target]
    host = args.host_url or default_host.format(**vars(args))
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "-u", str(args.users), "-r", str(args.spawn_rate), "-t", args.run_time, "--stop-timeout", "60",
        "--host", host, "--csv", str(out / "locust"), "--out-dir", str(out),
        "--prompt-len", args.prompt_len, "--max-tokens", args.max_tokens, "--model", args.served_model,
        "--tokenizer", args.tokenizer, user_class,
    ]
    if args.dataset:
        command += ["--dataset", args.dataset]
    if args.api_key:
        command += ["--api-key", args.api_key]
    return command


def run_loadtest(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stack = contextlib.nullcontext()
    if args.start_stack:
        from backend.entrypoints.up import running_stack

        stack = running_stack(args, with_ui=False)
    with stack:
        if args.soak:
            return _soak(args, out)
        return subprocess.run(locust_command(args, out)).returncode


def _soak(args, out: Path) -> int:
    """The load, watched: non-zero exit on errors, memory growth or KV blocks held afterwards (loadtest/soak.py)."""
    import json

    from backend.entrypoints.serve import client_host
    from loadtest.soak import SoakLimits, SoakMonitor, verdict, write_verdict

    limits = SoakLimits(warm_up_s=args.soak_warm_up)
    ports = [args.gateway_port, args.http_port, args.grpc_port, args.metrics_port]
    monitor = SoakMonitor(ports, f"http://{client_host(args.triton_host)}:{args.metrics_port}/metrics").start()
    try:
        returncode = subprocess.run(locust_command(args, out)).returncode
    finally:
        monitor.stop()
    if not (out / "summary.json").exists():
        print("npu-llm soak: locust wrote no summary (see its output above)", flush=True)
        return returncode or 1
    summary = json.loads((out / "summary.json").read_text())["summary"]
    result = verdict(monitor, summary, monitor.drained(limits.drain_s), limits)
    write_verdict(out, result)
    return 1 if result["failures"] else returncode


def add_loadtest_args(parser) -> None:
    parser.add_argument("--target", choices=sorted(TARGETS), default="gateway")
    parser.add_argument("--host-url", "--host", dest="host_url", default=None,
                        help="where the target listens (default: its port on this machine)")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--spawn-rate", type=float, default=4)
    parser.add_argument("--run-time", default="60s")
    parser.add_argument("--out", default="artifacts/loadtest")
    parser.add_argument("--prompt-len", default="128", help="N or MIN:MAX prompt tokens (synthetic prompts)")
    parser.add_argument("--max-tokens", default="64", help="N or MIN:MAX output tokens (EOS ignored)")
    parser.add_argument("--dataset", default=None, help="JSONL of chat conversations")
    parser.add_argument("--served-model", "--model-name", dest="served_model", default=DEFAULT_MODEL,
                        help="the model name the gateway serves")
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--start-stack", action="store_true",
                        help="start Triton and the gateway for the run, and stop them after")
    parser.add_argument("--soak", action="store_true",
                        help="watch the stack's memory and KV cache during the run; fail on errors, memory growth "
                             "after warm-up, or KV blocks held once the users stop (writes soak.json)")
    parser.add_argument("--soak-warm-up", type=float, default=20.0, help="seconds before memory is compared")
