"""W8A8 and W8A16 checkpoints (compressed-tensors): `npu-llm quantize` writes them with the compressed-tensors package;
npu-llm serves them with int8 weights, and its greedy outputs equal transformers' on the same checkpoint in fp32; the
CPU's int8 kernels equal the reference at every CPU level; tensor parallel shards the int8 weights and their scales
(W8A16's packed weights and grouped scales too); and a checkpoint that contradicts its config, or asks for a scheme
npu-llm does not run, fails the load naming why."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backend import LLM, SamplingParams
from backend.entrypoints.cli import main as cli_main
from backend.models.loader import ModelLoadError, load_model
from backend.entrypoints.quantize import quantize_checkpoint
from backend.triton.model_json import parse_model_json
from npu_llm_kernels import cpu, ops_for, torch_ref
from tests.conftest import make_tiny_model, rewrite_checkpoint
from tests.test_model_parity import _check_against_hf, _prompt_logits
from tests.test_tensor_parallel import STEPS, _generate

VOCAB = 49152  # the default model's tokenizer: the calibration text is tokenized with it
LLM_COMPRESSOR_W8A8 = Path(__file__).parent / "data" / "llmcompressor_w8a8_tiny_llama"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("source"), vocab_size=VOCAB)


@pytest.fixture(scope="module", params=["w8a8_dynamic", "w8a8"])
def quantized(request, source, tmp_path_factory, default_model_dir):
    """(scheme, folder), written through the CLI."""
    out = tmp_path_factory.mktemp(request.param) / "out"
    assert cli_main(["quantize", "--model", str(source), "--out", str(out), "--scheme", request.param,
                     "--tokenizer", str(default_model_dir)]) == 0
    return request.param, out


def test_the_checkpoint_is_int8_as_compressed_tensors_describes_it(quantized):
    scheme, out = quantized
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    assert config["ignore"] == ["lm_head"]
    inputs = config["config_groups"]["group_0"]["input_activations"]
    assert (inputs["dynamic"], inputs["strategy"]) == ((True, "token") if scheme == "w8a8_dynamic" else (False, "tensor"))
    weights = load_file(out / "model.safetensors")
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert weights["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 1)
    assert weights["lm_head.weight"].dtype == torch.float32
    assert ("model.layers.0.mlp.down_proj.input_scale" in weights) == (scheme == "w8a8")


def test_greedy_outputs_equal_transformers_on_the_same_checkpoint(quantized):
    """transformers (with compressed-tensors) dequantizes the weights and fake-quantizes the activations; npu-llm
    multiplies int8 by int8. In fp32 the two agree to rounding, and greedy tokens are identical. (The logits' bound
    is wider than an unquantized model's: a rounding difference of 1e-7 can move an activation across a
    quantization step, which changes a logit by about 1e-3.)"""
    _, out = quantized
    model, _, _ = load_model(out, ops_for("cpu"), dtype="float32")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape == (64 + 2 * 32, 1)
    prompt = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    _check_against_hf(out, prompt, block_size=16, atol=1e-2)


def test_a_checkpoint_llm_compressor_made_is_served_as_transformers_serves_it():
    """llm-compressor's own W8A8 (its QuantizationModifier; tests/data/llmcompressor_w8a8_tiny_llama/README.md):
    its compressed-tensors version and extra files (recipe.yaml) are its own, and npu-llm reads it all the same."""
    config = json.loads((LLM_COMPRESSOR_W8A8 / "config.json").read_text())["quantization_config"]
    assert config["version"] == "0.19.0" and (LLM_COMPRESSOR_W8A8 / "recipe.yaml").is_file()
    model, _, _ = load_model(LLM_COMPRESSOR_W8A8, ops_for("cpu"), dtype="float32")
    assert model.model.layers[1].mlp.down_proj.scheme.name == "w8a8_dynamic"
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    _check_against_hf(LLM_COMPRESSOR_W8A8, prompt, block_size=16, atol=1e-2)


def test_quantized_logits_stay_close_to_the_unquantized_model(quantized, source):
    _, out = quantized
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = _prompt_logits(load_model(out, ops_for("cpu"), dtype="float32")[0], prompt, 16)
    unquantized = _prompt_logits(load_model(source, ops_for("cpu"), dtype="float32")[0], prompt, 16)
    assert torch.nn.functional.cosine_similarity(ours, unquantized, dim=-1).min() > 0.999
    assert (ours.argmax(-1) == unquantized.argmax(-1)).float().mean() > 0.85


@pytest.mark.parametrize("static, offset", [(False, None), (True, None), (True, -37.0)])
def test_the_cpu_int8_kernels_equal_the_reference_at_every_level(static, offset, cpu_level):
    """At this CPU level (VNNI: oneDNN's int8 GEMM, on weights pack_int8_weight prepacked or on plain ones as the
    experts hold them; else the extension's AVX2 kernel; K not a multiple of 16, or no AVX2: torch_ref), from a decode
    row to a prefill chunk: fp32 activations give torch_ref's very result (the int8 products are summed exactly
    either way, and scaled in one order), bf16 ones the same within bf16's rounding of the output. (offset:
    msModelSlim's asymmetric static activations.)"""
    torch.manual_seed(0)
    for rows, k, n in [(1, 64, 96), (3, 576, 193), (17, 128, 64), (300, 256, 160), (5, 72, 33)]:
        plain = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        weight_scale, bias = torch.rand(n, 1) / 100, torch.randn(n)
        x = torch.randn(rows, k).bfloat16()
        input_scale = x.float().abs().amax().reshape(1) / 127.5 if static else None
        input_offset = None if offset is None else torch.tensor([offset])
        reference = torch_ref.int8_linear(x.float(), plain, weight_scale, input_scale, bias.bfloat16().float(),
                                          input_offset)
        for weight in (cpu.pack_int8_weight(plain), _prepacked_alone(plain), plain):
            exact = cpu.int8_linear(x.float(), weight, weight_scale, input_scale, bias.bfloat16().float(), input_offset)
            assert torch.equal(exact, reference), (rows, k, n, weight is plain)
        weight = cpu.pack_int8_weight(plain)
        got = cpu.int8_linear(x, weight, weight_scale, input_scale, bias.bfloat16(), input_offset)
        want = torch_ref.int8_linear(x.float(), plain, weight_scale, input_scale, bias.bfloat16().float(),
                                     input_offset)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max(), (rows, k, n)


