"""Load a checkpoint (Hugging Face folder or GGUF file) into our modules: only this rank's shards are read, and
a checkpoint that does not fill every parameter, or fills one with the wrong shape, fails the load."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import ModuleType

import torch
from safetensors import SafetensorError, safe_open

from backend.distributed import SINGLE, TensorParallel
from backend.models.architectures import SUPPORTED_ARCHITECTURES, extra_layers_of, language_config_of
from backend.models.llama import LlamaForCausalLM
from backend.models.moe import EXPERT_TENSOR, FusedMoE, Router
from backend.models.eagle import Eagle3Head, EagleHead, HeadCheckpoint
from backend.models.mtp import MultiTokenPredictor, attach_mtp
from backend.models.qwen_vl import Qwen2_5_VLForConditionalGeneration
from backend.models.remote_code import qwen_v1_key, remote_code_config
from backend.models.quantization import (
    PACKED_SHAPE, SYMMETRIC_ZERO_POINTS, CompressedTensors, ModelSlim, UnsupportedQuantization, as_loaded,
    check_scales, fold_modelslim, folded_into_quant_bias, quantization_of, quantize_layers, unpack_weights,
)
from backend.models.registry import resolve_model

# Checkpoint tensors of one value per layer (a static activation scale, and msModelSlim's offset): every rank reads
# them whole, and the parts of a fused layer each fill their own entry.
PER_TENSOR = (".input_scale", ".input_offset")
log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    pass


def load_config(model_dir: Path):
    from transformers import AutoConfig

    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json (not a Hugging Face model folder)")
    try:
        # a checkpoint published with remote code, read as the architecture it is (backend/models/remote_code.py)
        config = remote_code_config(json.loads(path.read_text()), model_dir) or AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    architectures = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: unsupported architecture {architectures or config.model_type!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return language_config_of(config)


def model_class(config) -> type[LlamaForCausalLM]:
    """Our module for the config's architecture: one decoder for all, a vision tower beside it for Qwen2.5-VL."""
    return Qwen2_5_VLForConditionalGeneration if getattr(config, "vision_language", None) else LlamaForCausalLM


def stored_dtype_of(config) -> torch.dtype | None:
    """The dtype a Hugging Face config says its weights are stored in (transformers 5 names it dtype, 4 torch_dtype)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return getattr(torch, stored) if isinstance(stored, str) else stored


def resolve_dtype(dtype: str | torch.dtype, config, device: torch.device) -> torch.dtype:
    """`auto` follows vLLM: a half-precision checkpoint keeps its dtype, fp32 runs in bf16; CPUs get bf16 for fp16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
        if dtype == "float32" and device.type == "npu":
            raise ValueError("dtype=float32: the NPU paged-attention kernels run float16 and bfloat16 only")
        return DTYPES[dtype]
    if stored_dtype_of(config) == torch.float16 and device.type != "cpu":
        return torch.float16
    return torch.bfloat16


def max_model_len_of(config) -> int:
    """The longest sequence the model handles correctly: its trained length, or its sliding window if shorter."""
    limit = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    if window and (config.model_type in ("mistral", "mixtral") or getattr(config, "use_sliding_window", False)):
        limit = min(limit, window)  # we implement full attention only, which equals windowed attention up to here
    return limit


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: listed in {index.name} but missing")
    return files


