"""The CUDA path (run by tests/gpu_check.sh on a GPU machine; skipped elsewhere)."""
from __future__ import annotations

import pytest
import torch

from tests.test_kernels import _run_batch

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("block_size", [16, 128])
def test_cuda_attention_matches_dense(block_size):
    from npu_llm_kernels import cuda

    class OnGpu:
        """Runs the CUDA op on GPU copies of the CPU batch, returning to the CPU for comparison."""

        @staticmethod
        def paged_attention(q, k, v, kc, vc, md, scale):
            from npu_llm_kernels import AttentionMetadata

            dev = torch.device("cuda")
            gpu_md = AttentionMetadata(md.query_lens, md.context_lens, md.num_decodes, md.block_size,
                                       md.slot_mapping.to(dev), md.block_tables.to(dev), md.context_lens_tensor.to(dev))
            return cuda.paged_attention(q.to(dev), k.to(dev), v.to(dev), kc.to(dev), vc.to(dev), gpu_md, scale).cpu()

    seqs = [(5, 1), (130, 1), (300, 1), (40, 40), (200, 72), (129, 128)]
    ours, reference = _run_batch(seqs, block_size, OnGpu)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_engine_on_cuda_matches_cpu_greedy():
    from backend import LLM, SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=24)
    gpu = LLM(device="cuda", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16)
    cpu = LLM(device="cpu", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16)
    for a, b in zip(gpu.generate(prompts, params), cpu.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.slow
def test_cuda_graphs_match_eager():
    from backend import LLM, SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=24)
    args = dict(device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8, max_model_len=1024)
    graphed = LLM(enforce_eager=False, **args)
    graphed_outputs = graphed.generate(prompts, params)
    assert graphed.engine.runner.decode_graphs.num_replays >= params.max_tokens - 1
    for a, b in zip(graphed_outputs, LLM(**args).generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_verify_passes_on_the_gpu():
    from backend.config import EngineConfig
    from backend.entrypoints.verify import verify

    _, figures = verify(EngineConfig(device="cuda", dtype="bfloat16"), steps=16)
    assert all(f.passed for f in figures), [(f.name, f.value) for f in figures if not f.passed]


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_the_kv_cache_gets_what_is_left_and_no_more(enforce_eager):
    from backend import LLM

    torch.cuda.empty_cache()
    engine = LLM(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, max_num_seqs=16,
                 enforce_eager=enforce_eager).engine
    split = engine.memory_split
    assert split.weights > 0 and split.activations > 0 and (split.graphs > 0) == (not enforce_eager)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # at rest, plus the largest step's temporaries: the budget, give or take what CUDA allocates lazily
    in_use = total - free + split.activations
    assert split.budget - 2**29 <= in_use <= split.budget + 2**27, (in_use, split)
