"""The npu-llm command: its failures are one clear line, not a traceback; bench throughput and chat run as a
person runs them."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import SMALL_KV_CACHE


def _npu_llm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.entrypoints.cli", *args], capture_output=True, text=True, timeout=120)


def _one_line_error(run: subprocess.CompletedProcess, expected: str) -> None:
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.startswith("npu-llm: error:")]
    assert len(lines) == 1 and expected in lines[0], run.stderr
    assert "Traceback" not in run.stderr


def test_serve_with_a_missing_model():
    _one_line_error(_npu_llm("serve", "--model", "/no/such/model"), "not found")


def test_serve_disaggregated_without_the_shared_control_key():
    """Each side of a deployment started apart would make its own key, and its consumers would refuse every pull."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "NPU_LLM_CONTROL_KEY"}
    config = '{"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer"}'
    run = subprocess.run([sys.executable, "-m", "backend.entrypoints.cli", "serve", "--engine-arg",
                          f"kv_transfer_config={config}"], capture_output=True, text=True, timeout=120, env=env)
    _one_line_error(run, "share one NPU_LLM_CONTROL_KEY")
    bad = subprocess.run([sys.executable, "-m", "backend.entrypoints.cli", "serve", "--http-port", "1"],
                         capture_output=True, text=True, timeout=120, env={**env, "NPU_LLM_CONTROL_KEY": "a b"})
    _one_line_error(bad, "NPU_LLM_CONTROL_KEY must be")


def test_serve_with_a_busy_port():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        _one_line_error(_npu_llm("serve", "--http-port", str(port)), f"HTTP port {port} is already in use")


def test_serve_with_an_unknown_engine_argument():
    _one_line_error(_npu_llm("serve", "--engine-arg", "warp_speed=9"), "warp_speed")


def test_chat_with_a_bad_block_size():
    _one_line_error(_npu_llm("chat", "--block-size", "3"), "block_size=3")


def test_engine_commands_take_engine_args_over_their_flags():
    _one_line_error(_npu_llm("chat", "--block-size", "16", "--engine-arg", "block_size=3"), "block_size=3")
    _one_line_error(_npu_llm("bench", "throughput", "--engine-arg", "warp_speed=9"), "warp_speed")
    _one_line_error(_npu_llm("verify", "--engine-arg", "tensor_parallel_size=3"), "run it without tensor_parallel_size")


def test_bench_throughput_runs_and_reports_both_engines():
    import json

    run = subprocess.run(
        [sys.executable, "-m", "backend.entrypoints.cli", "bench", "throughput", "--dtype", "float32", "--num-prompts", "3",
         "--input-len", "12:20", "--output-len", "5", "--hf-batch-size", "3", "--engine-arg", SMALL_KV_CACHE],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["num_prompts"] == 3 and result["output_tokens"] == 15 and 36 <= result["prompt_tokens"] <= 60
    assert result["ours"]["output_tokens_per_s"] > 0 and result["hf"]["output_tokens_per_s"] > 0
    assert result["output_throughput_ratio"] == pytest.approx(result["hf"]["elapsed_s"] / result["ours"]["elapsed_s"],
                                                              rel=0.05)


def test_bench_serving_runs_in_process_and_through_the_stack_it_starts():
    """A tiny `npu-llm bench serving`: the same prompts in-process, through Triton gRPC and through the gateway,
    the ratios between them, and throughput at each concurrency; the stack it started is gone afterwards."""
    import json
    import socket

    from tests.conftest import free_port

    ports = {name: free_port() for name in ("gateway", "http", "grpc", "metrics")}
    run = subprocess.run(
        [sys.executable, "-m", "backend.entrypoints.cli", "bench", "serving", "--num-prompts", "2", "--input-len", "16",
         "--output-len", "4", "--concurrency", "1", "2", "--engine-arg", "max_num_seqs=4",
         "--engine-arg", SMALL_KV_CACHE,
         *(a for name, port in ports.items() for a in (f"--{name}-port", str(port)))],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["prompts"] == 2 and result["output_len"] == 4
    for path in ("triton_grpc", "gateway"):
        for figure in ("ttft_ms", "itl_ms"):
            assert result[path][figure] > 0 and result["in_process"][figure] > 0
            assert result["ratio_vs_in_process"][path][figure] == round(
                result[path][figure] / result["in_process"][figure], 2)
    assert set(result["gateway_output_tokens_per_s"]) == {"1", "2"}
    assert all(v > 0 for v in result["gateway_output_tokens_per_s"].values())
    for name, port in ports.items():
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, name


def test_chat_streams_in_a_terminal_and_ctrl_c_stops_a_reply():
    """Under a pseudo-terminal, as a person runs it: a reply streams; Ctrl-C (the terminal's SIGINT) stops a long
    one and the chat goes on; Ctrl-D quits."""
    import os
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal
        os.execv(sys.executable, [sys.executable, "-m", "backend.entrypoints.cli", "chat", "--dtype", "float32",
                                  "--max-tokens", "1500", "--temperature", "0", "--engine-arg", SMALL_KV_CACHE])
    seen = b""

    def read_more(timeout: float) -> None:
        nonlocal seen
        if select.select([fd], [], [], timeout)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:  # the child exited
                pass

    def read_until(marker: bytes, timeout: float, after: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while marker not in seen[after:]:
            assert time.monotonic() < deadline, f"no {marker!r} in {seen[-2000:]!r}"
            read_more(0.2)

    try:
        read_until(b"you> ", 300)
        os.write(fd, b"Write a very long story about a dragon, with many chapters.\n")
        read_until(b"bot> ", 60)
        start, deadline = len(seen), time.monotonic() + 60
        while len(seen) - start < 40 and time.monotonic() < deadline:  # the reply streams
            read_more(0.2)
        assert len(seen) - start >= 40
        os.write(fd, b"\x03")  # Ctrl-C
        read_until(b"[stopped]", 30, after=start)
        read_until(b"you> ", 30, after=seen.index(b"[stopped]"))  # ready for the next message
        os.write(fd, b"\x04")  # Ctrl-D
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.close(fd)


def test_serve_and_up_take_the_engine_s_flags_over_model_json():
    """vLLM's `vllm serve --dtype float32 ...`: every engine argument as a flag, over model.json's value; what no
    flag sets stays model.json's; --engine-arg KEY=VALUE still works."""
    import json

    from backend.entrypoints.cli import build_parser
    from backend.entrypoints.serve import checked_engine_args
    from backend.triton.launcher import DEFAULT_REPOSITORY

    served = json.loads((DEFAULT_REPOSITORY / "llm" / "1" / "model.json").read_text())
    for command in ("serve", "up"):
        args = build_parser().parse_args([command, "--dtype", "float32", "--max-model-len", "512",
                                          "--no-enable-prefix-caching", "--engine-arg", "seed=3"])
        _, overrides, model = checked_engine_args(args)
        assert overrides == {"dtype": "float32", "max_model_len": 512, "enable_prefix_caching": False, "seed": 3}
        assert model.config.dtype == "float32" and model.config.max_num_seqs == served["max_num_seqs"]
