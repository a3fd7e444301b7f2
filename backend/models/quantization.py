"""Quantized checkpoints: which linear layers of a model hold int8 weights, and how their activations are quantized.

Read from the checkpoint's own description, as vLLM reads it: a `quantization_config` with
`quant_method: compressed-tensors` in config.json (llm-compressor's format, and `npu-llm quantize`'s), parsed by the
compressed-tensors package itself. The schemes served (docs/quantization.md):

- W8A8 dynamic: int8 weights, one scale per output channel (`weight` int8 [N, K], `weight_scale` [N, 1]);
  activations quantized per token as each step runs.
- W8A8 static: the same weights; activations quantized with one calibrated scale per layer (`input_scale` [1]).

Everything else a checkpoint may ask for (other bit widths, asymmetric or grouped weights, fp8, a quantized KV
cache, quantized experts or latent attention) fails the load, naming what was asked: nothing is served in a
precision other than the checkpoint's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from backend.config import QUANTIZATION_CHOICES
from backend.models.layers import Linear

FORMAT = "int-quantized"  # compressed-tensors' format for int8 weights stored as int8 tensors


@dataclass(frozen=True)
class Int8Scheme:
    """How one linear layer runs: int8 weights with per-channel scales, and its activations' quantization."""

    name: str  # what the docs and the start-up log call it
    dynamic: bool  # True: a scale per token, computed each step; False: the checkpoint's input_scale


W8A8_DYNAMIC = Int8Scheme("w8a8_dynamic", dynamic=True)
W8A8_STATIC = Int8Scheme("w8a8", dynamic=False)


class UnsupportedQuantization(ValueError):
    pass


# Zero points older compressed-tensors versions wrote for symmetric schemes too: all zero, they change nothing.
SYMMETRIC_ZERO_POINTS = (".weight_zero_point", ".input_zero_point")


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


def quantization_of(config, requested: str | None, where: Path) -> CompressedTensors | None:
    """The checkpoint's quantization (None: unquantized), checked against `quantization` as the user set it."""
    raw = getattr(config, "quantization_config", None)
    if requested not in (None, *QUANTIZATION_CHOICES):
        raise UnsupportedQuantization(
            f"quantization={requested!r}: expected one of {', '.join(QUANTIZATION_CHOICES)}, or none")
    if requested == "ascend":
        raise UnsupportedQuantization(
            "quantization='ascend': msModelSlim checkpoints are not served yet; a compressed-tensors W8A8 checkpoint "
            "(llm-compressor's, or `npu-llm quantize`'s) is")
    if not raw:
        if requested is not None:
            raise UnsupportedQuantization(f"quantization={requested!r}: {where} has no quantization_config")
        return None
    raw = raw if isinstance(raw, dict) else raw.to_dict()
    method = raw.get("quant_method")
    if method != "compressed-tensors":
        raise UnsupportedQuantization(
            f"{where}: quant_method {method!r} is not served; compressed-tensors W8A8 checkpoints are (DeepSeek's "
            "FP8 release converts to bf16 with its fp8_cast_bf16.py)")
    return _compressed_tensors(raw, where)


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
        fmt = scheme.format or parsed.format
        if fmt != FORMAT:
            raise UnsupportedQuantization(f"{where}: config group {group_name!r} is stored {fmt!r}; npu-llm reads "
                                          f"{FORMAT!r} (int8 weights as int8 tensors)")
        groups.append((list(scheme.targets), _scheme_of(scheme, f"{where}: config group {group_name!r}")))
    return CompressedTensors(groups, list(parsed.ignore or []))


