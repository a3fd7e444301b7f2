"""Quantized checkpoints: which linear layers of a model hold int8 weights, and how their activations are quantized.

Read from the checkpoint's own description, as vLLM and vllm-ascend read it (docs/quantization.md):

- compressed-tensors: a `quantization_config` with `quant_method: compressed-tensors` in config.json
  (llm-compressor's format, and `npu-llm quantize`'s), parsed by the compressed-tensors package itself;
- msModelSlim (`quantization="ascend"`): `quant_model_description.json` beside the weights, each tensor's type
  (`W8A8`, `W8A8_DYNAMIC`, or `FLOAT` for a layer kept in its precision), as vllm-ascend's AscendModelSlimConfig
  reads it.

The schemes served:

- W8A8 dynamic: int8 weights, one scale per output channel (`weight` int8 [N, K], `weight_scale` [N, 1]);
  activations quantized per token as each step runs.
- W8A8 dynamic experts: a MoE layer's experts, each stored one by one as a dynamic W8A8 layer.
- W8A8 static: the same weights; activations quantized with one calibrated scale per layer (`input_scale` [1]).
  msModelSlim's adds an integer `input_offset` [1] (asymmetric activations) and stores what dequantizes the int32
  sums: `deq_scale` [N] (input_scale * weight_scale; fp32, or int64 as npu_trans_quant_param packs it for fp16
  models) and `quant_bias` [N] int32 (the float bias over deq_scale, less the offset times the weights' row sums).
- W8A16: int8 weights, activations left in the model's dtype; the weights are dequantized as they are multiplied.
  compressed-tensors' scales are per output channel or per group of input features (`weight_scale` [N, K / G]),
  its weights stored `pack-quantized` (`weight_packed` int32 [N, K / 4], four values a word, unpacked after
  loading); msModelSlim's are per channel with a `weight_offset` [N, 1]: w = (q + offset) * scale.

Everything else a checkpoint may ask for (other bit widths, asymmetric compressed-tensors weights, fp8, a
quantized KV cache, static or weight-only experts, latent attention) fails the load, naming what was asked:
nothing is served in a precision other than the checkpoint's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from backend.config import QUANTIZATION_CHOICES
from backend.models.layers import Linear
from backend.models.moe import FusedMoE

FORMAT = "int-quantized"  # compressed-tensors' format for int8 weights stored as int8 tensors
PACKED_FORMAT = "pack-quantized"  # ... and for weights packed in int32 words (llm-compressor's for weight-only schemes)


@dataclass(frozen=True)
class Int8Scheme:
    """How one linear layer runs: int8 weights with per-channel scales, and its activations' quantization."""

    name: str  # what the docs and the start-up log call it
    dynamic: bool  # True: a scale per token, computed each step; False: the checkpoint's input_scale (or none)
    modelslim: bool = False  # msModelSlim's tensors: weight_offset, and (static) input_offset, quant_bias, deq_scale
    weight_only: bool = False  # W8A16: activations stay in the model's dtype
    group_size: int = 0  # weight scales per group of so many input features; 0: one per output channel
    packed: bool = False  # compressed-tensors' pack-quantized: `weight_packed`, four int8 values a 32-bit word

    @property
    def static(self) -> bool:
        """Activations quantized with the checkpoint's input_scale."""
        return not self.dynamic and not self.weight_only


W8A8_DYNAMIC = Int8Scheme("w8a8_dynamic", dynamic=True)
W8A8_STATIC = Int8Scheme("w8a8", dynamic=False)
MODELSLIM_SCHEMES = {"W8A8": Int8Scheme("W8A8", dynamic=False, modelslim=True),
                     "W8A8_DYNAMIC": Int8Scheme("W8A8_DYNAMIC", dynamic=True, modelslim=True),
                     "W8A16": Int8Scheme("W8A16", dynamic=False, modelslim=True, weight_only=True)}
