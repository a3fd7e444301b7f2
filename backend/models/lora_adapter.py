"""A PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) read for one model and rank: checked
against the model, sharded as the model's own weights are, and packed per fused layer for backend/models/lora.py.

Each checkpoint projection the adapter targets adds `scale * B @ A` to its weight (scale = lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA). Our model fuses q/k/v into qkv_proj and gate/up into gate_up_proj, so an
adapter's parts of one fused layer are packed into one shrink and one expand: A's rows stacked ([w, in], w = parts x
r) and B's blocks on the diagonal ([out, w], the scale folded in), each block at the rows its projection's output
holds. Under tensor parallelism the shards follow vLLM's: a column-parallel layer (qkv, gate_up) splits B's rows as
it splits its weight's, a row-parallel one (o, down) splits A's columns; the model's checkpoint_shard names both.

Whatever cannot be served is refused with a ValueError naming it: DoRA, biases, embedding or lm_head targets,
modules_to_save, per-module ranks, a rank above max_lora_rank, a module the model lacks or that takes no adapter
here (experts, latent attention), and shapes that do not match the model.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from backend.config.json_object import json_object_file
from backend.models.architectures import head_dim_of

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# The layers that take adapters: the attention and dense-MLP projections of the decoder layers, as our model names
# them (fused); backend/models/lora.py gives these slots.
TARGET_LAYER = re.compile(r"model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))")
_TENSOR_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight")


@dataclass
class PackedLoRA:
    """One fused layer's share of an adapter, as two Linear weights: the shrink A [w, in] and the expand
    B * scale [out, w]."""

    a: torch.Tensor
    b: torch.Tensor


def read_adapter(path: str | Path, model, max_rank: int, dtype: torch.dtype) -> dict[str, PackedLoRA]:
    """The adapter at `path`, for this rank of `model`: fused layer name -> its packed weights (host memory)."""
    path = Path(path)
    config = _adapter_config(path)
    rank = config["r"]
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path}: rank {rank} is above max_lora_rank={max_rank}")
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        hint = " (adapter_model.bin is a pickle, which is never loaded: save with safetensors)" \
            if (path / "adapter_model.bin").exists() else ""
        raise ValueError(f"LoRA adapter {path}: no {WEIGHTS_FILE}{hint}")
    pairs = _read_pairs(path, weights)
    if not pairs:
        raise ValueError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    by_layer: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path}: {module} has lora_{''.join(pair)} without its other half")
        layer, part = _fused_target(model, module, path)
        a, b = _checked_and_sharded(model, module, pair["A"], pair["B"] * scale, rank, path)
        by_layer.setdefault(layer, []).append((part, a, b))
    return {layer: _pack(model, layer, parts, dtype) for layer, parts in by_layer.items()}


def _read_pairs(path: Path, weights: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint module -> {"A": tensor, "B": tensor}, as the file holds them."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                match = _TENSOR_KEY.fullmatch(key.removeprefix(PEFT_PREFIX))
                if match is None:
                    raise ValueError(f"LoRA adapter {path}: tensor {key} is not a LoRA A/B weight (embedding "
                                     "targets, biases and modules_to_save are not served)")
                pairs.setdefault(match["module"], {})[match["side"]] = f.get_tensor(key).float()
    except ValueError:
        raise
    except Exception as e:  # (safetensors' own error for a truncated or foreign file)
        raise ValueError(f"LoRA adapter {path}: {WEIGHTS_FILE} cannot be read: {e}") from None
    return pairs


def _adapter_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"LoRA adapter {path}: no {CONFIG_FILE} (a PEFT adapter folder holds it)")
    config = json_object_file(file, f"LoRA adapter {path}: {CONFIG_FILE}")
    refusals = {
        "peft_type": (lambda v: v not in (None, "LORA"), "only LoRA adapters are served"),
        "use_dora": (bool, "DoRA adapters are not served"),
        "bias": (lambda v: v not in (None, "none"), "adapters with biases are not served"),
        "modules_to_save": (bool, "modules_to_save (fully trained layers) are not served"),
        "rank_pattern": (bool, "per-module ranks (rank_pattern) are not served"),
        "alpha_pattern": (bool, "per-module alphas (alpha_pattern) are not served"),
        "fan_in_fan_out": (bool, "fan_in_fan_out (Conv1D) weights are not served"),
    }
    for key, (refused, why) in refusals.items():
        if refused(config.get(key)):
            raise ValueError(f"LoRA adapter {path}: {key}={config[key]!r}: {why}")
    for key in ("r", "lora_alpha"):
        if isinstance(config.get(key), bool) or not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} needs a positive {key}")
    return config


def _fused_target(model, module: str, path: Path) -> tuple[str, int]:
    """(our layer's name, the part of it) for a checkpoint module, e.g. model.layers.0.self_attn.k_proj ->
    (model.layers.0.self_attn.qkv_proj, 1)."""
    parent, _, name = module.rpartition(".")
    fused, part = model.stacked_params.get(name, (name, 0))
    layer = f"{parent}.{fused}"
    if TARGET_LAYER.fullmatch(layer) is None or getattr(_submodule(model, layer), "lora", None) is None:
        raise ValueError(f"LoRA adapter {path}: {module} is not a layer this model serves adapters on (the "
                         "attention and dense MLP projections: q/k/v/o_proj, gate/up/down_proj)")
    return layer, part


def _submodule(model, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def checkpoint_shape(config, projection: str) -> tuple[int, int]:
    """(out, in) of the base model's checkpoint weight of a projection (ValueError: one adapters cannot target)."""
    hidden, head_dim, inter = config.hidden_size, head_dim_of(config), config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    if projection not in shapes:
        raise ValueError(f"LoRA adapters on {projection} are not served (targets: {', '.join(shapes)})")
    return shapes[projection]


def _checked_and_sharded(model, module: str, a: torch.Tensor, b: torch.Tensor, rank: int, path: Path):
    """A [r, in] and B [out, r] checked against the base weight's shape, then this rank's shards of them."""
    out_features, in_features = checkpoint_shape(model.config, module.rpartition(".")[2])
    for side, tensor, expected in (("A", a, (rank, in_features)), ("B", b, (out_features, rank))):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"LoRA adapter {path}: {module}.lora_{side} has shape {tuple(tensor.shape)}, this "
                             f"model needs {expected} (an adapter trained for another base model?)")
    b = model.as_our_rows(f"{module}.weight", b)  # (GLM-4's q and k rows, reordered as the base weight's)
    shard = model.checkpoint_shard(f"{module}.weight")
    if shard is not None:
        dim, start, length = shard
        if dim == 1:  # row-parallel: this rank's input features
            a = a[:, start : start + length]
        else:  # column-parallel: this rank's output rows
            b = b[start : start + length]
    return a, b


def _pack(model, layer: str, parts: list[tuple[int, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> PackedLoRA:
    """The parts of one fused layer as one shrink and one block-diagonal expand."""
    linear = model.get_submodule(layer)
    fused_name = layer.rpartition(".")[2]
    sizes = model.shard_sizes(layer, fused_name) if fused_name in ("qkv_proj", "gate_up_proj") \
        else [linear.out_features]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    rank = parts[0][1].shape[0]
    expand = torch.zeros(linear.out_features, len(parts) * rank)
    for i, (part, _, b) in enumerate(parts):
        expand[offsets[part] : offsets[part] + sizes[part], i * rank : (i + 1) * rank] = b
    return PackedLoRA(torch.cat([a for _, a, _ in parts]).to(dtype), expand.to(dtype))