def _prepacked_alone(plain):
    """pack_int8_weight's weights as a large layer holds them: prepacked only, oneDNN taking every call."""
    weight = cpu.pack_int8_weight(plain)
    if hasattr(weight, "plain"):
        del weight.plain
    return weight


def test_prepacked_int8_weights_serve_fp16_and_a_run_without_the_extension(monkeypatch, cpu_level):
    """Where the extension's ends of oneDNN's call do not apply, torch does them, to torch_ref's result."""
    torch.manual_seed(0)
    plain, weight_scale = torch.randint(-128, 128, (48, 64), dtype=torch.int8), torch.rand(48, 1) / 100
    weight, x = cpu.pack_int8_weight(plain), torch.randn(20, 64)
    assert hasattr(weight, "out_features") == cpu.cpu_features().vnni
    got = cpu.int8_linear(x.half(), weight, weight_scale, None)
    assert got.dtype == torch.float16 and torch.equal(got, torch_ref.int8_linear(x.half(), plain, weight_scale, None))
    monkeypatch.setenv("NPU_LLM_CPU_KERNELS", "0")
    assert torch.equal(cpu.int8_linear(x, weight, weight_scale, None), torch_ref.int8_linear(x, plain, weight_scale, None))


_VNNI_WITHOUT_AMX = """
import torch
from npu_llm_kernels import cpu, torch_ref
torch.manual_seed(0)
plain, scale = torch.randint(-128, 128, (96, 256), dtype=torch.int8), torch.rand(96, 1) / 100
x = torch.randn(40, 256)
assert torch.equal(cpu.int8_linear(x, cpu.pack_int8_weight(plain), scale, None),
                   torch_ref.int8_linear(x, plain, scale, None))
print("EQUAL")
"""


