"""W8A8 and W8A16 on the NPU, against the fake torch_npu: W8A8's weights cast to FRACTAL_NZ (W8A16's stay ND, which
an eager call needs), activations quantized by npu_dynamic_quant (dynamic) or npu_quantize (static), npu_quant_matmul
with the scales vllm-ascend passes (npu_trans_quant_param's int64 for a static fp16 output, which graph mode needs);
the result
equal to torch_ref's up to the op's own rounding (absmax / 127 where compressed-tensors divides by 127.5); W8A16's
npu_weight_quant_batchmatmul with per-channel or grouped scales; the ops refuse what the real ones refuse; and the
engine serves W8A8 and W8A16 checkpoints on the NPU."""
from __future__ import annotations

import pytest
import torch

from backend.entrypoints.quantize import quantize_checkpoint
from tests.conftest import make_tiny_model

VOCAB = 49152


@pytest.mark.parametrize("static, offset, dtype", [(False, None, torch.bfloat16), (True, None, torch.bfloat16),
                                                   (True, 5.0, torch.bfloat16), (True, 5.0, torch.float16),
                                                   (False, None, torch.float16)])
def test_npu_w8a8_linear_matches_torch_ref(fake_npu, static, offset, dtype):
    """(offset: msModelSlim's asymmetric activations, npu_quantize's zero_points; fp16 static: the bias as int32,
    which is all the op takes there)"""
    from npu_llm_kernels import npu, torch_ref

    torch.manual_seed(0)
    rows, k, n = 9, 128, 96
    x, bias = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    weight, weight_scale = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n, 1) / 100
    input_scale = x.float().abs().amax().reshape(1) / 127.5 if static else None
    input_offset = None if offset is None else torch.tensor([offset])
    packed = npu.pack_int8_weight(weight.to("npu"))
    assert packed.shape == (k, n) and fake_npu.get_npu_format(packed) == 29
    ours = npu.int8_linear(x.to("npu"), packed, weight_scale.to("npu"),
                           None if input_scale is None else input_scale.to("npu"), bias.to("npu"),
                           None if input_offset is None else input_offset.to("npu"))
    expected = torch_ref.int8_linear(x.float(), weight, weight_scale, input_scale, bias.float(), input_offset)
    assert ours.device.type == "npu" and ours.dtype == dtype and ours.shape == (rows, n)
    # one int8 step of an activation moves an output by about |w| * scale_x * scale_w: within 3% of the largest
    assert (ours.cpu().float() - expected).abs().max() < 0.03 * expected.abs().max()
    quantize = "npu_quantize" if static else "npu_dynamic_quant"
    int64_scale = {"npu_trans_quant_param": 1} if static and dtype == torch.float16 else {}
    assert fake_npu.calls == {"npu_format_cast": 1, quantize: 1, "npu_quant_matmul": 1, **int64_scale}


@pytest.mark.parametrize("groups, offset, dtype", [(1, False, torch.bfloat16), (1, True, torch.bfloat16),
                                                   (4, False, torch.bfloat16), (1, True, torch.float16)])
def test_npu_w8a16_linear_matches_torch_ref(fake_npu, groups, offset, dtype):
    """(groups: compressed-tensors' grouped scales, [G, N] with antiquant_group_size; offset: msModelSlim's)"""
    from npu_llm_kernels import npu, torch_ref

    torch.manual_seed(0)
    rows, k, n = 9, 128, 96
    x, bias = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    weight, scale = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n, groups) / 100
    weight_offset = torch.randint(-8, 8, (n, 1)).float() if offset else None
    packed, packed_scale, packed_offset = npu.pack_w8a16_weight(
        weight.to("npu"), scale.to("npu"), None if weight_offset is None else weight_offset.to("npu"))
    assert packed.shape == (k, n) and fake_npu.get_npu_format(packed) == 2
    assert packed_scale.shape == ((n,) if groups == 1 else (groups, n))
    ours = npu.w8a16_linear(x.to("npu"), packed, packed_scale, packed_offset, bias.to("npu"))
    expected = torch_ref.w8a16_linear(x.float(), weight, scale.to(dtype), weight_offset, bias.float())
    assert ours.device.type == "npu" and ours.dtype == dtype and ours.shape == (rows, n)
    assert (ours.cpu().float() - expected).abs().max() < 0.02 * expected.abs().max()  # (x and the weights in dtype)
    assert fake_npu.calls == {"npu_weight_quant_batchmatmul": 1}


