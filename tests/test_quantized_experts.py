"""W8A8 dynamic experts (compressed-tensors, and msModelSlim's W8A8_DYNAMIC): a MoE model's experts stored one by one
as int8 weights with per-channel scales, as llm-compressor and msModelSlim write them, served by the per-expert loop
on int8 matmuls. Held to transformers running the same arithmetic (the dequantized weights, each expert's input rows
quantized per token), to one rank under expert parallel, and refused where they are not served."""
from __future__ import annotations

import json
import re
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.models.loader import ModelLoadError, load_model
from backend.models.quantization import MODELSLIM_DESCRIPTION
from npu_llm_kernels import ops_for, torch_ref
from tests.conftest import hf_model, make_tiny_model, rewrite_checkpoint
from tests.test_model_parity import DECODE_STEPS, _greedy_through_paged_cache, _prompt_logits
from tests.test_tensor_parallel import STEPS, _generate

EXPERT_WEIGHT = re.compile(r"^.+\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
FORMATS = ["compressed-tensors", "ascend"]
EXPERT = "model.layers.2.mlp.experts.1."


def _quantize_experts(source, root, format: str):
    """(quantized, dequantized): `source` with each expert's projections int8 with per-channel scales, as the two
    formats store them, the rest as it is; and `source` with those weights dequantized (q * scale), in fp32."""
    tensors, written, dequantized = load_file(source / "model.safetensors"), {}, {}
    for key, value in tensors.items():
        written[key] = dequantized[key] = value
        if EXPERT_WEIGHT.match(key):
            scale = value.abs().amax(dim=1, keepdim=True) / 127.5
            q = torch.round(value / scale).clamp(-128, 127)
            written[key], dequantized[key] = q.to(torch.int8), q * scale
            written[key + "_scale"] = scale
            if format == "ascend":
                written[key + "_offset"] = torch.zeros_like(scale)
    out, reference = root / "quantized", root / "dequantized"
    shutil.copytree(source, reference)
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(source, out)
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    if format == "ascend":
        description = {k: "W8A8_DYNAMIC" if ".experts." in k else "FLOAT" for k in written}
        (out / MODELSLIM_DESCRIPTION).write_text(json.dumps({"model_quant_type": "W8A8_DYNAMIC", **description}))
    else:
        args = {"num_bits": 8, "type": "int", "symmetric": True}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"experts": {"targets": ["re:.*experts.*"], "weights": {**args, "strategy": "channel"},
                                          "input_activations": {**args, "strategy": "token", "dynamic": True}}}}
    (out / "config.json").write_text(json.dumps(config))
    return out, reference


@pytest.fixture(scope="module", params=FORMATS)
def quantized_moe(request, tmp_path_factory):
    """(format, quantized folder, its dequantized twin)"""
    root = tmp_path_factory.mktemp(request.param)
    out, dequantized = _quantize_experts(make_tiny_model("qwen3_moe", root / "source"), root, request.param)
    return request.param, out, dequantized


def _quantization(format: str) -> str | None:
    return "ascend" if format == "ascend" else None