def load_model(
    model: str | Path,
    ops: ModuleType,
    device: torch.device | str = "cpu",
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    tp: TensorParallel = SINGLE,
    expert_parallel: bool = False,
    mtp: bool = False,
    quantization: str | None = None,
    head: tuple[str, str] | None = None,
):
    """(model, config, model_dir): weights loaded on `device` in `dtype`, rope table sized for max_model_len;
    under tensor parallelism, only this rank's shards are read (and its experts, with expert_parallel); with mtp,
    the checkpoint's multi-token-prediction layer too (backend/models/mtp.py); with head (method, folder), an EAGLE or
    EAGLE-3 draft head from its own folder (backend/models/eagle.py). A quantized checkpoint's int8 layers stay int8
    (backend/models/quantization.py); `quantization` is vLLM's flag, None to follow config.json."""
    device = torch.device(device)
    model_dir = resolve_model(model)
    config = load_config(model_dir)
    try:
        quant = quantization_of(config, quantization, model_dir / "config.json")
    except UnsupportedQuantization as e:
        raise ModelLoadError(str(e)) from e
    torch_dtype = resolve_dtype(dtype, config, device)
    try:
        with torch.device("meta"):
            module = model_class(config)(config, ops, tp, expert_parallel)
            if module.is_multimodal and (mtp or head is not None):
                raise ValueError("a draft head (MTP, EAGLE) is not served for a vision-language model (its positions "
                                 "are M-RoPE's); n-gram or a draft model drafts for it")
            if mtp:
                attach_mtp(module)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: {e}") from e
    checkpoint = None
    if head is not None:
        checkpoint = HeadCheckpoint(*head, config)  # (ValueError naming speculative_config.model)
        with torch.device("meta"):
            _attach_head(module, checkpoint)
    # Cast while still on meta, so the device never holds a float32 copy of the weights (freed fp32
    # blocks would stay reserved by the caching allocator and count against the KV cache).
    module = module.to(torch_dtype)
    if quant is not None:
        _quantize(module, quant, ops, model_dir)
    for router in (m for m in module.modules() if isinstance(m, Router)):
        router.float()
    try:
        ops.require_ops(_kernel_parts(module))  # (on the NPU: a torch_npu that has every op they call)
    except RuntimeError as e:
        raise ModelLoadError(f"{model_dir.name}: {e}") from e
    module = module.to_empty(device=device)
    files = checkpoint_files(model_dir)
    if quant is not None:
        try:
            quant.check_tensors(_stored_keys(files), model_dir)
        except UnsupportedQuantization as e:
            raise ModelLoadError(str(e)) from e
    _load_weights(module, files, checkpoint)
    if quant is not None:
        try:
            check_scales(module)
            if isinstance(quant, ModelSlim):
                fold_modelslim(module)
            unpack_weights(module)
        except UnsupportedQuantization as e:
            raise ModelLoadError(f"{model_dir}: {e}") from e
    module.pack_weights()
    module.init_expert_load()
    module.init_rope(max_model_len or max_model_len_of(config))
    return module.eval(), config, model_dir


def _quantize(module: LlamaForCausalLM, quant: CompressedTensors | ModelSlim, ops: ModuleType,
              model_dir: Path) -> None:
    """Give the layers the checkpoint stores in int8 their int8 parameters (still on the meta device)."""
    where = quant.path if isinstance(quant, ModelSlim) else model_dir / "config.json"
    kinds = [kind for kind, present in (("latent attention", module.latent_kv),
                                        ("a draft head", module.draft_head is not None)) if present]
    if kinds:
        raise ModelLoadError(f"{where}: {quant.description} is served for models of plain attention; this one has "
                             f"{' and '.join(kinds)} (not served quantized yet)")
    try:
        quantize_layers(module, quant)
    except UnsupportedQuantization as e:
        raise ModelLoadError(f"{where}: {e}") from e
    log.info("%s: %s", where.parent.name, quant.description)


def _kernel_parts(module: LlamaForCausalLM) -> set[str]:
    """The parts of the model whose kernels a platform may need a release for (npu_llm_kernels.npu_releases.OPS)."""
    parts = {"latent attention (MLA)"} if module.latent_kv else set()
    if module.is_multimodal:
        parts.add("vision tower")
    for layer in module.modules():
        if isinstance(layer, FusedMoE):
            parts.add("mixture of experts")
        scheme = getattr(layer, "scheme", None)  # (an Int8Scheme on a quantized Linear or FusedMoE)
        if scheme is not None:
            parts.add("W8A16" if scheme.weight_only else "W8A8")
    return parts


def _stored_keys(files: list[Path]) -> set[str]:
    keys: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                keys.update(f.keys())
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from e
    return keys


def _attach_head(module: LlamaForCausalLM, checkpoint: HeadCheckpoint) -> None:
    """An EAGLE / EAGLE-3 head after the decoder layers (model.layers.{num_hidden_layers}: a layer of the KV cache of
    its own); EAGLE-3's target keeps the inputs of the three layers it fuses."""
    if module.latent_kv:
        raise ValueError("EAGLE heads are served for models of plain attention (not DeepSeek's latent attention)")
    config, index, tp = module.config, module.config.num_hidden_layers, module.tp
    if checkpoint.method == "eagle":
        module.model.layers.append(EagleHead(config, checkpoint.config, index, module.ops, tp))
    else:
        module.model.layers.append(Eagle3Head(config, checkpoint.config, module.ops, checkpoint.own_embedding, tp))
        module.model.aux_layers = checkpoint.aux_layers(config.num_hidden_layers)