def test_onednn_multiplies_int8_in_its_fast_kernel_where_vnni_has_no_amx(tmp_path):
    """oneDNN held to AVX512-VNNI (a Zen 4 or an Ice Lake): the rows go to it unsigned with zero point 128, which its
    VNNI kernels take; signed ones fell to its reference kernel there, 30-250x slower (and exact, so only its verbose
    log tells). Where the CPU has no VNNI, the weights are not prepacked, and oneDNN is not called."""
    import os
    import subprocess
    import sys

    from npu_llm_kernels.cpu_features import X86_LEVELS, host_level

    # (the level knob never raises a level: an AVX2-only CPU runs the test at its own, without VNNI)
    level = "avx512" if host_level() in X86_LEVELS[X86_LEVELS.index("avx512"):] else host_level()
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "ONEDNN_VERBOSE": "1", "NPU_LLM_CPU_ISA": level}
    run = subprocess.run([sys.executable, "-c", _VNNI_WITHOUT_AMX], capture_output=True, text=True, timeout=600,
                         env=env, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0 and "EQUAL" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    if cpu.cpu_features().vnni:
        matmuls = [line.split(",") for line in run.stdout.splitlines() if line.startswith("onednn_verbose")]
        matmuls = [fields for fields in matmuls if fields[3:6] == ["exec", "cpu", "matmul"]]  # (then its kernel)
        assert matmuls and not any(fields[6].startswith("ref") for fields in matmuls), matmuls[:3]


def test_the_cpu_int8_kernels_round_ties_to_even_keep_nan_and_leave_fp16_to_torch_ref(cpu_level):
    """Values exactly halfway between two int8 steps round to even, as compressed-tensors' torch.round does; a NaN in
    a row makes that row's outputs NaN (and only that row's); fp16 activations take torch_ref."""
    weight, weight_scale = torch.eye(32, dtype=torch.int8), torch.ones(32, 1)
    halves = torch.arange(32, dtype=torch.float32) - 15.5  # -15.5 .. 15.5 in steps of one: every value a tie
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.stack([halves, halves.flip(0)]).to(dtype)
        got = cpu.int8_linear(x, weight, weight_scale, torch.ones(1))
        assert got.dtype == dtype and torch.equal(got.float(), torch.round(x.float()))
        assert got[0, 0] == -16 and got[0, 1] == -14 and got[0, 31] == 16
    x = torch.randn(3, 32)
    x[1, 5] = float("nan")
    got = cpu.int8_linear(x, weight, weight_scale, None)
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()


def test_a_bfloat16_engine_serves_the_checkpoint_close_to_fp32(quantized, default_model_dir):
    """Through the engine in bf16 (the CPU's int8 kernels), with chunked prefill: every KV block returns to the pool,
    and each prompt's first greedy token is among fp32's five most likely (this tiny random model's logits lie too
    close together for bf16 to pick fp32's very token every time)."""
    _, out = quantized
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 50)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    results = {}
    for dtype in ("bfloat16", "float32"):
        with LLM(model=str(out), tokenizer=str(default_model_dir), dtype=dtype, num_kv_blocks=32, block_size=16,
                 max_num_batched_tokens=32) as llm:
            results[dtype] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
            assert llm.engine.kv.num_free_blocks == 32
    for bf16, fp32 in zip(results["bfloat16"], results["float32"]):
        assert len(bf16.token_ids) == 8 and bf16.token_ids[0] in fp32.logprobs[0]


