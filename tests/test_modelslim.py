"""msModelSlim's W8A8 and W8A16 checkpoints (quantization="ascend"): `npu-llm quantize --format ascend` writes the
tensors and the quant_model_description.json vllm-ascend reads; npu-llm serves them with vllm-ascend's arithmetic
((x_q w^T + quant_bias) * deq_scale, x_q = round(x / input_scale + input_offset); W8A16: x ((w + offset) * scale)^T),
checked here against that arithmetic written out in float64 inside transformers' own model; and a checkpoint its
description does not fit fails the load, naming the tensor."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from backend.entrypoints.cli import main as cli_main
from backend.models.loader import ModelLoadError, load_model
from backend.models.quantization import MODELSLIM_DESCRIPTION, deq_scale_from_int64, deq_scale_to_int64
from backend.entrypoints.quantize import quantize_checkpoint
from npu_llm_kernels import ops_for
from tests.conftest import hf_model, make_tiny_model, rewrite_checkpoint
from tests.test_model_parity import DECODE_STEPS, _greedy_through_paged_cache, _prompt_logits
from tests.test_tensor_parallel import STEPS, _generate

VOCAB = 49152  # the default model's tokenizer: the calibration text is tokenized with it
WEIGHTS = "quant_model_weight_{}.safetensors"
Q = "model.layers.1.self_attn.q_proj."


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("source"), vocab_size=VOCAB)  # (q/k/v with biases)


@pytest.fixture(scope="module", params=["w8a8", "w8a8_dynamic", "w8a16"])
def modelslim(request, source, tmp_path_factory, default_model_dir):
    """(scheme, folder), written through the CLI."""
    out = tmp_path_factory.mktemp(request.param) / "out"
    assert cli_main(["quantize", "--model", str(source), "--out", str(out), "--scheme", request.param,
                     "--format", "ascend", "--tokenizer", str(default_model_dir)]) == 0
    return request.param, out


def test_the_checkpoint_holds_what_vllm_ascend_reads(modelslim):
    scheme, out = modelslim
    description = json.loads((out / MODELSLIM_DESCRIPTION).read_text())
    kind = {"w8a8": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC", "w8a16": "W8A16"}[scheme]
    assert description["model_quant_type"] == kind
    assert description[Q + "weight"] == kind and description["model.embed_tokens.weight"] == "FLOAT"
    tensors = load_file(out / WEIGHTS.format(scheme))
    assert set(description) - {"model_quant_type"} == set(tensors)
    assert tensors[Q + "weight"].dtype == torch.int8 and tensors[Q + "weight_scale"].shape == (64, 1)
    assert not tensors[Q + "weight_offset"].any()
    static = {"input_scale", "input_offset", "quant_bias", "deq_scale"}
    assert all((Q + name in tensors) == (scheme == "w8a8") for name in static)
    if scheme == "w8a8":
        assert tensors[Q + "quant_bias"].dtype == torch.int32 and tensors[Q + "deq_scale"].dtype == torch.float32
        assert tensors[Q + "input_offset"].item() != 0  # (asymmetric: the input's least value is not minus its most)


def test_greedy_outputs_equal_vllm_ascends_arithmetic_on_the_same_checkpoint(modelslim, source):
    """transformers' model of the source, its linear layers replaced by vllm-ascend's arithmetic on the checkpoint's
    tensors (transformers does not read msModelSlim's format)."""
    scheme, out = modelslim
    _check_against_vllm_ascend(out, source, load_file(out / WEIGHTS.format(scheme)), scheme == "w8a16")


def test_a_w8a16_weight_offset_is_added_before_scaling_as_vllm_ascends_op_adds_it(source, tmp_path):
    """npu_weight_quant_batchmatmul's antiquant_offset: w = (q + offset) * scale. (npu-llm's writer leaves it zero.)"""
    out = quantize_checkpoint(str(source), tmp_path / "w8a16", "w8a16", format="ascend")
    generator = torch.Generator().manual_seed(3)

    def offsets(tensors):
        for key in [k for k in tensors if k.endswith("weight_offset")]:
            tensors[key] = torch.randint(-3, 4, tensors[key].shape, generator=generator).to(tensors[key].dtype)
    bad = rewrite_checkpoint(out, tmp_path, offsets, weights=WEIGHTS.format("w8a16"))
    tensors = load_file(bad / WEIGHTS.format("w8a16"))
    assert tensors[Q + "weight_offset"].any()
    _check_against_vllm_ascend(bad, source, tensors, weight_only=True)


def _check_against_vllm_ascend(out, source, tensors, weight_only: bool):
    ours, _, _ = load_model(out, ops_for("cpu"), dtype="float32", quantization="ascend")
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    reference = _vllm_ascend_arithmetic(hf_model(source), tensors, weight_only)
    prompt = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens, step_logits = _greedy_through_paged_cache(ours, prompt, 16, DECODE_STEPS)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + tokens])).logits[0].float()
    n = len(prompt)
    assert (_prompt_logits(ours, prompt, 16) - expected[:n]).abs().max() < 1e-2
    assert (step_logits - expected[n - 1: n - 1 + DECODE_STEPS]).abs().max() < 1e-2
    assert tokens == expected[n - 1: n - 1 + DECODE_STEPS].argmax(-1).tolist()


