"""GGUF files of the newer families load as their Hugging Face folders do: Qwen3 and Qwen3-MoE, the families most
often shared as GGUF, written here with the `gguf` package in llama.cpp's layout (tensor names from gguf's own
name map, experts stacked per layer, the default model's tokenizer copied in), then read back through
transformers' GGUF loader (backend/models/registry.py) and compared with the folder they came from."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from backend.models.loader import load_model
from backend.models.registry import gguf_to_folder
from npu_llm_kernels import ops_for
from tests.conftest import make_tiny_model
from tests.test_model_parity import _prompt_logits

pytestmark = pytest.mark.slow


def _copy_tokenizer(writer, source_gguf) -> None:
    """The tokenizer.* keys of another GGUF file (the default model's), as they are."""
    import gguf

    for name, field in gguf.GGUFReader(source_gguf).fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), kind)


def write_gguf(model_dir, path, arch: str, tokenizer_gguf) -> None:
    """model_dir's weights (fp32) and config as llama.cpp's converter writes them for `arch` (qwen3, qwen3moe)."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(model_dir / "model.safetensors")
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(layers)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta", 1e6)))
    if arch == "qwen3moe":
        experts = config.get("num_experts") or config["num_local_experts"]  # (transformers 5 saves the latter)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        for layer in range(layers):  # one [E, N, K] tensor per projection and layer, as llama.cpp stacks them
            prefix = f"model.layers.{layer}.mlp.experts"
            for proj in ("gate_proj", "up_proj", "down_proj"):
                keys = [f"{prefix}.{e}.{proj}.weight" for e in range(experts)]
                tensors[f"{prefix}.{proj}.weight"] = torch.stack([tensors.pop(k) for k in keys])
    _copy_tokenizer(writer, tokenizer_gguf)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE if arch == "qwen3moe" else gguf.MODEL_ARCH.QWEN3,
                                     layers)
    for key, tensor in tensors.items():
        writer.add_tensor(names.get_name(key, try_suffixes=(".weight", ".bias")), tensor.float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family,arch", [("qwen3", "qwen3"), ("qwen3_moe", "qwen3moe")])
def test_a_gguf_file_of_the_family_loads_the_same_weights(family, arch, tmp_path, monkeypatch, default_model_dir):
    from transformers import AutoTokenizer

    from backend.models.registry import _default_model_gguf

    monkeypatch.setenv("NPU_LLM_CACHE_DIR", str(tmp_path / "cache"))
    vocab = len(AutoTokenizer.from_pretrained(default_model_dir))  # (the tokenizer is the default model's)
    # What transformers does not read from these files' metadata takes its config's default, so the tiny model
    # has those sizes: Qwen3's head_dim (128), Qwen3-MoE's expert size (768).
    # GGUF has no dense layers in a Qwen3-MoE (mlp_only_layers).
    sizes = {"moe_intermediate_size": 768, "mlp_only_layers": []} if family == "qwen3_moe" else {"head_dim": 128}
    folder = make_tiny_model(family, tmp_path / family, vocab_size=vocab, **sizes)
    gguf_path = tmp_path / f"{family}.gguf"
    write_gguf(folder, gguf_path, arch, _default_model_gguf())
    converted = gguf_to_folder(gguf_path)
    assert json.loads((converted / "config.json").read_text())["architectures"] == [
        {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]]
    ours = [load_model(d, ops_for("cpu"), dtype="float32")[0] for d in (folder, converted)]
    prompt = list(range(100, 137))
    assert (_prompt_logits(ours[0], prompt, 16) - _prompt_logits(ours[1], prompt, 16)).abs().max() < 1e-4

