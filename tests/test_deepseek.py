"""DeepSeek V2/V3: multi-head latent attention over a latent KV cache, YaRN, and DeepSeek's expert routing.

Tiny random models of V2-Lite's shape (no q low rank, greedy softmax routing, two shared experts) and V3's (q low
rank, grouped sigmoid routing with a correction bias, YaRN) equal transformers in fp32, with the rope dimensions
interleaved as DeepSeek lays them out or not; the engine serves them through chunked prefill, a prefix-cache hit
and preemption; and the KV cache holds one latent row a token, not keys and values per head. On the NPU:
tests/test_deepseek_npu.py."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from backend.engine.runner import ModelRunner
from backend.models.loader import ModelLoadError, load_model
from npu_llm_kernels import ops_for
from tests.conftest import TINY, TINY_MLA, make_tiny_model
from tests.test_model_parity import _check_against_hf
from tests.test_moe_models import served_through_chunks_hits_and_preemption

SHAPES = {
    "v2-lite": ("deepseek_v2", {}),
    "v2 group-limited": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    "v3": ("deepseek_v3", {}),
    "v3 rope not interleaved": ("deepseek_v3", dict(rope_interleave=False)),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_equals_transformers(shape, tmp_path):
    arch, overrides = SHAPES[shape]
    model_dir = make_tiny_model(arch, tmp_path / arch, **overrides)
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    _check_against_hf(model_dir, prompt, 16)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_the_engine_serves_it_through_chunks_cache_hits_and_preemption(arch, tmp_path, default_model_dir, caplog):
    """As a dense model (served_through_chunks_hits_and_preemption); the KV cache it reports holds the latent's
    bytes a token."""
    caplog.set_level(logging.INFO, logger="backend.engine.startup")
    with served_through_chunks_hits_and_preemption(arch, tmp_path, default_model_dir):
        pass
    latent = 3 * (TINY_MLA["kv_lora_rank"] + TINY_MLA["qk_rope_head_dim"]) * 4  # three layers, one fp32 row each
    assert f"{latent} bytes a token (latent rows)" in caplog.text


def test_the_kv_cache_is_one_latent_row_a_token_shared_by_key_and_value(tmp_path):
    """One tensor a layer, [blocks, block size, 1, kv_lora_rank + qk_rope_head_dim], read as both key and value:
    at this shape 48 values a token and layer, where keys and values per head would take 4 * (40 + 20)."""
    model, _, _ = load_model(make_tiny_model("deepseek_v3", tmp_path / "v3"), ops_for("cpu"), dtype="float32")
    runner = ModelRunner(model, num_blocks=4, block_size=16, device="cpu")
    key_cache, value_cache = runner.kv_caches[0]
    assert value_cache is key_cache and key_cache.shape == (5, 16, 1, 48)
    heads = TINY["num_attention_heads"]
    per_head = heads * (TINY_MLA["qk_nope_head_dim"] + TINY_MLA["qk_rope_head_dim"] + TINY_MLA["v_head_dim"])
    assert ModelRunner.bytes_per_block(model, 1) == 3 * 48 * 4 < 3 * per_head * 4


def test_a_quantized_checkpoint_is_refused_naming_its_method(tmp_path):
    """DeepSeek V3's release is FP8 with block scales: loaded as plain weights it would be garbage."""
    model_dir = make_tiny_model("deepseek_v3", tmp_path / "v3")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quant_method 'fp8' is not served"):
        load_model(model_dir, ops_for("cpu"), dtype="float32")


def test_verify_passes_in_bfloat16_on_the_cpu(tmp_path, default_model_dir):
    """`npu-llm verify`: the engine's kernels in bf16 against torch_ref in fp32, on V3's shape."""
    from transformers import AutoTokenizer

    from backend.config import EngineConfig
    from backend.entrypoints.verify import verify

    vocab = len(AutoTokenizer.from_pretrained(default_model_dir))  # (verify's prompts are text)
    model_dir = make_tiny_model("deepseek_v3", tmp_path / "v3", vocab_size=vocab, decisive_routing=False)
    config = EngineConfig(model=str(model_dir), tokenizer=str(default_model_dir), device="cpu", dtype="bfloat16")
    heading, figures = verify(config, steps=8)
    assert "on cpu in bfloat16" in heading
    assert all(f.passed for f in figures), [(f.name, f.value) for f in figures if not f.passed]
    assert {f.name for f in figures} >= {"layers 3-3 cosine", "logits top-1 agreement", "greedy tokens agreed (8 steps)"}