def test_w8a16_groups_the_npu_op_does_not_take_fail_at_load(fake_npu):
    """(compressed-tensors allows groups of any size; npu_weight_quant_batchmatmul takes multiples of 32 below K)"""
    from npu_llm_kernels import npu

    weight = torch.randint(-128, 128, (96, 128), dtype=torch.int8).to("npu")
    with pytest.raises(ValueError, match="W8A16 groups of 16 input features: npu_weight_quant_batchmatmul takes"):
        npu.pack_w8a16_weight(weight, torch.rand(96, 8).to("npu"), None)
    assert npu.pack_w8a16_weight(weight, torch.rand(96, 2).to("npu"), None)[1].shape == (2, 96)


def test_npu_quant_ops_reject_what_the_real_ops_reject(fake_npu):
    x = torch.randn(4, 64).bfloat16().to("npu")
    w = torch.randint(-128, 128, (64, 32), dtype=torch.int8).to("npu")
    q = torch.randint(-128, 128, (4, 64), dtype=torch.int8).to("npu")
    scale = torch.rand(32).to("npu")
    cases = [
        (lambda: fake_npu.npu_dynamic_quant(x.float(), dst_type=torch.int8), "input must be float16/bfloat16"),
        (lambda: fake_npu.npu_dynamic_quant(x[0], dst_type=torch.int8), "more than one dim"),
        (lambda: fake_npu.npu_quantize(x, torch.ones(64).to("npu"), None, torch.qint8, -1, False),
         "scales must be the input's dtype"),
        (lambda: fake_npu.npu_quantize(x, torch.ones(7).bfloat16().to("npu"), None, torch.qint8, -1, False),
         "size 1 or input.shape\\[axis\\] \\(64\\)"),
        (lambda: fake_npu.npu_quant_matmul(x, w, scale, output_dtype=torch.bfloat16), "x1 and x2 must be int8"),
        (lambda: fake_npu.npu_quant_matmul(q, w.t(), scale, output_dtype=torch.bfloat16), "x1 \\[M, K\\] and x2"),
        (lambda: fake_npu.npu_quant_matmul(q, w, scale, pertoken_scale=torch.rand(3).to("npu"),
                                           output_dtype=torch.bfloat16), "pertoken_scale must be fp32 \\[M=4\\]"),
        (lambda: fake_npu.npu_quant_matmul(q, w, scale.bfloat16(), pertoken_scale=torch.rand(4).to("npu"),
                                           output_dtype=torch.float16), "an fp16 output takes a torch.float32 scale"),
        (lambda: fake_npu.npu_quant_matmul(q, w, torch.rand(5).to("npu"), output_dtype=torch.bfloat16),
         "scale must be 1-D \\[1\\] or \\[N=32\\]"),
        (lambda: fake_npu.npu_quant_matmul(q, w, scale.cpu(), output_dtype=torch.bfloat16), "scale must be on the NPU"),
        (lambda: fake_npu.npu_quant_matmul(q, w, scale, bias=scale, output_dtype=torch.float16),
         "an fp16 output without pertoken_scale takes an int32 bias"),
        (lambda: fake_npu.npu_weight_quant_batchmatmul(x, w, scale), "antiquant_scale must be in x's dtype"),
        (lambda: fake_npu.npu_weight_quant_batchmatmul(x.float(), w, scale), "x must be fp16 or bf16"),
        (lambda: fake_npu.npu_weight_quant_batchmatmul(x, w.float(), scale.bfloat16()), "int8 weights"),
        (lambda: fake_npu.npu_weight_quant_batchmatmul(x, w, torch.rand(2, 32).bfloat16().to("npu"),
                                                       antiquant_group_size=16),
         "antiquant_group_size must be a multiple of 32"),
        (lambda: fake_npu.npu_weight_quant_batchmatmul(x, w, torch.rand(3, 32).bfloat16().to("npu"),
                                                       antiquant_group_size=32),
         "per group, antiquant_scale must be \\[ceil\\(K / group\\) = 2, N = 32\\]"),
        (lambda: fake_npu.npu_weight_quant_batchmatmul(x, w, scale.bfloat16(), scale.half()),
         "antiquant_offset must match antiquant_scale's dtype and shape"),
        (lambda: fake_npu.npu_weight_quant_batchmatmul(x, w, scale.bfloat16(), bias=scale.bfloat16()),
         "a torch.bfloat16 x takes a float32 bias"),
        (lambda: fake_npu.npu_weight_quant_batchmatmul(x, fake_npu.npu_format_cast(w, 29), scale.bfloat16()),
         "a FRACTAL_NZ weight runs only in graph mode"),
    ]
    for call, message in cases:
        with pytest.raises(fake_npu.NpuOpError, match=message):
            call()