class _AscendLinear(nn.Module):
    """One layer as vllm-ascend's w8a8_static / w8a8_dynamic methods compute it, in float64. Per-token scales are
    absmax / 127.5, as the CPU quantizes (docs/quantization.md; the NPU's op divides by 127)."""

    def __init__(self, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None, weight_only: bool):
        super().__init__()
        self.t, self.bias, self.weight_only = {k: v.double() for k, v in tensors.items()}, bias, weight_only

    def forward(self, x):
        t, flat = self.t, x.double().reshape(-1, x.shape[-1])
        if self.weight_only:
            y = flat @ ((t["weight"] + t["weight_offset"]) * t["weight_scale"]).T
            y = y if self.bias is None else y + self.bias.double()
        elif "deq_scale" in t:
            q = torch.round(flat / t["input_scale"] + t["input_offset"]).clamp(-128, 127)
            y = (q @ t["weight"].T + t["quant_bias"]) * t["deq_scale"]
        else:
            scale = flat.abs().amax(dim=-1, keepdim=True) / 127.5
            y = (torch.round(flat / scale).clamp(-128, 127) @ t["weight"].T) * scale * t["weight_scale"].reshape(1, -1)
            y = y if self.bias is None else y + self.bias.double()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def _vllm_ascend_arithmetic(model: nn.Module, tensors: dict[str, torch.Tensor], weight_only: bool) -> nn.Module:
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and f"{name}.weight_scale" in tensors:
            own = {k.removeprefix(f"{name}."): v for k, v in tensors.items() if k.startswith(f"{name}.")}
            parent, _, last = name.rpartition(".")
            setattr(model.get_submodule(parent), last, _AscendLinear(own, module.bias, weight_only))
    return model


