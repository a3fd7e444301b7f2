"""`npu-llm quantize`: a W8A8 checkpoint made from an unquantized one, in compressed-tensors' format or msModelSlim's.

A compressed-tensors checkpoint is written by the compressed-tensors package itself (its config, its quantizer, its
`int-quantized` format), so that what reads compressed-tensors reads it: npu-llm, transformers, vLLM. As
llm-compressor's W8A8 recipes make it:

- weights: int8, symmetric, one scale per output channel (compressed-tensors' `calculate_qparams`: the channel's
  absolute maximum over 127.5), the scale stored in the checkpoint's dtype and the weights rounded with that scale;
- activations: quantized per token as the model runs (`w8a8_dynamic`), or with one scale per layer (`w8a8`), taken
  from the largest magnitude the layer's input reaches over calibration text;
- `lm_head` stays in its precision.

An msModelSlim checkpoint (`--format ascend`, served with quantization="ascend") holds the tensors vllm-ascend's
W8A8 methods read (docs/npu.md, section 13), described by quant_model_description.json:

- weights: int8, symmetric per output channel (absmax / 127), `weight_scale` [N, 1] and a zero `weight_offset`;
- static activations (`w8a8`): asymmetric, from the least and greatest value each layer's input reaches over the
  calibration text: `input_scale` = (max - min) / 255 and the int8 `input_offset` that maps min to -128; then
  `deq_scale` = input_scale * weight_scale (fp32; packed in int64 for fp16 models, as vllm-ascend reads them) and
  `quant_bias` = round(bias / deq_scale) - input_offset * (the int8 weights' row sums), int32;
- everything else `FLOAT`, in the checkpoint's dtype.

Calibration text: `--calibration FILE.jsonl` (one {"text": ...} per line), or the few paragraphs shipped beside
this module. Only static scales need it.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch
from torch import nn

from backend.models.loader import checkpoint_files, load_config, stored_dtype_of
from backend.models.moe import EXPERT_TENSOR
from backend.models.quantization import (
    MODELSLIM_DESCRIPTION, MODELSLIM_FLOAT, deq_scale_from_int64, deq_scale_to_int64,
)
from backend.models.registry import resolve_model

log = logging.getLogger(__name__)
SCHEMES = ("w8a8_dynamic", "w8a8", "w8a16")
FORMATS = ("compressed-tensors", "ascend")
MODELSLIM_TYPES = {"w8a8_dynamic": "W8A8_DYNAMIC", "w8a8": "W8A8", "w8a16": "W8A16"}
ROUTER = re.compile(r".*\.(mlp|block_sparse_moe)\.gate$")  # a MoE layer's router (left in its precision)
EXPERTS = r"re:.*\.experts\..*"  # a MoE layer's experts, one by one, as compressed-tensors' ignore names them
SHIPPED_CALIBRATION = Path(__file__).with_name("calibration.jsonl")
CALIBRATION_CHUNK = 256  # tokens a forward pass: the calibration's activations stay small
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def quantization_config(scheme: str, experts: bool = False, group_size: int | None = None):
    """compressed-tensors' QuantizationConfig for a scheme, over every Linear but lm_head (and, in a model with
    experts, but its routers and experts, as llm-compressor's MoE recipes leave the routers: transformers 5 holds
    the experts as stacked parameters, which compressed-tensors does not quantize). W8A16's weights are stored
    `pack-quantized` (four int8 values a 32-bit word), as llm-compressor stores weight-only schemes; `group_size`
    gives them a scale per group of input features instead of one per output channel."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="group" if group_size else "channel",
                               group_size=group_size)
    if scheme == "w8a16":
        inputs = None
    elif scheme == "w8a8_dynamic":
        inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    else:
        inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
    group = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    ignore = ["lm_head", *((f"re:{ROUTER.pattern}", EXPERTS) if experts else ())]
    return QuantizationConfig(config_groups={"group_0": group}, ignore=ignore,
                              format="pack-quantized" if scheme == "w8a16" else "int-quantized")