@pytest.mark.slow
def test_two_ranks_serve_a_static_checkpoint_as_one(source, tmp_path, default_model_dir):
    """Column-parallel layers take their rows of the int8 weights and of the scales; row-parallel ones their columns
    and the whole scales; every rank reads the static input scales whole. (Dynamic W8A8 under tensor parallel
    quantizes each rank's share of a row-parallel input on its own, as vLLM does: not bit-equal to one rank.)"""
    out = quantize_checkpoint(str(source), tmp_path / "w8a8", "w8a8", tokenizer=default_model_dir)
    alone, _ = _generate(out, default_model_dir, 1)
    sharded, _ = _generate(out, default_model_dir, 2)
    for a, b in zip(alone, sharded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == STEPS


# -- W8A16 (weights only, pack-quantized) -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=[None, 32], ids=["per-channel", "groups-of-32"])
def w8a16(request, source, tmp_path_factory):
    """(group size, folder), written through the CLI."""
    out = tmp_path_factory.mktemp("w8a16") / "out"
    group = ["--group-size", str(request.param)] if request.param else []
    assert cli_main(["quantize", "--model", str(source), "--out", str(out), "--scheme", "w8a16", *group]) == 0
    return request.param, out


def test_a_w8a16_checkpoint_is_packed_as_compressed_tensors_describes_it(w8a16):
    group, out = w8a16
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = config["config_groups"]["group_0"]
    assert config["format"] == "pack-quantized" and scheme["input_activations"] is None
    assert (scheme["weights"]["strategy"], scheme["weights"]["group_size"]) == (("group", 32) if group else
                                                                                ("channel", None))
    weights = load_file(out / "model.safetensors")
    assert Q + "weight" not in weights and weights[Q + "weight_packed"].dtype == torch.int32
    assert weights[Q + "weight_packed"].shape == (64, 16) and weights[Q + "weight_scale"].shape == (64, 2 if group else 1)


def test_w8a16_greedy_outputs_equal_transformers_on_the_same_checkpoint(w8a16):
    """transformers dequantizes the weights as npu-llm does, and nothing else is quantized: the two agree to fp32's
    rounding, as unquantized models do."""
    group, out = w8a16
    model, _, _ = load_model(out, ops_for("cpu"), dtype="float32")
    down = model.model.layers[0].mlp.down_proj
    assert down.scheme.weight_only and down.weight.dtype == torch.int8 and down.weight.shape == (64, 128)
    assert down.weight_scale.shape == (64, 4 if group else 1) and not hasattr(down, "weight_packed")
    prompt = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    _check_against_hf(out, prompt, block_size=16, atol=1e-3)


@pytest.mark.parametrize("groups, offset", [(1, False), (1, True), (4, False)])
def test_the_cpu_w8a16_kernels_equal_the_reference_at_every_level(groups, offset, cpu_level):
    """At this CPU level (a few rows: the extension's kernel, which dequantizes in its inner loop; more: blocks
    dequantized by the extension, multiplied by oneDNN; no AVX2: torch_ref), from a decode row to a prefill chunk, in
    fp32 and bf16: torch_ref's result, to the rounding of the dtype. (offset: msModelSlim's per-channel one.)"""
    torch.manual_seed(0)
    for rows, k, n in [(1, 64, 96), (3, 576, 193), (15, 128, 64), (300, 256, 160), (5, 72, 36)]:
        if (k // groups) % 8 and groups > 1:
            continue
        weight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        scale, bias = torch.rand(n, groups) / 100, torch.randn(n)
        weight_offset = torch.randint(-8, 8, (n, 1)).float() if offset else None
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            x = torch.randn(rows, k).to(dtype)
            got = cpu.w8a16_linear(x, weight, scale, weight_offset, bias.to(dtype))
            want = torch_ref.w8a16_linear(x.double(), weight, scale.double(), weight_offset, bias.to(dtype).double())
            assert got.dtype == dtype and got.shape == (rows, n)
            assert (got.double() - want).abs().max() <= tolerance * want.abs().max(), (rows, k, n, dtype)


@pytest.mark.slow
def test_two_ranks_serve_a_grouped_w8a16_checkpoint_as_one(source, tmp_path, default_model_dir):
    """Row-parallel layers take their columns of the packed weights (four a word) and of the grouped scales (one a
    group); column-parallel ones their rows."""
    out = quantize_checkpoint(str(source), tmp_path / "w8a16", "w8a16", group_size=32)
    alone, _ = _generate(out, default_model_dir, 1)
    sharded, _ = _generate(out, default_model_dir, 2)
    for a, b in zip(alone, sharded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == STEPS


# -- bad checkpoints and settings --------------------------------------------------------------------------------


Q = "model.layers.1.self_attn.q_proj."


@pytest.mark.parametrize("edit, message", [
    (lambda w: w.pop(Q + "weight_scale"), "lacks tensors for model.layers.1.self_attn.qkv_proj.weight_scale"),
    (lambda w: w.update({Q + "weight_scale": torch.ones(64)}),
     "tensor 'model.layers.1.self_attn.q_proj.weight_scale' has shape \\(64,\\), expected \\(64, 1\\)"),
    (lambda w: w.update({Q + "weight": w[Q + "weight"].float()}),
     "tensor 'model.layers.1.self_attn.q_proj.weight' is float32, .* makes it int8"),
    (lambda w: w.update({Q + "input_scale": torch.ones(1)}),
     "unexpected tensor 'model.layers.1.self_attn.q_proj.input_scale'"),
])
def test_a_checkpoint_that_contradicts_its_config_fails_naming_the_tensor(source, tmp_path, edit, message):
    out = quantize_checkpoint(str(source), tmp_path / "dyn", "w8a8_dynamic")
    with pytest.raises(ModelLoadError, match=message):
        load_model(rewrite_checkpoint(out, tmp_path, edit), ops_for("cpu"), dtype="float32")


def _weights(group):
    return group["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize("edit, message", [
    (lambda c: _weights(c).update(num_bits=4), "weights \\(4-bit int, symmetric, per channel, static\\) are not served"),
    (lambda c: _weights(c).update(symmetric=False), "asymmetric"),
    (lambda c: _weights(c).update(strategy="group", group_size=32), "per group of 32"),
    (lambda c: c["config_groups"]["group_0"].update(format="pack-quantized"),
     "W8A8 weights stored 'pack-quantized' are not served"),
    (lambda c: c["config_groups"]["group_0"].update(format="marlin-24"), "stored 'marlin-24'"),
    (lambda c: c["config_groups"]["group_0"]["input_activations"].update(strategy="group", group_size=16),
     "input activations \\(8-bit int, symmetric, per group of 16, dynamic\\) are not served"),
    (lambda c: c.update(ignore=[]), "a quantized lm_head is not served yet"),
    (lambda c: c.update(ignore=["model.layers.0.self_attn.k_proj"]),
     "model.layers.0.self_attn.qkv_proj: its checkpoint layers are quantized differently"),
    (lambda c: c.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}),
     "a quantized KV cache"),
    (lambda c: c.update(quant_method="awq"), "quant_method 'awq' is not served"),
])
def test_a_scheme_npu_llm_does_not_run_fails_the_load_naming_it(source, tmp_path, edit, message):
    out = quantize_checkpoint(str(source), tmp_path / "dyn", "w8a8_dynamic")
    with pytest.raises(ModelLoadError, match=message):
        load_model(rewrite_checkpoint(out, tmp_path, change_config=lambda c: edit(c["quantization_config"])),
                   ops_for("cpu"), dtype="float32")