def _load_weights(module: LlamaForCausalLM, files: list[Path], head: HeadCheckpoint | None = None) -> None:
    experts = {name: m for name, m in module.named_modules() if isinstance(m, FusedMoE)}
    params = {name: p for name, p in module.named_parameters() if name.rsplit(".", 1)[0] not in experts}
    unfilled = {name: p.shape[0] for name, p in params.items()}  # rows still to be loaded per parameter
    vision: dict[str, torch.Tensor] = {}  # a vision-language model's vision tower, loaded whole on every rank
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for stored in f.keys():
                    key = _our_key(stored)
                    if key.startswith("visual.") and module.is_multimodal:
                        vision[key.removeprefix("visual.")] = f.get_tensor(stored)
                        continue
                    if _beyond_the_model(module, key):
                        continue
                    expert = EXPERT_TENSOR.match(key)
                    if expert:
                        _load_expert_tensor(experts, expert, f, stored, path)
                        continue
                    if key.endswith(PACKED_SHAPE):  # (weight_packed's own shape, checked as it loads, says it)
                        continue
                    if fused := next((name for name in FUSED_IN_CHECKPOINT if name in key), None):
                        for part, tensor in _fused_parts(module, key, fused, f.get_tensor(stored)):
                            _load_tensor(module, params, unfilled, part, _shard_of(tensor, module, part), path)
                        continue
                    shard = None if key.endswith(PER_TENSOR) else module.checkpoint_shard(key)
                    tensor = _read(f, stored, shard, module.tp.size, path)
                    _load_tensor(module, params, unfilled, key, module.as_our_rows(key, tensor), path)
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from e
    if head is not None:
        _load_head(module, params, unfilled, head)
    if module.is_multimodal:
        _load_vision(module.visual, vision, files[0].parent)
    missing = [name for name, rows in unfilled.items() if rows and not name.startswith("visual.")]
    missing += [f"{name} ({part})" for name, m in experts.items() for part in m.missing()]
    if missing:
        raise ModelLoadError(f"{files[0].parent}: checkpoint lacks tensors for {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _our_key(stored: str) -> str:
    """A checkpoint tensor's name in our modules: Qwen v1's (backend/models/remote_code.py); Mixtral's MoE block is our
    mlp; a vision-language checkpoint saved by transformers 4.52 and later nests the decoder (model.language_model.)
    and the tower (model.visual.)."""
    key = qwen_v1_key(stored).replace(".block_sparse_moe.", ".mlp.")
    if key.startswith("model.language_model."):
        return "model." + key.removeprefix("model.language_model.")
    return key.removeprefix("model.") if key.startswith("model.visual.") else key


def _load_vision(visual: torch.nn.Module, tensors: dict[str, torch.Tensor], model_dir: Path) -> None:
    """The vision tower's tensors, each exactly once and of its parameter's shape."""
    expected = dict(visual.named_parameters())
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(f"{model_dir}: the vision tower's checkpoint tensors do not match it"
                             + (f"; missing visual.{', visual.'.join(missing[:5])}" if missing else "")
                             + (f"; unexpected visual.{', visual.'.join(unexpected[:5])}" if unexpected else ""))
    for name, tensor in tensors.items():
        param = expected[name]
        if param.shape != tensor.shape:
            raise ModelLoadError(f"{model_dir}: tensor 'visual.{name}' has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(param.shape)}")
        param.data.copy_(tensor)


def _load_head(module: LlamaForCausalLM, params, unfilled, head: HeadCheckpoint) -> None:
    """An EAGLE / EAGLE-3 head's tensors, renamed into the model (its d2t map is a buffer), this rank's shards of
    them under tensor parallel; what it lacks is named."""
    index = module.config.num_hidden_layers
    layer = module.model.layers[index]
    for path in head.files:
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():
                key = head.our_key(stored, index)
                if key is None:
                    continue
                if key.endswith(".d2t") and hasattr(layer, "d2t"):
                    layer.d2t.copy_(f.get_tensor(stored).to(torch.long))
                    continue
                tensor = _read(f, stored, module.checkpoint_shard(key), module.tp.size, path)
                _load_tensor(module, params, unfilled, key, tensor, path)
    missing = [name for name, rows in unfilled.items() if rows and name.startswith(f"model.layers.{index}.")]
    if missing:
        raise ModelLoadError(f"{head.folder}: the {head.method} head lacks tensors for {', '.join(missing[:5])}")


def _beyond_the_model(module: LlamaForCausalLM, key: str) -> bool:
    """A layer the checkpoint carries and the model does not run (a multi-token-prediction layer, unless it drafts:
    an EAGLE head in its place comes from its own folder), or the prediction layer's copy of the embedding (the
    model's own serves it)."""
    if not key.startswith("model.layers."):
        return False
    index, config = int(key.split(".")[2]), module.config
    if index == config.num_hidden_layers and isinstance(module.draft_head, MultiTokenPredictor):
        return key.endswith(".embed_tokens.weight")
    return config.num_hidden_layers <= index < config.num_hidden_layers + extra_layers_of(config)


def _load_expert_tensor(experts: dict[str, FusedMoE], match, f, stored: str, path: Path) -> None:
    layer = experts.get(f"{match['block']}.experts")
    if layer is None:
        raise ModelLoadError(f"{path}: unexpected tensor {stored!r}: that layer has no experts")
    try:
        layer.load(match, lambda index: f.get_slice(stored)[index] if index else f.get_tensor(stored))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e


def _read(f, key: str, shard: tuple[int, int, int] | None, ranks: int, path: Path) -> torch.Tensor:
    """A checkpoint tensor, or only the slice of it this rank holds (read from the file, not sliced after).

    A row-parallel layer's shard is in input features. Its tensors hold them one a column (weight), four a column
    (pack-quantized weight_packed), a group a column (grouped weight_scale), or all in one (a per-channel scale or
    offset, which every rank reads whole)."""
    if shard is None:
        return f.get_tensor(key)
    dim, start, length = shard
    part = f.get_slice(key)
    if dim == 0:
        return part[start:start + length]
    shape = part.get_shape()
    columns, features = shape[-1], length * ranks
    if len(shape) != 2 or columns == 1:  # (a tensor of another rank: its shape check names it)
        return part[:]
    per_column = features // columns
    if per_column * columns != features or start % per_column or length % per_column:
        raise ModelLoadError(f"{path}: tensor {key!r} holds {columns} columns for {features} input features, which "
                             f"do not split into {ranks} ranks' shares of {length}")
    return part[:, start // per_column:(start + length) // per_column]


# Layers some checkpoints store fused (GLM-4's gate_up_proj, Qwen v1's c_attn): loaded as the parts they are, so that
# each part takes the path (shards, row order) the unfused checkpoints' do.
FUSED_IN_CHECKPOINT = {".gate_up_proj.": (".gate_proj.", ".up_proj."), ".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj.")}


def _fused_parts(module: LlamaForCausalLM, key: str, fused: str, whole: torch.Tensor):
    """(the part's key, its tensor) of a fused checkpoint tensor; a per-tensor value is every part's."""
    names = FUSED_IN_CHECKPOINT[fused]
    if key.endswith(PER_TENSOR):
        return [(key.replace(fused, name), whole) for name in names]
    config = module.config
    head_dim = module.model.layers[0].self_attn.head_dim
    sizes = [config.num_attention_heads * head_dim] + [config.num_key_value_heads * head_dim] * 2 \
        if fused == ".qkv_proj." else [len(whole) // 2] * 2
    if sum(sizes) != len(whole):
        raise ModelLoadError(f"tensor {key!r} has {len(whole)} rows; its parts {', '.join(names)} make {sum(sizes)}")
    parts = [key.replace(fused, name) for name in names]
    return [(part, module.as_our_rows(part, rows)) for part, rows in zip(parts, whole.split(sizes))]


def _shard_of(tensor: torch.Tensor, module: LlamaForCausalLM, key: str) -> torch.Tensor:
    """This rank's slice of a checkpoint tensor already read whole."""
    shard = module.checkpoint_shard(key)
    return tensor if shard is None else tensor.narrow(*shard)


def _load_tensor(module, params, unfilled, key: str, tensor: torch.Tensor, path: Path) -> None:
    if "rotary_emb.inv_freq" in key:
        return
    if key == "lm_head.weight" and module.tie_word_embeddings:
        return
    if key.endswith(SYMMETRIC_ZERO_POINTS) and not tensor.any():
        return
    target, rows = key, slice(None)
    for part, (fused, shard) in module.stacked_params.items():
        if f".{part}." in key:
            target = key.replace(f".{part}.", f".{fused}.")
            sizes = module.shard_sizes(key, fused)
            rows = slice(shard, shard + 1) if key.endswith(PER_TENSOR) else \
                slice(sum(sizes[:shard]), sum(sizes[: shard + 1]))
            break
    if key.endswith(PER_TENSOR) and tensor.dim() == 0:  # (older checkpoints store a scalar)
        tensor = tensor.reshape(1)
    param = params.get(target)
    if param is None and folded_into_quant_bias(module, target):
        return
    if param is None:
        raise ModelLoadError(f"{path}: unexpected tensor {key!r} for {module.config.architectures[0]}")
    dest = param.data[rows]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"{path}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    try:
        tensor = as_loaded(dest, tensor, key, path)
    except UnsupportedQuantization as e:
        raise ModelLoadError(str(e)) from e
    dest.copy_(tensor)
    unfilled[target] -= dest.shape[0]