def quantize_checkpoint(model: str, out: str | Path, scheme: str, calibration: str | Path | None = None,
                        max_calibration_tokens: int = 512, tokenizer: str | Path | None = None,
                        format: str = "compressed-tensors", group_size: int | None = None) -> Path:
    """Write `model` quantized to `scheme` into the folder `out`, in `format`; returns it. The calibration text is
    tokenized by `tokenizer` (default: the model's own). `group_size` (W8A16 in compressed-tensors' format only):
    a weight scale per group of so many input features."""
    from transformers import AutoModelForCausalLM

    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    if format not in FORMATS:
        raise ValueError(f"format {format!r}: expected one of {', '.join(FORMATS)}")
    if group_size is not None and (scheme != "w8a16" or format != "compressed-tensors" or group_size <= 0):
        raise ValueError(f"group size {group_size}: grouped weight scales are written for w8a16 in the "
                         "compressed-tensors format, in groups of at least one input feature (vllm-ascend's "
                         "msModelSlim W8A16 reads one scale per output channel)")
    texts = calibration_texts(calibration) if scheme == "w8a8" else None
    model_dir, out = resolve_model(model), Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: exists and is not empty")
    stored = load_config(model_dir)
    if getattr(stored, "quantization_config", None) or (model_dir / MODELSLIM_DESCRIPTION).is_file():
        raise ValueError(f"{model_dir}: already quantized")
    stored_dtype = stored_dtype_of(stored) or torch.float32
    # fp32: the scales are computed in fp32; safetensors only, as the engine loads them (a pickled .bin can run code)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, use_safetensors=True).eval()
    config = quantization_config(scheme, any(EXPERT_TENSOR.match(name) for name, _ in hf.named_parameters()), group_size)
    if group_size and any(m.in_features % group_size for _, m in _linears(hf)):
        raise ValueError(f"group size {group_size} does not divide the input features of every linear layer")
    input_range = None if texts is None else _calibrate(hf, tokenizer or model_dir, texts, max_calibration_tokens)
    out.mkdir(parents=True, exist_ok=True)
    if format == "ascend":
        _write_modelslim(hf, model_dir, out, scheme, stored_dtype, input_range)
    else:
        _write_compressed_tensors(hf, config, out, stored_dtype, input_range)
    for name in (*TOKENIZER_FILES, *(("config.json", "generation_config.json") if format == "ascend" else ())):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    log.info("%s: %s written to %s (%s)", model_dir.name, scheme, out, format)
    return out


def _write_compressed_tensors(hf: nn.Module, config, out: Path, stored_dtype: torch.dtype,
                              input_range: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    apply_quantization_config(hf, config)
    for name, module in _quantized_linears(hf):
        absmax = None if input_range is None else torch.maximum(-input_range[name][0], input_range[name][1])
        _set_scales(module, stored_dtype, absmax)
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=config.format)
    if EXPERTS in config.ignore:  # (the stored config lists the Linear layers left out, and experts are none)
        compressor.quantization_config.ignore.append(EXPERTS)
    compressor.compress_model(hf)
    hf.to(stored_dtype)  # the tensors left unquantized, and the scales, in the checkpoint's own dtype
    hf.save_pretrained(str(out))
    compressor.update_config(str(out))


def _write_modelslim(hf: nn.Module, model_dir: Path, out: Path, scheme: str, stored_dtype: torch.dtype,
                     input_range: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    """The source checkpoint's tensors, its linear layers (but lm_head and routers) replaced by msModelSlim's int8
    ones, in one file, and the description of every tensor. Experts stored one by one are quantized W8A8_DYNAMIC
    whatever the scheme: vllm-ascend serves no static W8A8 experts."""
    from safetensors.torch import load_file, save_file

    kind = MODELSLIM_TYPES[scheme]
    linears = {name for name, _ in _linears(hf)}
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        tensors.update(load_file(str(path)))
    types = {key: MODELSLIM_FLOAT for key in tensors}
    for name in sorted(linears):
        weight, bias = tensors.pop(f"{name}.weight").float(), tensors.get(f"{name}.bias")
        layer = _modelslim_layer(weight, None if bias is None else bias.float(), stored_dtype,
                                 None if input_range is None else input_range[name])
        for suffix, tensor in layer.items():
            tensors[f"{name}.{suffix}"] = tensor
        types.update({key: kind for key in tensors if key.startswith(f"{name}.")})
    for key in [key for key in tensors if EXPERT_TENSOR.match(key) and key.endswith(".weight")]:
        name = key.removesuffix(".weight")
        layer = _modelslim_layer(tensors.pop(key).float(), None, stored_dtype, None)
        tensors.update({f"{name}.{suffix}": tensor for suffix, tensor in layer.items()})
        types.update({f"{name}.{suffix}": MODELSLIM_TYPES["w8a8_dynamic"] for suffix in layer})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"quant_model_weight_{scheme}.safetensors"),
              metadata={"format": "pt"})
    (out / MODELSLIM_DESCRIPTION).write_text(json.dumps({"model_quant_type": kind, **types}, indent=2) + "\n")