W = "model.layers.1.mlp.down_proj."


@pytest.mark.parametrize("edit, config, message", [
    (lambda w: w.pop(W + "weight_scale"), None, "lacks tensors for model.layers.1.mlp.down_proj.weight_scale"),
    (lambda w: w.update({W + "weight_scale": torch.ones(64, 3)}), None,
     f"tensor '{W}weight_scale' has shape \\(64, 3\\), expected \\(64, 4\\)"),
    (lambda w: w.update({W + "weight_packed": w[W + "weight_packed"][:, :31].contiguous()}), None,
     f"tensor '{W}weight_packed' has shape \\(64, 31\\), expected \\(64, 32\\)"),
    (lambda w: w.update({W + "weight_packed": w[W + "weight_packed"].float()}), None,
     f"tensor '{W}weight_packed' is float32, .* makes it int32"),
    (None, lambda c: _weights(c).update(group_size=48), "self_attn.qkv_proj: w8a16 \\(groups of 48\\): this layer's "
                                                          "64 input features are not whole groups"),
    (None, lambda c: c["config_groups"]["group_0"].update(format="int-quantized"),
     "unexpected tensor 'model.layers.0.mlp.down_proj.weight_packed'"),
])
def test_a_w8a16_checkpoint_that_contradicts_its_config_fails_naming_the_tensor(source, tmp_path, edit, config,
                                                                                 message):
    out = quantize_checkpoint(str(source), tmp_path / "w8a16", "w8a16", group_size=32)
    bad = rewrite_checkpoint(out, tmp_path, edit, None if config is None else
                             lambda c: config(c["quantization_config"]))
    with pytest.raises(ModelLoadError, match=message):
        load_model(bad, ops_for("cpu"), dtype="float32")


def test_a_zero_input_scale_fails_the_load_and_zero_points_of_zero_are_ignored(source, tmp_path, default_model_dir):
    out = quantize_checkpoint(str(source), tmp_path / "static", "w8a8", tokenizer=default_model_dir)

    def zero_scale(tensors):
        tensors["model.layers.0.mlp.down_proj.input_scale"] = torch.zeros(1)
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.down_proj: input_scale must be finite and positive"):
        load_model(rewrite_checkpoint(out, tmp_path / "zero-scale", zero_scale), ops_for("cpu"), dtype="float32")

    def zero_points(tensors):  # as older compressed-tensors versions wrote them for symmetric schemes
        for name in [n for n in tensors if n.endswith("weight_scale")]:
            tensors[name.replace("weight_scale", "weight_zero_point")] = torch.zeros_like(tensors[name], dtype=torch.int8)
    model, _, _ = load_model(rewrite_checkpoint(out, tmp_path / "zero-points", zero_points), ops_for("cpu"),
                             dtype="float32")
    assert model.model.layers[0].mlp.down_proj.scheme.name == "w8a8"