def _scheme_of(scheme, where: str) -> Int8Scheme:
    weights, inputs = scheme.weights, scheme.input_activations
    if weights is None or not _int8_symmetric(weights) or weights.strategy != "channel" or weights.dynamic \
            or weights.actorder:
        raise UnsupportedQuantization(
            f"{where}: weights {_describe(weights)} are not served; npu-llm runs int8 weights quantized symmetrically "
            "per output channel")
    if scheme.output_activations is not None:
        raise UnsupportedQuantization(f"{where}: quantized output activations are not served")
    if inputs is not None and _int8_symmetric(inputs):
        if inputs.dynamic is True and inputs.strategy == "token":
            return W8A8_DYNAMIC
        if inputs.dynamic is False and inputs.strategy == "tensor":
            return W8A8_STATIC
    raise UnsupportedQuantization(
        f"{where}: input activations {_describe(inputs)} are not served; npu-llm runs int8 activations, symmetric, "
        "per token and dynamic (W8A8 dynamic) or per tensor and static (W8A8)")


def _int8_symmetric(args) -> bool:
    return args.num_bits == 8 and args.type == "int" and args.symmetric


def _describe(args) -> str:
    if args is None:
        return "left unquantized"
    kind = "symmetric" if args.symmetric else "asymmetric"
    dynamic = {True: "dynamic", False: "static"}.get(args.dynamic, str(args.dynamic))
    group = f" of {args.group_size}" if args.group_size else ""
    return f"({args.num_bits}-bit {args.type}, {kind}, per {args.strategy}{group}, {dynamic})"


def quantize_layers(model: nn.Module, quantization: CompressedTensors) -> None:
    """On the meta device, before loading: every layer the checkpoint stores in int8 gets int8 weights and scales.

    A fused layer of ours (qkv_proj, gate_up_proj) is several checkpoint layers: they must share one scheme, as
    in vLLM. Layers outside our linear layers (the output head, the experts, latent attention) are refused when
    the checkpoint quantizes them.
    """
    fused = _fused_parts(model.stacked_params)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            prefix, _, last = name.rpartition(".")
            parts = [f"{prefix}.{part}" for part in fused.get(last, [last])]
            schemes = {part: quantization.scheme_for(part, module) for part in parts}
            if len(set(schemes.values())) > 1:
                raise UnsupportedQuantization(
                    f"{name}: its checkpoint layers are quantized differently "
                    f"({', '.join(f'{p}: {s.name if s else None}' for p, s in schemes.items())})")
            if schemes[parts[0]] is not None:
                module.quantize(schemes[parts[0]], len(parts))
        elif isinstance(module, nn.Linear) and quantization.scheme_for(name, module) is not None:
            raise UnsupportedQuantization(f"{name}: a quantized {name} is not served yet (llm-compressor's recipes "
                                          "ignore lm_head)")


def _fused_parts(stacked_params: dict[str, tuple[str, int]]) -> dict[str, list[str]]:
    """{fused layer: its checkpoint layers in order}, from a model's {checkpoint layer: (fused layer, index)}."""
    fused: dict[str, list[str]] = {}
    for part, (name, index) in sorted(stacked_params.items(), key=lambda item: item[1]):
        fused.setdefault(name, []).append(part)
    return fused


def check_scales(model: nn.Module) -> None:
    """After loading: every scale finite, input scales positive (a zero or NaN scale serves garbage, silently)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.scheme is not None:
            if not torch.isfinite(module.weight_scale).all():
                raise UnsupportedQuantization(f"{name}: weight_scale holds a value that is not finite")
            if module.input_scale is not None and not (torch.isfinite(module.input_scale).all()
                                                       and (module.input_scale > 0).all()):
                raise UnsupportedQuantization(f"{name}: input_scale must be finite and positive, got "
                                              f"{module.input_scale.tolist()}")


def check_loaded_dtype(param: torch.Tensor, tensor: torch.Tensor, key: str, path: Path) -> None:
    """A tensor may fill a parameter only in its precision: an int8 weight where config.json says float, or a float
    one where it says int8, is a checkpoint its config does not describe (copying would cast it silently)."""
    if param.dtype.is_floating_point != tensor.dtype.is_floating_point or \
            (not param.dtype.is_floating_point and param.dtype != tensor.dtype):
        def name(dtype):
            return str(dtype).removeprefix("torch.")
        raise UnsupportedQuantization(
            f"{path}: tensor {key!r} is {name(tensor.dtype)}, where config.json (its quantization_config, or its "
            f"absence) makes it {name(param.dtype)}")