def _modelslim_layer(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                     input_range: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """One linear layer's msModelSlim tensors, from its fp32 weight [N, K] (and bias, and the least and greatest
    value its input reached, for static activations)."""
    absmax = weight.abs().amax(dim=1, keepdim=True)
    weight_scale = torch.where(absmax > 0, absmax / 127, 1.0)  # (an all-zero row: any scale; 1 keeps deq normal)
    weight_scale = weight_scale.to(dtype).float()  # (the int8 weights are made with the scale as stored)
    q = torch.round(weight / weight_scale).clamp(-128, 127)
    layer = {"weight": q.to(torch.int8), "weight_scale": weight_scale.to(dtype),
             "weight_offset": torch.zeros_like(weight_scale).to(dtype)}
    if input_range is None:
        return layer
    low, high = input_range[0].clamp(max=0), input_range[1].clamp(min=0)  # (zero stays exact)
    input_scale = torch.where(high > low, (high - low) / 255, 1.0).to(dtype).float().reshape(1)
    input_offset = torch.round(-128 - low / input_scale).clamp(-128, 127).reshape(1)
    deq_scale = input_scale * weight_scale.reshape(-1)
    if dtype == torch.float16:  # (stored packed, which keeps 19 of its bits: quant_bias is made with those)
        deq_scale = deq_scale_from_int64(deq_scale_to_int64(deq_scale))
    float_bias = torch.zeros(weight.shape[0]) if bias is None else bias
    quant_bias = torch.round(float_bias / deq_scale) - input_offset * q.sum(dim=1)
    if quant_bias.abs().max() >= 2 ** 31:
        raise ValueError(f"a bias of {float_bias.abs().max().item()} over deq_scale overflows quant_bias's int32")
    layer.update(input_scale=input_scale.to(dtype), input_offset=input_offset.to(dtype),
                 quant_bias=quant_bias.to(torch.int32),
                 deq_scale=deq_scale_to_int64(deq_scale) if dtype == torch.float16 else deq_scale)
    return layer


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers a checkpoint quantizes: all but lm_head and the routers (experts are separate)."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name != "lm_head" and not ROUTER.match(name)]


def _quantized_linears(model: nn.Module):
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "quantization_scheme")]


def _set_scales(module: nn.Module, dtype: torch.dtype, input_absmax: torch.Tensor | None) -> None:
    """The layer's weight scale per output channel (and its static input scale), rounded to the checkpoint's dtype
    before the weights are rounded with them: the stored scale is the one the int8 weights were made with."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme
    weight = module.weight.detach()
    groups = weight.view(weight.shape[0], -1, args.weights.group_size or weight.shape[1])  # [N, groups, in a group]
    scale, _ = calculate_qparams(groups.amin(dim=2), groups.amax(dim=2), args.weights)
    module.weight_scale.data.copy_(scale.to(dtype).float().reshape(module.weight_scale.shape))
    if input_absmax is not None:
        scale, _ = calculate_qparams(-input_absmax.reshape(1), input_absmax.reshape(1), args.input_activations)
        module.input_scale.data.copy_(scale.to(dtype).float().reshape(module.input_scale.shape))


def _calibrate(model: nn.Module, tokenizer_dir, texts: list[str],
               max_tokens: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The least and the greatest value each Linear's input (but lm_head's) reaches over the calibration tokens."""
    from backend.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    ids = [t for text in texts for t in tokenizer.encode(text)][:max_tokens]
    if not ids:
        raise ValueError("no calibration tokens: give --calibration-tokens > 0 and text that tokenizes to some")
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(name):
        def hook(_module, inputs):
            low, high = inputs[0].detach().amin(), inputs[0].detach().amax()
            if name in seen:
                low, high = torch.minimum(seen[name][0], low), torch.maximum(seen[name][1], high)
            seen[name] = (low, high)
        return hook

    hooks = [m.register_forward_pre_hook(observe(name)) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name != "lm_head"]
    try:
        with torch.no_grad():
            for start in range(0, len(ids), CALIBRATION_CHUNK):
                model(torch.tensor([ids[start:start + CALIBRATION_CHUNK]]))
    finally:
        for hook in hooks:
            hook.remove()
    unseen = [name for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name != "lm_head" and name not in seen]
    if unseen:
        raise ValueError(f"calibration never ran {', '.join(unseen[:3])}: no static scale for it")
    log.info("calibrated on %d tokens", len(ids))
    return seen


def calibration_texts(path: str | Path | None) -> list[str]:
    """The "text" of each line of a JSONL file (the shipped one by default)."""
    path = Path(path) if path else SHIPPED_CALIBRATION
    texts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f'{path}:{number}: expected an object with a "text" string')
        texts.append(record["text"])
    if not texts:
        raise ValueError(f"{path}: no calibration text")
    return texts
