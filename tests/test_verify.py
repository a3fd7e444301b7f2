"""`npu-llm verify`: the device against torch_ref in fp32, on the CPU and on the fake NPU; a broken kernel fails it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from backend.config import EngineConfig


def test_the_cpu_in_float32_computes_the_reference():
    run = subprocess.run([sys.executable, "-m", "backend.entrypoints.cli", "verify", "--device", "cpu", "--dtype", "float32",
                          "--steps", "8"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "on cpu in float32 (eager) against npu_llm_kernels/torch_ref.py" in run.stdout
    assert run.stdout.count(" PASS") == 12 and "all figures within tolerance" in run.stdout


@pytest.mark.slow
def test_the_npu_passes_in_bfloat16_and_a_broken_kernel_fails(fake_npu, monkeypatch):
    from backend.entrypoints.verify import verify
    from npu_llm_kernels import npu

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


@pytest.mark.slow
def test_a_moe_model_passes_on_the_npu_with_decode_graphs_and_a_broken_router_fails(fake_npu, monkeypatch, tmp_path,
                                                                                  default_model_dir):
    """GLM-4.5's routing (grouped sigmoid, correction bias, shared expert) through torch_npu's MoE ops, replayed
    in decode graphs, against torch_ref in fp32; choosing the wrong experts is caught."""
    from backend.entrypoints.verify import verify
    from npu_llm_kernels import npu
    from tests.conftest import make_tiny_model

    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(default_model_dir))  # (verify's prompts are text)
    model = make_tiny_model("glm4_moe", tmp_path / "glm", vocab_size=vocab, decisive_routing=False)
    config = dict(model=str(model), tokenizer=str(default_model_dir), device="npu", dtype="bfloat16")
    heading, figures = verify(EngineConfig(**config, enforce_eager=False), steps=8)
    assert "(decode graphs)" in heading
    assert all(f.passed for f in figures), [(f.name, f.value) for f in figures if not f.passed]
    assert fake_npu.calls.get("npu_grouped_matmul", 0) > 0 and fake_npu.calls.get("npu_moe_gating_top_k", 0) > 0

    select = npu.select_experts

    def least_likely_experts(router_logits, *args):
        return select(-router_logits, *args)

    monkeypatch.setattr(npu, "select_experts", least_likely_experts)
    _, figures = verify(EngineConfig(**config), steps=2)
    assert "layers 3-3 cosine" in {f.name for f in figures if not f.passed}


@pytest.mark.slow
def test_a_quantized_model_against_its_source_passes_dynamic_and_w8a16_and_fails_static(tmp_path, default_model_dir):
    """`verify --reference`: W8A8 dynamic costs the default model what its scheme's tolerance allows; static W8A8,
    with one scale per layer for SmolLM2's outlier activations, costs more, and verify says so; grouped W8A16 passes
    its own, tighter tolerance."""
    from backend.entrypoints.quantize import quantize_checkpoint
    from backend.entrypoints.verify import verify

    dynamic = quantize_checkpoint(str(default_model_dir), tmp_path / "dynamic", "w8a8_dynamic")
    run = subprocess.run([sys.executable, "-m", "backend.entrypoints.cli", "verify", "--model", str(dynamic), "--reference",
                          str(default_model_dir), "--device", "cpu", "--dtype", "bfloat16", "--steps", "8"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"in bfloat16, w8a8_dynamic (eager) against {default_model_dir.name} on the CPU" in run.stdout

    static = quantize_checkpoint(str(default_model_dir), tmp_path / "static", "w8a8")
    _, figures = verify(EngineConfig(model=str(static), device="cpu", dtype="bfloat16"), steps=8,
                        reference=str(default_model_dir))
    assert {"logits cosine", "logits top-1 agreement"} <= {f.name for f in figures if not f.passed}

    weights_only = quantize_checkpoint(str(default_model_dir), tmp_path / "w8a16", "w8a16", group_size=64)
    _, figures = verify(EngineConfig(model=str(weights_only), device="cpu", dtype="bfloat16"), steps=8,
                        reference=str(default_model_dir))
    assert all(f.passed for f in figures), [f for f in figures if not f.passed]
    assert [f.limit for f in figures if f.name == "logits top-1 agreement"] == [0.9]
