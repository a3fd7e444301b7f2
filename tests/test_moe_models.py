"""The architectures after Llama: Qwen3 (per-head q/k norm), GLM-4 (interleaved partial rotary) and GLM-4-0414
(post-norms), and the mixtures of experts Qwen3-MoE, Mixtral and GLM-4.5 load from transformers' own checkpoints and equal transformers in fp32; both layouts of expert weights
load; a bad checkpoint fails the load naming what is wrong; the engine's chunked prefill, prefix caching,
preemption and structured outputs serve a MoE model as they serve a dense one; and the fused-experts op equals
its per-expert reference."""
from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from backend import LLM, SamplingParams
from backend.models.loader import ModelLoadError, load_model
from npu_llm_kernels import cpu, ops_for, torch_ref
from tests.conftest import hf_model, make_tiny_model, rewrite_checkpoint
from tests.test_model_parity import _check_against_hf

NEW_FAMILIES = ["qwen3", "glm", "glm4", "qwen3_moe", "mixtral", "glm4_moe"]
MOE_FAMILIES = ["qwen3_moe", "mixtral", "glm4_moe"]


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def family_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return make_tiny_model("glm4_moe", tmp_path_factory.mktemp("glm4_moe"))


def test_each_family_equals_transformers(family_dir):
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    _check_against_hf(family_dir, prompt, 16)


def _prompt_logits(model_dir) -> torch.Tensor:
    from tests.test_model_parity import _prompt_logits as logits

    model, _, _ = load_model(model_dir, ops_for("cpu"), dtype="float32")
    return logits(model, list(range(3, 40)), 16)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_stacked_expert_layout_loads_as_the_per_expert_one(arch, tmp_path):
    """transformers 5 holds a layer's experts as two stacked tensors (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]); a checkpoint written that way, and one sharded over several files, load the same weights."""
    per_expert = make_tiny_model(arch, tmp_path / "per-expert")
    stacked = tmp_path / "stacked"
    shutil.copytree(per_expert, stacked)
    state = {k: v.contiguous() for k, v in hf_model(per_expert).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # (transformers' own in-memory names)
    (stacked / "model.safetensors").unlink()
    save_file(state, stacked / "model.safetensors", metadata={"format": "pt"})
    sharded = tmp_path / "sharded"
    hf_model(per_expert).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    expected = _prompt_logits(per_expert)
    assert torch.equal(_prompt_logits(stacked), expected)
    assert torch.equal(_prompt_logits(sharded), expected)


def test_bad_moe_checkpoints_fail_the_load_naming_what_is_wrong(glm_dir, tmp_path):
    def load(bad, **kwargs):
        with pytest.raises(ModelLoadError) as failed:
            load_model(bad, ops_for("cpu"), dtype="float32", **kwargs)
        shutil.rmtree(bad)
        return str(failed.value)

    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert "model.layers.1.mlp.experts (expert 3 up)" in load(rewrite_checkpoint(glm_dir, tmp_path, lambda t: t.pop(key)))
    message = load(rewrite_checkpoint(glm_dir, tmp_path, lambda t: t.update({key: t[key][:-1]})))
    assert key in message and "shape (31, 64)" in message
    message = load(rewrite_checkpoint(glm_dir, tmp_path, change_config=lambda c: c.update(num_experts_per_tok=9)))
    assert "num_experts_per_tok=9" in message and "8 experts" in message
    message = load(rewrite_checkpoint(glm_dir, tmp_path, change_config=lambda c: c.update(n_group=3)))
    assert "n_group=3 must divide the 8 experts" in message
    from backend.distributed import TensorParallel

    six_experts = dict(n_routed_experts=6, n_group=2, topk_group=1)
    message = load(rewrite_checkpoint(glm_dir, tmp_path, change_config=lambda c: c.update(six_experts)),
                   tp=TensorParallel(0, 4), expert_parallel=True)
    assert "tensor_parallel_size=4 must divide the experts (expert parallel) (6)" in message


def test_a_multi_token_prediction_layer_in_the_checkpoint_is_skipped(glm_dir, tmp_path):
    """GLM-4.5's checkpoints carry layer num_hidden_layers (its MTP layer, for speculative decoding)."""
    extra = "model.layers.3.mlp.gate.weight"
    with_mtp = rewrite_checkpoint(glm_dir, tmp_path, lambda t: t.update({extra: t["model.layers.1.mlp.gate.weight"].clone()}),
                        lambda c: c.update(num_nextn_predict_layers=1))
    assert torch.equal(_prompt_logits(with_mtp), _prompt_logits(glm_dir))


def test_the_engine_serves_a_moe_model_through_chunks_cache_hits_preemption_and_grammars(tmp_path, default_model_dir):
    """Chunked prefill, a prefix-cache hit and preemption as for a dense model (served_through_chunks_hits_and_
    preemption); a grammar constrains its output (the default model's tokenizer, so the vocabulary is its)."""
    with served_through_chunks_hits_and_preemption("glm4_moe", tmp_path, default_model_dir) as llm:
        choice = llm.generate("Pick one", SamplingParams(max_tokens=8, structured_outputs={"choice": ["yes", "no"]}))
        assert choice[0].outputs[0].text in ("yes", "no")


@contextlib.contextmanager
def served_through_chunks_hits_and_preemption(arch: str, tmp_path, tokenizer_dir):
    """An engine on a tiny `arch` model (the tokenizer's vocabulary) whose greedy tokens equal transformers'
    generate, with prompts longer than a step's budget (chunked prefill), one prompt twice (a prefix-cache hit),
    and too few KV blocks for all at once (preemption), every block back in the pool after; yields it."""
    from transformers import AutoTokenizer

    model_dir = make_tiny_model(arch, tmp_path / arch, vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)))
    rng = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 500, (40,), generator=rng).tolist()
    prompts = [shared, shared + [7, 8], torch.randint(3, 500, (70,), generator=rng).tolist()]
    reference = hf_model(model_dir)
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24)[
        0, len(p):].tolist() for p in prompts]
    with LLM(model=str(model_dir), tokenizer=str(tokenizer_dir), dtype="float32", block_size=16,
             num_kv_blocks=12, max_num_batched_tokens=32, max_num_seqs=3) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        stats = llm.engine.stats()
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0
        assert llm.engine.kv.num_free_blocks == 12  # every block back in the pool
        yield llm


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 5, 300, 1000])
def test_fused_experts_equal_a_per_token_reference(tokens, dtype, tolerance):
    """The platform's fused_experts against the definition, one token and one expert at a time, at decode
    and prefill sizes, with an expert-parallel slice (experts 4-11 of 16 held here). On x86 the C++ kernel takes
    these calls (the sizes are whole stripes): its register tiles at a few tokens per expert; at 75 and 250, AMX's
    brgemm (bf16, in tasks of up to 128 rows) or oneDNN's matmul (fp32 from 192 tokens)."""
    torch.manual_seed(0)
    hidden, inter, experts, top_k = 128, 96, 16, 4
    x = torch.randn(tokens, hidden).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden) / 8).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / 8).to(dtype)
    weights, ids = torch_ref.select_experts(torch.randn(tokens, experts), top_k, renormalize=True)
    ops = ops_for("cpu")
    for first, count in ((0, experts), (4, 8)):
        packed = ops.pack_expert_weights(w13[first:first + count].contiguous(), w2[first:first + count].contiguous())
        ext = cpu.compiled()
        if ext is not None and ext.has_fused_experts():
            assert packed[0].stripes == ("pairs" if dtype == torch.bfloat16 and ext.expert_pairs() else "single")
        got = ops.fused_experts(x, *packed, weights, ids, first).float()
        expected = torch.zeros(tokens, hidden)
        for t in range(tokens):
            for j in range(top_k):
                e = int(ids[t, j])
                if first <= e < first + count:
                    h = w13[e].float() @ x[t].float()
                    a = torch.nn.functional.silu(h[:inter]) * h[inter:]
                    expected[t] += weights[t, j] * (w2[e].float() @ a)
        assert (got - expected).abs().max() <= tolerance * max(1.0, expected.abs().max()), (first, count)


