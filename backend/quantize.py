"""`npu-llm quantize`: a compressed-tensors W8A8 checkpoint made from an unquantized one.

The checkpoint is written by the compressed-tensors package itself (its config, its quantizer, its `int-quantized`
format), so that what reads compressed-tensors reads it: npu-llm, transformers, vLLM. As llm-compressor's
W8A8 recipes make it:

- weights: int8, symmetric, one scale per output channel (compressed-tensors' `calculate_qparams`: the channel's
  absolute maximum over 127.5), the scale stored in the checkpoint's dtype and the weights rounded with that scale;
- activations: quantized per token as the model runs (`w8a8_dynamic`), or with one scale per layer (`w8a8`), taken
  from the largest magnitude the layer's input reaches over calibration text;
- `lm_head` stays in its precision.

Calibration text: `--calibration FILE.jsonl` (one {"text": ...} per line), or the few paragraphs shipped beside
this module. Only static scales need it.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from torch import nn

from backend.models.loader import load_config, stored_dtype_of
from backend.models.registry import resolve_model

log = logging.getLogger(__name__)
SCHEMES = ("w8a8_dynamic", "w8a8")
SHIPPED_CALIBRATION = Path(__file__).with_name("calibration.jsonl")
CALIBRATION_CHUNK = 256  # tokens a forward pass: the calibration's activations stay small
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def quantization_config(scheme: str):
    """compressed-tensors' QuantizationConfig for a scheme, over every Linear but lm_head."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    if scheme == "w8a8_dynamic":
        inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    else:
        inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
    group = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    return QuantizationConfig(config_groups={"group_0": group}, ignore=["lm_head"], format="int-quantized")


def quantize_checkpoint(model: str, out: str | Path, scheme: str, calibration: str | Path | None = None,
                        max_calibration_tokens: int = 512, tokenizer: str | Path | None = None) -> Path:
    """Write `model` quantized to `scheme` into the folder `out`; returns it. The calibration text is tokenized by
    `tokenizer` (default: the model's own)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from transformers import AutoModelForCausalLM

    config = quantization_config(scheme)
    texts = None if scheme == "w8a8_dynamic" else calibration_texts(calibration)
    model_dir, out = resolve_model(model), Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: exists and is not empty")
    stored = load_config(model_dir)
    if getattr(stored, "quantization_config", None):
        raise ValueError(f"{model_dir}: already quantized")
    stored_dtype = stored_dtype_of(stored) or torch.float32
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()  # scales computed in fp32
    input_absmax = None if texts is None else _calibrate(hf, tokenizer or model_dir, texts, max_calibration_tokens)
    apply_quantization_config(hf, config)
    for name, module in _quantized_linears(hf):
        _set_scales(module, stored_dtype, None if input_absmax is None else input_absmax[name])
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=config.format)
    compressor.compress_model(hf)
    hf.to(stored_dtype)  # the tensors left unquantized, and the scales, in the checkpoint's own dtype
    hf.save_pretrained(str(out))
    compressor.update_config(str(out))
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    log.info("%s: %s written to %s", model_dir.name, scheme, out)
    return out


def _quantized_linears(model: nn.Module):
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "quantization_scheme")]


def _set_scales(module: nn.Module, dtype: torch.dtype, input_absmax: torch.Tensor | None) -> None:
    """The layer's weight scale per output channel (and its static input scale), rounded to the checkpoint's dtype
    before the weights are rounded with them: the stored scale is the one the int8 weights were made with."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme
    weight = module.weight.detach()
    scale, _ = calculate_qparams(weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True), args.weights)
    module.weight_scale.data.copy_(scale.to(dtype).float())
    if input_absmax is not None:
        scale, _ = calculate_qparams(-input_absmax.reshape(1), input_absmax.reshape(1), args.input_activations)
        module.input_scale.data.copy_(scale.to(dtype).float().reshape(module.input_scale.shape))


def _calibrate(model: nn.Module, tokenizer_dir, texts: list[str], max_tokens: int) -> dict[str, torch.Tensor]:
    """The largest absolute value each Linear's input (but lm_head's) reaches over the calibration tokens."""
    from backend.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    ids = [t for text in texts for t in tokenizer.encode(text)][:max_tokens]
    if not ids:
        raise ValueError("no calibration tokens: give --calibration-tokens > 0 and text that tokenizes to some")
    absmax: dict[str, torch.Tensor] = {}

    def observe(name):
        def hook(_module, inputs):
            seen = inputs[0].detach().abs().amax()
            absmax[name] = torch.maximum(absmax[name], seen) if name in absmax else seen
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
              if isinstance(m, nn.Linear) and name != "lm_head" and name not in absmax]
    if unseen:
        raise ValueError(f"calibration never ran {', '.join(unseen[:3])}: no static scale for it")
    log.info("calibrated on %d tokens", len(ids))
    return absmax


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