MODELSLIM_FLOAT = "FLOAT"  # a layer msModelSlim kept in its precision
MODELSLIM_DESCRIPTION = "quant_model_description.json"
# What says a checkpoint's tensors are quantized, for the messages of a tensor its description does not fit
DESCRIPTION = f"the checkpoint's description (config.json's quantization_config, {MODELSLIM_DESCRIPTION}, or neither)"
# Keys of the description that are not tensors, and that ask for what is not served (a quantized KV cache, quantized
# attention): refused. Others (model_quant_type, version, group_size) say nothing a W8A8 layer reads.
MODELSLIM_REFUSED_KEYS = {"kv_cache_type": "a quantized KV cache", "fa_quant_type": "quantized attention",
                          "indexer_quant_type": "a quantized indexer"}


class UnsupportedQuantization(ValueError):
    pass


# Zero points older compressed-tensors versions wrote for symmetric schemes too: all zero, they change nothing.
SYMMETRIC_ZERO_POINTS = (".weight_zero_point", ".input_zero_point")
PACKED_SHAPE = ".weight_shape"  # pack-quantized weights' unpacked shape, beside their weight_packed


@dataclass
class CompressedTensors:
    """A compressed-tensors quantization_config: its config groups, each (targets, scheme), and what it ignores."""

    groups: list[tuple[list[str], Int8Scheme]]
    ignore: list[str]

    def scheme_for(self, name: str, module: nn.Module) -> Int8Scheme | None:
        """The scheme of the checkpoint layer `name` (a module of ours named as the checkpoint names it), or None where
        the layer is stored unquantized. Targets and ignore entries match as compressed-tensors matches them: a class
        name ("Linear"), an exact layer name, or "re:" and a regular expression. A group that names the layer (or
        matches it by expression) wins over one that names its class, as in vLLM."""
        from compressed_tensors.utils.match import is_match, match_name

        if self.ignore and is_match(name, module, self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(match_name(name, target) for target in targets):
                return scheme
        for targets, scheme in self.groups:
            if is_match(name, module, targets):
                return scheme
        return None

    @property
    def description(self) -> str:
        return "compressed-tensors " + ", ".join(sorted({scheme.name for _, scheme in self.groups}))

    def check_tensors(self, stored: set[str], where: Path) -> None:
        """(compressed-tensors names no tensors: a missing one is a parameter left unfilled, which the loader names.)"""


@dataclass
class ModelSlim:
    """An msModelSlim checkpoint's quant_model_description.json: {tensor name: its quantization type}."""

    types: dict[str, str]
    path: Path

    def scheme_for(self, name: str, module: nn.Module) -> Int8Scheme | None:
        """The scheme of the checkpoint layer `name`, by its weight's type, as vllm-ascend's get_linear_quant_type
        looks it up; None for FLOAT (and for an output head the description does not list)."""
        kind = self.types.get(f"{name}.weight")
        if kind is None and name == "lm_head":
            return None
        if kind is None:
            raise UnsupportedQuantization(f"no type for {name}.weight")
        if kind == MODELSLIM_FLOAT:
            return None
        if kind not in MODELSLIM_SCHEMES:
            raise UnsupportedQuantization(
                f"{name}.weight is {kind}, which is not served; npu-llm runs msModelSlim's "
                f"{', '.join(MODELSLIM_SCHEMES)} and {MODELSLIM_FLOAT} layers")
        return MODELSLIM_SCHEMES[kind]

    @property
    def description(self) -> str:
        return "msModelSlim " + ", ".join(sorted(set(self.types.values()) - {MODELSLIM_FLOAT}) or [MODELSLIM_FLOAT])

    def check_tensors(self, stored: set[str], where: Path) -> None:
        """Every tensor the description names is in the checkpoint (a description of another checkpoint, or a
        checkpoint cut short, would otherwise serve whatever the layers were left holding), but an output head
        tied to the embedding. Norm biases (msModelSlim's anti-outlier "m4" writes them) are refused by name."""
        norm_biases = sorted(key for key in stored if key.endswith("norm.bias"))
        if norm_biases:
            raise UnsupportedQuantization(
                f"{where}: norm biases ({norm_biases[0]}, ...) from msModelSlim's anti-outlier suppression are not "
                "served yet; quantize without anti-outlier (or with a method that writes none)")
        missing = sorted(set(self.types) - stored - {"lm_head.weight"})
        if missing:
            raise UnsupportedQuantization(
                f"{self.path} names tensors {where} lacks: {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def quantization_of(config, requested: str | None, where: Path) -> CompressedTensors | ModelSlim | None:
    """The checkpoint's quantization (None: unquantized), checked against `quantization` as the user set it."""
    raw = getattr(config, "quantization_config", None)
    raw = raw if isinstance(raw, dict) or raw is None else raw.to_dict()
    method = (raw or {}).get("quant_method")
    description = where.parent / MODELSLIM_DESCRIPTION
    if requested not in (None, *QUANTIZATION_CHOICES):
        raise UnsupportedQuantization(
            f"quantization={requested!r}: expected one of {', '.join(QUANTIZATION_CHOICES)}, or none")
    if requested == "ascend":
        if method == "compressed-tensors":
            raise UnsupportedQuantization(f"quantization='ascend': {where} describes a compressed-tensors "
                                          "checkpoint; load it with quantization unset")
        return _modelslim(description)
    if description.is_file() and method != "compressed-tensors":
        raise UnsupportedQuantization(f"{where.parent} is an msModelSlim checkpoint ({MODELSLIM_DESCRIPTION}): "
                                      "load it with quantization='ascend', as vLLM does")
    if not raw:
        if requested is not None:
            raise UnsupportedQuantization(f"quantization={requested!r}: {where} has no quantization_config")
        return None
    if method != "compressed-tensors":
        raise UnsupportedQuantization(
            f"{where}: quant_method {method!r} is not served; compressed-tensors W8A8 checkpoints are (DeepSeek's "
            "FP8 release converts to bf16 with its fp8_cast_bf16.py)")
    return _compressed_tensors(raw, where)


def _modelslim(path: Path) -> ModelSlim:
    if not path.is_file():
        raise UnsupportedQuantization(f"quantization='ascend': {path} is missing (msModelSlim writes it beside the "
                                      "weights)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedQuantization(f"{path}: not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise UnsupportedQuantization(f"{path}: expected an object of tensor names and their types")
    for key, what in MODELSLIM_REFUSED_KEYS.items():
        if key in raw:
            raise UnsupportedQuantization(f"{path}: {key} {raw[key]!r} asks for {what}, which is not served yet")
    types = {key: kind for key, kind in raw.items() if "." in key}  # (the others: model_quant_type, version, ...)
    bad = [key for key, kind in types.items() if not isinstance(kind, str)]
    if bad:
        raise UnsupportedQuantization(f"{path}: the type of {bad[0]} is not a string")
    return ModelSlim(types, path)


def _compressed_tensors(raw: dict, where: Path) -> CompressedTensors:
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    try:  # (llm-compressor adds keys of its own beside the package's: only the package's are read)
        parsed = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k in QuantizationConfig.model_fields})
    except ValidationError as e:
        raise UnsupportedQuantization(f"{where}: quantization_config does not parse: {e}") from e
    if parsed.kv_cache_scheme is not None:
        raise UnsupportedQuantization(f"{where}: a quantized KV cache (kv_cache_scheme) is not served yet")
    if raw.get("sparsity_config") or raw.get("transform_config"):
        raise UnsupportedQuantization(f"{where}: sparse or transformed (sparsity_config, transform_config) "
                                      "checkpoints are not served")
    groups = []
    for group_name, scheme in parsed.config_groups.items():
        fmt, named = scheme.format or parsed.format, f"{where}: config group {group_name!r}"
        if fmt not in (FORMAT, PACKED_FORMAT):
            raise UnsupportedQuantization(f"{named} is stored {fmt!r}; npu-llm reads {FORMAT!r} (int8 weights as "
                                          f"int8 tensors) and {PACKED_FORMAT!r} (int8 weights packed in int32)")
        groups.append((list(scheme.targets), _scheme_of(scheme, fmt == PACKED_FORMAT, named)))
    return CompressedTensors(groups, list(parsed.ignore or []))


def _scheme_of(scheme, packed: bool, where: str) -> Int8Scheme:
    weights, inputs = scheme.weights, scheme.input_activations
    strategies = ("channel", "group") if inputs is None else ("channel",)  # (grouped scales: weight-only schemes)
    if weights is None or not _int8_symmetric(weights) or weights.strategy not in strategies or weights.dynamic \
            or weights.actorder:
        raise UnsupportedQuantization(
            f"{where}: weights {_describe(weights)} are not served; npu-llm runs int8 weights quantized symmetrically "
            "per output channel (or, without quantized activations, per group of input features)")
    if scheme.output_activations is not None:
        raise UnsupportedQuantization(f"{where}: quantized output activations are not served")
    if inputs is None:
        group = weights.group_size if weights.strategy == "group" else 0
        return Int8Scheme(f"w8a16 (groups of {group})" if group else "w8a16", dynamic=False, weight_only=True,
                          group_size=group, packed=packed)
    if packed:
        raise UnsupportedQuantization(f"{where}: W8A8 weights stored {PACKED_FORMAT!r} are not served; npu-llm reads "
                                      f"them {FORMAT!r}, as llm-compressor writes them")
    if _int8_symmetric(inputs):
        if inputs.dynamic is True and inputs.strategy == "token":
            return W8A8_DYNAMIC
        if inputs.dynamic is False and inputs.strategy == "tensor":
            return W8A8_STATIC
    raise UnsupportedQuantization(
        f"{where}: input activations {_describe(inputs)} are not served; npu-llm runs int8 activations, symmetric, "
        "per token and dynamic (W8A8 dynamic) or per tensor and static (W8A8), or activations left unquantized "
        "(W8A16)")


def _int8_symmetric(args) -> bool:
    return args.num_bits == 8 and args.type == "int" and args.symmetric


def _describe(args) -> str:
    if args is None:
        return "left unquantized"
    kind = "symmetric" if args.symmetric else "asymmetric"
    dynamic = {True: "dynamic", False: "static"}.get(args.dynamic, str(args.dynamic))
    group = f" of {args.group_size}" if args.group_size else ""
    return f"({args.num_bits}-bit {args.type}, {kind}, per {args.strategy}{group}, {dynamic})"


def quantize_layers(model: nn.Module, quantization: CompressedTensors | ModelSlim) -> None:
    """On the meta device, before loading: every layer the checkpoint stores in int8 gets int8 weights and scales.

    A fused layer of ours (qkv_proj, gate_up_proj) is several checkpoint layers: they must share one scheme, as
    in vLLM. So must a MoE layer's experts (every projection of every expert this rank holds), which are served
    W8A8 dynamic only, as in vllm-ascend. Other layers (the output head) are refused when the checkpoint quantizes
    them.
    """
    fused = _fused_parts(model.stacked_params)
    mixtral = model.config.model_type == "mixtral"
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            _quantize_experts(name, module, quantization, mixtral)
        elif isinstance(module, Linear):
            prefix, _, last = name.rpartition(".")
            parts = [f"{prefix}.{part}" for part in fused.get(last, [last])]
            schemes = {part: quantization.scheme_for(part, module) for part in parts}
            if len(set(schemes.values())) > 1:
                raise UnsupportedQuantization(
                    f"{name}: its checkpoint layers are quantized differently "
                    f"({', '.join(f'{p}: {s.name if s else None}' for p, s in schemes.items())})")
            if schemes[parts[0]] is not None:
                try:
                    module.quantize(schemes[parts[0]], len(parts))
                except ValueError as e:
                    raise UnsupportedQuantization(f"{name}: {e}") from e
        elif isinstance(module, nn.Linear) and quantization.scheme_for(name, module) is not None:
            raise UnsupportedQuantization(f"{name}: a quantized {name} is not served yet (llm-compressor's recipes "
                                          "and msModelSlim's leave the output head in its precision)")


# What an expert's projection is in the model that wrote the checkpoint (a Linear), for matching a config group's
# targets by class, as compressed-tensors matches them.
_CHECKPOINT_LINEAR = nn.Linear(1, 1, device="meta")


def _quantize_experts(name: str, module: FusedMoE, quantization: CompressedTensors | ModelSlim,
                      mixtral: bool) -> None:
    block = name.removesuffix(".experts")
    block, parts = (block.replace(".mlp", ".block_sparse_moe"), ("w1", "w3", "w2")) if mixtral else \
        (block, ("gate_proj", "up_proj", "down_proj"))
    layers = [f"{block}.experts.{e}.{part}" for e in range(module.first_expert,
                                                             module.first_expert + module.num_local_experts)
              for part in parts]
    schemes = {layer: quantization.scheme_for(layer, _CHECKPOINT_LINEAR) for layer in layers}
    kinds = set(schemes.values())
    if len(kinds) > 1:
        named = {scheme: layer for layer, scheme in schemes.items()}
        raise UnsupportedQuantization(f"{name}: its experts are quantized differently ("
                                      + ", ".join(f"{layer}: {s.name if s else None}" for s, layer in named.items())
                                      + ")")
    scheme = kinds.pop()
    if scheme is None:
        return
    if scheme.weight_only:
        raise UnsupportedQuantization(f"{name}: {scheme.name} experts are not served yet; quantize them W8A8 dynamic "
                                      "or leave them in their precision")
    if not scheme.dynamic:
        raise UnsupportedQuantization(f"{name}: static {scheme.name} experts are not served (vllm-ascend serves "
                                      "W8A8 dynamic experts only); quantize them W8A8 dynamic")
    module.quantize(scheme)


def _fused_parts(stacked_params: dict[str, tuple[str, int]]) -> dict[str, list[str]]:
    """{fused layer: its checkpoint layers in order}, from a model's {checkpoint layer: (fused layer, index)}."""
    fused: dict[str, list[str]] = {}
    for part, (name, index) in sorted(stacked_params.items(), key=lambda item: item[1]):
        fused.setdefault(name, []).append(part)
    return fused


def check_scales(model: nn.Module) -> None:
    """After loading: every scale finite, input scales positive (a zero or NaN scale serves garbage, silently)."""
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and module.scheme is not None:
            for scales in ("w13_weight_scale", "w2_weight_scale"):
                if not torch.isfinite(getattr(module, scales)).all():
                    raise UnsupportedQuantization(f"{name}: an expert's weight_scale holds a value that is not finite")
        if isinstance(module, Linear) and module.scheme is not None:
            if not torch.isfinite(module.weight_scale).all():
                raise UnsupportedQuantization(f"{name}: weight_scale holds a value that is not finite")
            if module.input_scale is not None and not (torch.isfinite(module.input_scale).all()
                                                       and (module.input_scale > 0).all()):
                raise UnsupportedQuantization(f"{name}: input_scale must be finite and positive, got "
                                              f"{module.input_scale.tolist()}")


def check_loaded_dtype(param: torch.Tensor, tensor: torch.Tensor, key: str, path: Path) -> None:
    """A tensor may fill a parameter only in its precision: an int8 weight where the checkpoint's description says
    float, or a float one where it says int8, is a checkpoint its description does not fit (copying would cast it
    silently)."""
    if param.dtype.is_floating_point != tensor.dtype.is_floating_point or \
            (not param.dtype.is_floating_point and param.dtype != tensor.dtype):
        def name(dtype):
            return str(dtype).removeprefix("torch.")
        raise UnsupportedQuantization(
            f"{path}: tensor {key!r} is {name(tensor.dtype)}, where {DESCRIPTION} makes it {name(param.dtype)}")


# msModelSlim's offsets are integers, stored in whatever dtype (vllm-ascend's input_offset parameter is int8, its
# weight_offset the model's dtype): read as fp32 values, checked after loading.
MODELSLIM_OFFSETS = (".input_offset", ".weight_offset")


def as_loaded(param: torch.Tensor, tensor: torch.Tensor, key: str, path: Path) -> torch.Tensor:
    """The checkpoint tensor `key` as it fills `param`: msModelSlim's int64 deq_scale unpacked, its offsets as
    values; any other tensor only in its parameter's precision (check_loaded_dtype)."""
    if key.endswith(".deq_scale") and tensor.dtype == torch.int64:
        return deq_scale_from_int64(tensor)
    if key.endswith(MODELSLIM_OFFSETS):
        return tensor.float()
    check_loaded_dtype(param, tensor, key, path)
    return tensor


def unpack_weights(model: nn.Module) -> None:
    """After loading, compressed-tensors' pack-quantized weights as the int8 [N, K] the kernels read: each int32 word
    holds four values plus 128, the first in its low byte (the package's own unpack_from_int32 undoes it)."""
    from compressed_tensors import unpack_from_int32

    for module in model.modules():
        if isinstance(module, Linear) and module.scheme is not None and module.scheme.packed:
            packed = module.weight_packed
            del module.weight_packed
            shape = torch.Size([module.out_features, module.in_features])
            module.weight = nn.Parameter(unpack_from_int32(packed.data, 8, shape), requires_grad=False)


def deq_scale_from_int64(packed: torch.Tensor) -> torch.Tensor:
    """fp32 scales from the int64 form npu_trans_quant_param makes for fp16 models (docs/npu.md, section 13): the
    scale's fp32 bits, their low 13 cleared, in the low 32 bits; flags above them."""
    low = packed & 0xFFFFFFFF
    return torch.where(low >= 2 ** 31, low - 2 ** 32, low).to(torch.int32).view(torch.float32)


def deq_scale_to_int64(scale: torch.Tensor) -> torch.Tensor:
    """deq_scale_from_int64's inverse, as npu_trans_quant_param packs it (bit 46 set, no offset)."""
    return (scale.float().view(torch.int32).to(torch.int64) & 0xFFFFE000) | (1 << 46)


def folded_into_quant_bias(model: nn.Module, key: str) -> bool:
    """Whether `key` is the float bias of an msModelSlim static layer: its quant_bias carries it, and vllm-ascend
    leaves it unread, so it may be there or not."""
    layer, _, last = key.rpartition(".")
    try:
        module = model.get_submodule(layer) if last == "bias" else None
    except AttributeError:  # (no such layer: the loader names the tensor as unexpected)
        return False
    scheme = getattr(module, "scheme", None)
    return scheme is not None and scheme.modelslim and scheme.static


def fold_modelslim(model: nn.Module) -> None:
    """After loading, msModelSlim's layers in the form every platform's int8_linear runs: weights symmetric (their
    offsets zero), and for static activations weight_scale = deq_scale / input_scale and bias = quant_bias *
    deq_scale, which gives vllm-ascend's (x_q w^T + quant_bias) * deq_scale to fp32's rounding. The bias stays fp32
    (int8_linear adds it in fp32): it takes back the offset's share of the sums, which is large beside the output,
    and in bf16 its rounding alone turned the default model's logits to noise (docs/quantization.md)."""
    for name, module in model.named_modules():
        scheme = getattr(module, "scheme", None)
        if not isinstance(module, Linear) or scheme is None or not scheme.modelslim:
            continue
        offset = module.weight_offset
        if scheme.weight_only and not torch.isfinite(offset).all():
            raise UnsupportedQuantization(f"{name}: weight_offset holds a value that is not finite")
        if offset.any() and not scheme.weight_only:
            raise UnsupportedQuantization(f"{name}: weight_offset is not zero; asymmetric int8 weights are not "
                                          "served (vllm-ascend's W8A8 methods do not read it either)")
        del module.weight_offset  # (W8A16 keeps one that is not all zero: vllm-ascend's antiquant_offset)
        module.weight_offset = nn.Parameter(offset.float(), requires_grad=False) if offset.any() else None
        if not scheme.static:
            continue
        scale, offset, deq = module.input_scale, module.input_offset, module.deq_scale.float()
        if (scale != scale[0]).any() or (offset != offset[0]).any():
            raise UnsupportedQuantization(f"{name}: its parts, which see one input, have different input scales "
                                          f"{scale.tolist()} or offsets {offset.tolist()}")
        if offset[0] != offset[0].round() or not -128 <= offset[0] <= 127:
            raise UnsupportedQuantization(f"{name}: input_offset must be an int8 value, got {offset[0].item()}")
        if not (torch.isfinite(deq).all() and (deq > 0).all()):
            raise UnsupportedQuantization(f"{name}: deq_scale must be finite and positive")
        module.weight_scale = nn.Parameter((deq / scale[0]).reshape(-1, 1), requires_grad=False)
        module.bias = nn.Parameter(module.quant_bias.float() * deq, requires_grad=False)
        del module.quant_bias, module.deq_scale