def test_grouped_sigmoid_routing_picks_only_from_the_best_groups():
    """GLM-4.5 / DeepSeek V3 routing: with a correction bias, groups rank by their best two experts' biased
    scores; experts outside the topk_group best groups are never chosen; weights are the unbiased scores."""
    torch.manual_seed(0)
    logits, bias = torch.randn(50, 16), torch.randn(16)
    weights, ids = torch_ref.select_experts(logits, 3, renormalize=False, scoring_func="sigmoid",
                                            num_expert_group=4, topk_group=2, e_score_correction_bias=bias,
                                            routed_scaling_factor=2.0)
    biased = logits.sigmoid() + bias
    best_groups = biased.view(50, 4, 4).topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1]
    assert all(set((ids[t] // 4).tolist()) <= set(best_groups[t].tolist()) for t in range(50))
    assert torch.allclose(weights, 2.0 * logits.sigmoid().gather(1, ids.long()))


@pytest.mark.slow
def test_triton_counts_the_expert_pairs_each_rank_served(tmp_path, default_model_dir):
    """A Qwen3-MoE model served by a real tritonserver with two ranks and expert parallel: after a request,
    npu_llm:moe_expert_pairs_total has a line per rank, each rank served some pairs, and together they are every
    (token, expert) pair the request's forward passes routed (its prompt and all but its last token, top-k, in each
    sparse layer)."""
    import re
    import urllib.request

    from transformers import AutoConfig

    from backend.models.architectures import is_moe_layer
    from tests.conftest import generate_through_triton, served_by_triton

    model_dir = make_tiny_model("qwen3_moe", tmp_path / "qwen3_moe", vocab_size=49152)
    config = AutoConfig.from_pretrained(model_dir)
    sparse_layers = sum(is_moe_layer(config, i) for i in range(config.num_hidden_layers))
    engine_args = {"model": str(model_dir), "tokenizer": str(default_model_dir), "dtype": "float32",
                   "tensor_parallel_size": 2, "enable_expert_parallel": True, "num_kv_blocks": 64}
    with served_by_triton(engine_args, tmp_path / "tritonserver.log") as server:
        try:
            generate_through_triton(server, {"text_input": "Experts of a mixture, one request",
                                             "exclude_input_in_output": True,
                                             "parameters": {"temperature": 0, "max_tokens": 6, "ignore_eos": True}})
            server.settled()
            prompt, generated = server.metric("vllm:prompt_tokens_total"), server.metric("vllm:generation_tokens_total")
            text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
            served = {m[1]: float(m[2]) for m in re.finditer(
                r'^npu_llm:moe_expert_pairs_total\{.*rank="(\d+)".*\} (\S+)$', text, re.M)}
        except Exception:
            raise AssertionError(server.log()[-4000:])
    assert generated == 6 and prompt > 0
    assert set(served) == {"0", "1"} and min(served.values()) > 0, served
    assert sum(served.values()) == (prompt + generated - 1) * config.num_experts_per_tok * sparse_layers, served