def test_a_group_that_names_a_layer_wins_over_one_that_names_its_class(source, tmp_path):
    """As vLLM matches them: group_0 makes every Linear W8A8 dynamic, group_1 the down projections static."""
    out = quantize_checkpoint(str(source), tmp_path / "dyn", "w8a8_dynamic")

    def static_down(config):
        groups = config["quantization_config"]["config_groups"]
        groups["group_1"] = {**groups["group_0"], "targets": ["re:.*down_proj$"], "input_activations": {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}}

    def input_scales(tensors):
        for layer in range(2):
            tensors[f"model.layers.{layer}.mlp.down_proj.input_scale"] = torch.full((1,), 0.05)
    model, _, _ = load_model(rewrite_checkpoint(out, tmp_path, input_scales, static_down), ops_for("cpu"),
                             dtype="float32")
    assert model.model.layers[1].mlp.down_proj.scheme.name == "w8a8"
    assert model.model.layers[1].mlp.gate_up_proj.scheme.name == "w8a8_dynamic"


def test_int8_weights_without_a_quantization_config_are_refused(source, tmp_path):
    out = quantize_checkpoint(str(source), tmp_path / "dyn", "w8a8_dynamic")
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="down_proj.weight' is int8, .* makes it float32"):
        load_model(out, ops_for("cpu"), dtype="float32")


def test_the_quantization_setting_is_checked_against_the_checkpoint(source, quantized):
    _, out = quantized
    assert load_model(out, ops_for("cpu"), dtype="float32", quantization="compressed-tensors")[0] is not None
    with pytest.raises(ModelLoadError, match="quantization='compressed-tensors': .* has no quantization_config"):
        load_model(source, ops_for("cpu"), dtype="float32", quantization="compressed-tensors")
    with pytest.raises(ModelLoadError, match="quantization='ascend': .* describes a compressed-tensors checkpoint"):
        load_model(out, ops_for("cpu"), dtype="float32", quantization="ascend")


def test_quantized_latent_attention_is_refused_until_it_is_served(tmp_path):
    """(Quantized experts are served: tests/test_quantized_experts.py.)"""
    moe = make_tiny_model("deepseek_v2", tmp_path / "moe")
    config = json.loads((moe / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized",
                                     "config_groups": {"g": {"targets": ["Linear"], "weights": {
                                         "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                                         "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                               "strategy": "token", "dynamic": True}}},
                                     "ignore": ["lm_head"]}
    (moe / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="served for models of plain attention; this one has latent attention"):
        load_model(moe, ops_for("cpu"), dtype="float32")


def test_model_json_takes_vllms_quantization_values_and_refuses_others():
    assert parse_model_json({"quantization": "compressed-tensors"}).config.quantization == "compressed-tensors"
    assert parse_model_json({"quantization": None}).config.quantization is None
    assert parse_model_json({"quantization": "ascend"}).config.quantization == "ascend"
    with pytest.raises(ValueError, match="quantization='awq': must be one of compressed-tensors, ascend"):
        parse_model_json({"quantization": "awq"})


def test_quantize_refuses_an_unknown_scheme_and_a_bad_calibration_file(source, tmp_path, default_model_dir):
    with pytest.raises(ValueError, match="scheme 'w4a16'"):
        quantize_checkpoint(str(source), tmp_path / "a", "w4a16")
    with pytest.raises(ValueError, match="group size 32: grouped weight scales are written for w8a16 in the "
                                         "compressed-tensors format"):
        quantize_checkpoint(str(source), tmp_path / "a", "w8a16", group_size=32, format="ascend")
    with pytest.raises(ValueError, match="group size 48 does not divide the input features"):
        quantize_checkpoint(str(source), tmp_path / "a", "w8a16", group_size=48)
    bad = tmp_path / "calibration.jsonl"
    bad.write_text('{"text": "fine"}\n{"prompt": "no text"}\n')
    with pytest.raises(ValueError, match='calibration.jsonl:2: expected an object with a "text" string'):
        quantize_checkpoint(str(source), tmp_path / "b", "w8a8", calibration=bad)
    with pytest.raises(ValueError, match="no calibration tokens"):
        quantize_checkpoint(str(source), tmp_path / "c", "w8a8", max_calibration_tokens=0, tokenizer=default_model_dir)


def test_a_checkpoint_in_pickle_only_is_refused_not_loaded(tiny_llama_dir, tmp_path):
    """quantize reads weights as the engine does, from safetensors: a pytorch_model.bin (a pickle, which can run code
    when loaded) is never opened."""
    import shutil

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(Path(tiny_llama_dir) / "config.json", pickled)
    weights = {}
    for part in Path(tiny_llama_dir).glob("*.safetensors"):
        weights.update(load_file(part))
    torch.save(weights, pickled / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        quantize_checkpoint(str(pickled), tmp_path / "out", "w8a8")
