"""The UI holds the gateway's API key: off loopback it starts only behind a login (NPU_LLM_UI_AUTH), and `up` refuses
before starting anything."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NPU_LLM_API_KEY", "NPU_LLM_UI_AUTH")}
    return {**env, **extra}


@pytest.mark.parametrize("command", [["ui"], ["up", "--gateway-port", "1", "--http-port", "1"]])
def test_a_key_off_loopback_without_a_login_is_refused(command):
    done = subprocess.run([sys.executable, "-m", "backend.entrypoints.cli", *command, "--host", "0.0.0.0"],
                          env=_env(NPU_LLM_API_KEY="k"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "NPU_LLM_UI_AUTH=USER:PASSWORD" in done.stderr, done.stderr


def test_behind_a_login_the_ui_listens_off_loopback_and_answers_only_after_it(tmp_path):
    from backend.entrypoints.serve import wait_http

    port = free_port()
    with open(tmp_path / "ui.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "backend.entrypoints.cli", "ui", "--host", "0.0.0.0", "--port", str(port),
             "--gateway-url", f"http://127.0.0.1:{free_port()}"],
            env=_env(NPU_LLM_API_KEY="k", NPU_LLM_UI_AUTH="user:secret"), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/", process, "the UI", timeout=120)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/config", timeout=30).status_code == 401
        assert httpx.post(f"{base}/login", data={"username": "user", "password": "wrong"}, timeout=30).is_error
        with httpx.Client(base_url=base, timeout=30) as browser:
            assert browser.post("/login", data={"username": "user", "password": "secret"}).status_code == 200
            assert browser.get("/config").status_code == 200
    finally:
        process.terminate()
        process.wait(15)
