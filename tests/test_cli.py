"""The npu-llm command's failures are one clear line, not a traceback."""
from __future__ import annotations

import socket
import subprocess
import sys


def _npu_llm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.cli", *args], capture_output=True, text=True, timeout=120)


def _one_line_error(run: subprocess.CompletedProcess, expected: str) -> None:
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.startswith("npu-llm: error:")]
    assert len(lines) == 1 and expected in lines[0], run.stderr
    assert "Traceback" not in run.stderr


def test_serve_with_a_missing_model():
    _one_line_error(_npu_llm("serve", "--model", "/no/such/model"), "not found")


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