@pytest.mark.parametrize("scheme, format, group, dtype", [
    ("w8a8_dynamic", "compressed-tensors", None, "bfloat16"), ("w8a8", "ascend", None, "bfloat16"),
    ("w8a16", "compressed-tensors", 32, "bfloat16"), ("w8a16", "ascend", None, "bfloat16"),
    ("w8a8", "ascend", None, "float16"),  # (an fp16 output of a static layer: the int64 scale graph mode needs)
])
def test_the_engine_serves_a_quantized_checkpoint_on_the_npu(fake_npu, monkeypatch, tmp_path, default_model_dir,
                                                             scheme, format, group, dtype):
    """Greedy on the NPU, decode steps in graph mode, against the CPU's portable path on the same checkpoint: each
    prompt's first token is among the CPU's five most likely (the two quantize activations with scales 127 / 127.5
    apart, or multiply by a static scale's reciprocal where the CPU divides by it)."""
    from backend import LLM, SamplingParams

    source = make_tiny_model("llama", tmp_path / "source", vocab_size=VOCAB)
    out = quantize_checkpoint(str(source), tmp_path / "w8a8", scheme, tokenizer=default_model_dir, format=format,
                              group_size=group)
    prompts = [{"prompt_token_ids": torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
               for n in (7, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    args = dict(model=str(out), tokenizer=str(default_model_dir), dtype=dtype, num_kv_blocks=8,
                quantization=None if format == "compressed-tensors" else format)
    with LLM(device="npu", enforce_eager=False, max_num_seqs=4, **args) as llm:
        on_npu = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert llm.engine.kv.num_free_blocks == 8 and llm.engine.runner.decode_graphs.num_replays > 0
    ops = {"w8a8_dynamic": ("npu_quant_matmul", "npu_dynamic_quant"), "w8a8": ("npu_quant_matmul", "npu_quantize"),
           "w8a16": ("npu_weight_quant_batchmatmul",)}[scheme]
    assert all(fake_npu.calls[op] > 0 for op in ops)
    monkeypatch.setenv("NPU_LLM_CPU_KERNELS", "0")
    with LLM(device="cpu", block_size=128, **args) as llm:
        on_cpu = [o.outputs[0] for o in llm.generate(prompts, params)]
    for npu_out, cpu_out in zip(on_npu, on_cpu):
        assert len(npu_out.token_ids) == 6 and npu_out.token_ids[0] in cpu_out.logprobs[0]
