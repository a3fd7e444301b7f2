"""The loader's errors name the file and the tensor; the default model resolves offline."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from backend.models.loader import ModelLoadError, load_model
from backend.models.registry import ModelNotFoundError, resolve_model
from npu_llm_kernels import ops_for

OPS = ops_for("cpu")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_folder_without_weights(tiny_llama_dir, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", folder)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_model(folder, OPS)


def test_unknown_architecture(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(folder, OPS)


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(folder, OPS)


def test_shape_mismatch_names_tensor(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight'"):
        load_model(folder, OPS)


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks tensors for model.layers.1.post_attention_layernorm.weight"):
        load_model(folder, OPS)


def test_sharded_checkpoint_loads_like_single_file(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").exists()
    single, _, _ = load_model(tiny_llama_dir, OPS, dtype="float32")
    sharded, _, _ = load_model(folder, OPS, dtype="float32")
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name


def test_dtype_choice(tiny_llama_dir):
    assert load_model(tiny_llama_dir, OPS, dtype="auto")[0].model.embed_tokens.weight.dtype == torch.bfloat16
    assert load_model(tiny_llama_dir, OPS, dtype="float16")[0].model.norm.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype must be"):
        load_model(tiny_llama_dir, OPS, dtype="float8")


def test_unknown_model_path():
    with pytest.raises(ModelNotFoundError, match="never downloaded"):
        resolve_model("/nonexistent/model")


def test_default_model_resolves_offline(default_model_dir):
    assert resolve_model("smollm2-135m-instruct") == default_model_dir
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert (default_model_dir / "tokenizer.json").exists()


def test_weights_are_materialised_in_the_target_dtype(tiny_llama_dir):
    """No float32 copy of the weights exists on the device on the way to bf16: the caching allocator of an
    accelerator would keep its freed blocks reserved, memory the KV cache then lacks."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Materialisations(TorchDispatchMode):
        dtypes: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.empty_like.default and out.device.type != "meta":
                self.dtypes.add(out.dtype)
            return out

    with Materialisations() as seen:
        model, _, _ = load_model(tiny_llama_dir, OPS, "cpu", "bfloat16")
    assert seen.dtypes == {torch.bfloat16}
    assert model.dtype == torch.bfloat16
