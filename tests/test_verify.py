"""`npu-llm verify`: the device against torch_ref in fp32, on the CPU and on the fake NPU; a broken kernel fails it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from backend.config import EngineConfig


def test_the_cpu_in_float32_computes_the_reference():
    run = subprocess.run([sys.executable, "-m", "backend.cli", "verify", "--device", "cpu", "--dtype", "float32",
                          "--steps", "8"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "on cpu in float32 (eager) against kernels/torch_ref.py" in run.stdout
    assert run.stdout.count(" PASS") == 12 and "all figures within tolerance" in run.stdout


@pytest.mark.slow
def test_the_npu_passes_in_bfloat16_and_a_broken_kernel_fails(fake_npu, monkeypatch):
    from backend.verify import verify
    from kernels import npu

    heading, figures = verify(EngineConfig(device="npu", dtype="bfloat16", enforce_eager=False), steps=8)
    assert "on npu:0 in bfloat16 (decode graphs)" in heading
    assert all(f.passed for f in figures), [(f.name, f.value) for f in figures if not f.passed]
    assert {f.name for f in figures} >= {"layers 1-7 cosine", "logits top-1 agreement", "greedy tokens agreed (8 steps)"}

    rotate = npu.rotary_embedding

    def keys_left_unrotated(positions, query, key, table):
        return rotate(positions, query, key.clone(), table)[0], key

    monkeypatch.setattr(npu, "rotary_embedding", keys_left_unrotated)
    _, figures = verify(EngineConfig(device="npu", dtype="bfloat16"), steps=2)
    failed = {f.name for f in figures if not f.passed}
    assert {"layers 1-7 cosine", "logits cosine", "logits top-1 agreement"} <= failed, failed