def _fake_quantized_experts(experts, hidden_states, top_k_index, top_k_weights):
    """transformers' Qwen3MoeExperts.forward with each matmul's input rows quantized per token (the values they
    stand for: q * scale), as compressed-tensors has transformers run W8A8 dynamic layers."""
    def linear(x, w):
        q, scale = torch_ref.quantize_int8(x)
        return torch.nn.functional.linear(q * scale, w)

    out = torch.zeros_like(hidden_states)
    for e in range(experts.num_experts):
        pos, tokens = torch.where(top_k_index.T == e)
        if len(tokens):
            gate, up = linear(hidden_states[tokens], experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = linear(experts.act_fn(gate) * up, experts.down_proj[e]) * top_k_weights[tokens, pos, None]
            out.index_add_(0, tokens, h)
    return out


def test_logits_equal_transformers_running_the_same_arithmetic(quantized_moe):
    """Teacher-forced on npu-llm's own greedy tokens, every position's logits against transformers': equal to
    fp32's rounding but for a few positions where a difference of 1e-7 moved an expert's input across a
    quantization step (measured: 1-3 of 69 positions, by at most 0.011). With the activations left unquantized in
    the reference, every position differs (by up to 0.048), so the count sees the arithmetic."""
    format, out, dequantized = quantized_moe
    ours, _, _ = load_model(out, ops_for("cpu"), dtype="float32", quantization=_quantization(format))
    experts = ours.model.layers[2].mlp.experts
    assert experts.w13_weight.dtype == torch.int8 and experts.w13_weight_scale.shape == (8, 64, 1)
    reference = hf_model(dequantized)
    for module in reference.modules():
        if type(module).__name__ == "Qwen3MoeExperts":
            module.forward = types.MethodType(_fake_quantized_experts, module)
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens, step_logits = _greedy_through_paged_cache(ours, prompt, 16, DECODE_STEPS)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + tokens])).logits[0].float()
    n = len(prompt)
    ours_logits = torch.cat([_prompt_logits(ours, prompt, 16), step_logits])
    error = (ours_logits - torch.cat([expected[:n], expected[n - 1: n - 1 + DECODE_STEPS]])).abs().amax(dim=1)
    assert (error > 1e-4).sum() <= 4 and error.max() < 2e-2, error


def test_expert_parallel_ranks_serve_quantized_experts_as_one(quantized_moe, default_model_dir):
    """Each rank holds half the experts whole, with their scales: one process's greedy tokens, their logprobs
    within 1e-2 (the ranks' partial sums add in another order, and a difference of 1e-7 can move a later
    activation across a quantization step: measured 9e-4). Tensor parallel splits each expert's down projection,
    whose input each rank then quantizes on its own, as vLLM does: its first tokens are among one process's top 5."""
    format, out, _ = quantized_moe
    alone, _ = _generate(out, default_model_dir, 1, quantization=_quantization(format))
    spread, _ = _generate(out, default_model_dir, 2, enable_expert_parallel=True, quantization=_quantization(format))
    for a, b in zip(alone, spread):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids and len(a.token_ids) == STEPS
        for token, step_a, step_b in zip(a.token_ids, a.logprobs, b.logprobs):
            assert abs(step_a[token].logprob - step_b[token].logprob) < 1e-2
    sharded, _ = _generate(out, default_model_dir, 2, quantization=_quantization(format))
    for a, b in zip(alone, sharded):
        assert b.outputs[0].token_ids[0] in a.outputs[0].logprobs[0]


def _set(key, value):
    return lambda tensors: tensors.__setitem__(key, value)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(EXPERT + "up_proj.weight_scale"),  # (msModelSlim's description names it first)
     f"lacks tensors for .*expert 1 up weight_scale|lacks: {EXPERT}up_proj.weight_scale"),
    (_set(EXPERT + "gate_proj.weight", torch.zeros(32, 64)), f"tensor '{EXPERT}gate_proj.weight' is float32, where "
                                                             "the checkpoint's quantization .* makes it int8"),
    (_set(EXPERT + "down_proj.weight_scale", torch.ones(3, 1)), f"'{EXPERT}down_proj.weight_scale' has shape \\(3, 1\\)"),
    (_set(EXPERT + "down_proj.weight_scale", torch.full((64, 1), float("nan"))), "weight_scale holds a value that is "
                                                                                  "not finite"),
])
def test_a_bad_expert_tensor_fails_the_load_naming_it(quantized_moe, tmp_path, edit, message):
    format, out, _ = quantized_moe
    bad = rewrite_checkpoint(out, tmp_path, edit)
    with pytest.raises(ModelLoadError, match=message):
        load_model(bad, ops_for("cpu"), dtype="float32", quantization=_quantization(format))