@pytest.mark.slow
def test_two_ranks_serve_a_static_checkpoint_as_one(source, tmp_path, default_model_dir):
    """Column-parallel layers take their rows of quant_bias and deq_scale; row-parallel ones read them whole and add
    them once, on rank 0, though each rank's share of the input carries the offset (in fp32; see
    docs/quantization.md for bf16)."""
    out = quantize_checkpoint(str(source), tmp_path / "w8a8", "w8a8", tokenizer=default_model_dir, format="ascend")
    alone, _ = _generate(out, default_model_dir, 1, quantization="ascend")
    sharded, _ = _generate(out, default_model_dir, 2, quantization="ascend")
    for a, b in zip(alone, sharded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == STEPS


@pytest.mark.slow
def test_a_bfloat16_static_checkpoint_of_the_default_model_stays_near_its_source(tmp_path, default_model_dir):
    """The folded quant_bias takes back the offset's share of the int32 sums, large beside the output: held in fp32
    the default model's bf16 logits keep a cosine of 0.84-0.88 to its source's (static W8A8 costs SmolLM2 that
    much); rounded to bf16 they measured -0.31, top-1 0."""
    from backend.config import EngineConfig
    from backend.entrypoints.verify import verify

    out = quantize_checkpoint(str(default_model_dir), tmp_path / "w8a8", "w8a8", format="ascend")
    _, figures = verify(EngineConfig(model=str(out), device="cpu", dtype="bfloat16", quantization="ascend"), steps=4,
                        reference=str(default_model_dir))
    value = {f.name: f.value for f in figures}
    assert value["logits cosine"] > 0.7 and value["logits top-1 agreement"] > 0.3, value


def test_a_float16_checkpoint_packs_deq_scale_in_int64_as_npu_trans_quant_param(tmp_path, default_model_dir):
    scale = torch.tensor([1e-4, 3.5e-3, 0.25])
    packed = deq_scale_to_int64(scale)
    assert packed.dtype == torch.int64 and ((packed >> 46) & 1).all()
    assert torch.equal(deq_scale_from_int64(packed).view(torch.int32), scale.view(torch.int32) & ~0x1FFF)
    source = _as_float16(make_tiny_model("llama", tmp_path / "source", vocab_size=VOCAB))
    out = quantize_checkpoint(str(source), tmp_path / "w8a8", "w8a8", tokenizer=default_model_dir, format="ascend")
    tensors = load_file(out / WEIGHTS.format("w8a8"))
    assert tensors[Q + "deq_scale"].dtype == torch.int64 and tensors[Q + "input_scale"].dtype == torch.float16
    reference = _vllm_ascend_arithmetic(hf_model(source), {k: deq_scale_from_int64(v) if v.dtype == torch.int64 else v
                                                        for k, v in tensors.items()}, weight_only=False)
    ours, _, _ = load_model(out, ops_for("cpu"), dtype="float32", quantization="ascend")
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float()
    assert (_prompt_logits(ours, prompt, 16) - expected).abs().max() < 1e-2


def _as_float16(model_dir):
    from safetensors.torch import save_file

    weights = model_dir / "model.safetensors"
    save_file({k: v.half() for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = "float16"
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


# -- bad checkpoints and settings --------------------------------------------------------------------------------


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


@pytest.mark.parametrize("tensors, description, message", [
    (lambda t: t.pop(Q + "deq_scale"), None, f"names tensors .* lacks: {Q}deq_scale"),
    (None, _set("model.layers.0.mlp.gate_proj.extra", "W8A8"), "lacks: model.layers.0.mlp.gate_proj.extra"),
    (None, _set(Q + "weight", "W4A8_DYNAMIC"), f"{Q}weight is W4A8_DYNAMIC, which is not served"),
    (None, _set("kv_cache_type", "C8"), "kv_cache_type 'C8' asks for a quantized KV cache"),
    (_set(Q + "quant_bias", torch.zeros(3, dtype=torch.int32)), None, f"tensor '{Q}quant_bias' has shape \\(3,\\)"),
    (_set(Q + "deq_scale", torch.ones(64, dtype=torch.int32)), None, f"tensor '{Q}deq_scale' is int32"),
    (_set(Q + "weight_offset", torch.ones(64, 1)), None, "weight_offset is not zero; asymmetric int8 weights"),
    (_set("model.layers.1.self_attn.k_proj.input_offset", torch.tensor([7.0])), None,
     "qkv_proj: its parts, which see one input, have different input scales .* or offsets"),
    (_set(Q + "deq_scale", torch.zeros(64)), None, "deq_scale must be finite and positive"),
    (_set("model.layers.0.input_layernorm.bias", torch.zeros(64)), None,
     "norm biases \\(model.layers.0.input_layernorm.bias, ...\\) from msModelSlim's anti-outlier suppression"),
])
def test_a_checkpoint_its_description_does_not_fit_fails_naming_the_tensor(source, tmp_path, default_model_dir,
                                                                          tensors, description, message):
    out = quantize_checkpoint(str(source), tmp_path / "w8a8", "w8a8", tokenizer=default_model_dir, format="ascend")
    bad = rewrite_checkpoint(out, tmp_path, tensors, description, weights=WEIGHTS.format("w8a8"),
                             config=MODELSLIM_DESCRIPTION)
    with pytest.raises(ModelLoadError, match=message):
        load_model(bad, ops_for("cpu"), dtype="float32", quantization="ascend")


def test_the_ascend_setting_is_checked_against_the_checkpoint(source, modelslim, tmp_path):
    _, out = modelslim
    with pytest.raises(ModelLoadError, match="an msModelSlim checkpoint .* load it with quantization='ascend'"):
        load_model(out, ops_for("cpu"), dtype="float32")
    with pytest.raises(ModelLoadError, match=f"quantization='ascend': .*{MODELSLIM_DESCRIPTION} is missing"):
        load_model(source, ops_for("cpu"), dtype="float32", quantization="ascend")
    compressed = quantize_checkpoint(str(source), tmp_path / "ct", "w8a8_dynamic")
    with pytest.raises(ModelLoadError, match="describes a compressed-tensors checkpoint; load it with quantization"):
        load_model(compressed, ops_for("cpu"), dtype="float32", quantization="ascend")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(str(out), tmp_path / "again", "w8a8_dynamic", format="ascend")