def test_static_experts_are_refused(quantized_moe, tmp_path):
    format, out, _ = quantized_moe
    if format == "ascend":
        static = rewrite_checkpoint(out, tmp_path, config=MODELSLIM_DESCRIPTION, change_config=lambda d: d.update(
            {k: "W8A8" for k in d if ".experts." in k}))
    else:
        static = rewrite_checkpoint(out, tmp_path, change_config=lambda c: c["quantization_config"]["config_groups"][
            "experts"]["input_activations"].update(strategy="tensor", dynamic=False))
    with pytest.raises(ModelLoadError, match="static .* experts are not served"):
        load_model(static, ops_for("cpu"), dtype="float32", quantization=_quantization(format))


def test_the_npu_serves_quantized_experts_as_vllm_ascend_runs_them(quantized_moe, fake_npu, monkeypatch,
                                                                   default_model_dir):
    """On the fake torch_npu, in bf16: the routing quantizes each pair's row, two grouped int8 matmuls with their
    scales, the weights in FRACTAL_NZ. Each prompt's first greedy token is among the CPU's five most likely (the NPU
    divides by 127 where the CPU divides by 127.5), and every KV block returns."""
    from backend import LLM, SamplingParams

    format, out, _ = quantized_moe
    prompts = [{"prompt_token_ids": torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
               for n in (7, 40)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    args = dict(model=str(out), tokenizer=str(default_model_dir), dtype="bfloat16", num_kv_blocks=8,
                quantization=_quantization(format), enforce_eager=True)
    with LLM(device="npu", **args) as llm:
        on_npu = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert llm.engine.kv.num_free_blocks == 8
    assert fake_npu.calls["npu_grouped_matmul"] > 0 and fake_npu.calls["npu_dynamic_quant"] > 0
    assert fake_npu.calls["npu_format_cast"] > 0  # (the int8 weights, dense and expert, in FRACTAL_NZ)
    monkeypatch.setenv("NPU_LLM_CPU_KERNELS", "0")
    with LLM(device="cpu", block_size=128, **args) as llm:
        on_cpu = [o.outputs[0] for o in llm.generate(prompts, params)]
    for npu_out, cpu_out in zip(on_npu, on_cpu):
        assert len(npu_out.token_ids) == 4 and npu_out.token_ids[0] in cpu_out.logprobs[0]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("format, scheme", [("ascend", "w8a8"), ("compressed-tensors", "w8a8_dynamic")])
def test_quantize_writes_int8_experts_in_msmodelslims_format(arch, format, scheme, tmp_path, default_model_dir):
    """msModelSlim's: the experts W8A8_DYNAMIC (vllm-ascend serves no static experts), the rest by the scheme.
    compressed-tensors': the experts and routers left in their precision (transformers 5 holds experts as stacked
    parameters, which compressed-tensors does not quantize). Either way the logits stay near the source's."""
    from backend.entrypoints.quantize import quantize_checkpoint

    source = make_tiny_model(arch, tmp_path / "source", vocab_size=49152)
    out = quantize_checkpoint(str(source), tmp_path / "out", scheme, tokenizer=default_model_dir, format=format)
    ours, _, _ = load_model(out, ops_for("cpu"), dtype="float32", quantization=_quantization(format))
    experts = ours.model.layers[0].mlp.experts
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    assert (experts.w13_weight.dtype == torch.int8) == (format == "ascend")
    if format == "ascend":
        description = json.loads((out / MODELSLIM_DESCRIPTION).read_text())
        assert {kind for key, kind in description.items() if ".experts." in key} == {"W8A8_DYNAMIC"}
        assert description["model.layers.0.self_attn.q_proj.weight"] == "W8A8"
    prompt = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    unquantized, _, _ = load_model(source, ops_for("cpu"), dtype="float32")
    want, got = _prompt_logits(unquantized, prompt, 16), _prompt_logits(ours, prompt, 16)
    assert torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0) > 0.9  # (measured: 0.955-1)
