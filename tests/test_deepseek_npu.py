"""DeepSeek's latent attention on the NPU, against the fake torch_npu: vllm-ascend v0.23.0's MLA ops with the
arguments it passes (npu_llm_kernels/npu_mla.py, docs/npu.md section 12), in eager and graph mode.

The models are tiny but of DeepSeek's attention shape, the only one the ops take: a 512 + 64 latent, 128-wide nope
queries and values. The engine on the NPU gives the CPU path's greedy tokens through fresh prefills, chunked
prefills over cached prefixes and decodes; with the rope pairs interleaved (V2) and in halves (V3 with
rope_interleave false, which the loader turns into pairs for the NPU's rotary ops); with a power-of-two number of
heads and without one (decode pads the heads, prefill takes q and k concatenated)."""
from __future__ import annotations

import gc

import pytest
import torch

from backend.models.loader import ModelLoadError, load_model
from npu_llm_kernels import ops_for
from tests.conftest import make_tiny_model

# (head_dim: the rotary's width, which transformers' configs derive from qk_rope_head_dim when they are made)
NPU_SHAPE = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64)
MODELS = {
    "v2, 4 heads": ("deepseek_v2", {}),
    "v3 in halves, 3 heads": ("deepseek_v3", dict(rope_interleave=False, num_attention_heads=3, num_key_value_heads=3)),
}
PROMPTS = [list(range(3, 140)), list(range(3, 140)) + [7, 8, 9], [11, 12, 13, 14, 15]]  # a 128-token block shared


def _sharpened(model_dir):
    """The model with its queries and rope keys scaled up: at the init's scale attention is near uniform over these
    short prompts, and a wrong rope layout hardly shows."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(path)
    for name in [n for n in weights if n.endswith(("q_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight"))]:
        weights[name] = weights[name] * 6
    save_file(weights, path, metadata={"format": "pt"})
    return model_dir


def _generated(llm, prompts) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt, run one by one (the second finds the first one's block cached): its greedy tokens, and their
    logprobs."""
    from backend import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outputs = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0] for p in prompts]
    return [(o.token_ids, torch.tensor([step[t].logprob for t, step in zip(o.token_ids, o.logprobs)]))
            for o in outputs]


def _scored(llm, tokens: list[int]) -> torch.Tensor:
    """The logprob of each token after the first, as the prompt's prefill scores it."""
    from backend import SamplingParams

    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return torch.tensor([step[t].logprob for t, step in zip(tokens[1:], out.prompt_logprobs[1:])])


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_deepseek_on_the_npu_equals_the_cpu_path(fake_npu, monkeypatch, tmp_path, default_model_dir, model):
    from backend import LLM

    arch, overrides = MODELS[model]
    model_dir = _sharpened(make_tiny_model(arch, tmp_path / arch, decisive_routing=False, **NPU_SHAPE, **overrides))
    # a 48-token budget chunks the long prompts: chunks after the first attend over their cached prefix
    args = dict(model=str(model_dir), tokenizer=str(default_model_dir), dtype="bfloat16", num_kv_blocks=8, max_num_batched_tokens=48,
                enable_prefix_caching=True, max_num_seqs=1)
    on_npu = LLM(device="npu", **args)
    npu_generated = _generated(on_npu, PROMPTS)
    assert on_npu.engine.stats().prefix_cache_hit_rate > 0
    for op in ("npu_kv_rmsnorm_rope_cache", "npu_interleave_rope", "npu_fused_infer_attention_score",
               "npu_fused_infer_attention_score_v2"):
        assert fake_npu.calls.get(op, 0) > 0, op
    assert "_npu_paged_attention" not in fake_npu.calls and "_npu_reshape_and_cache" not in fake_npu.calls
    latent_cache, rope_cache = on_npu.engine.runner.kv_caches[0]
    assert latent_cache.shape[1:] == (128, 1, 512) and rope_cache.shape[1:] == (128, 1, 64)

    # The CPU path scores the NPU's sequences: their generated tokens' logprobs agree (greedy tokens themselves
    # would part at the near-ties of a tiny random model, where bf16 rounds the two paths' arithmetic differently).
    monkeypatch.setenv("NPU_LLM_CPU_KERNELS", "0")  # the portable kernels: the same math, in the same dtype
    on_cpu = LLM(device="cpu", block_size=128, **args)
    for prompt, (tokens, npu_logprobs) in zip(PROMPTS, npu_generated):
        torch.testing.assert_close(npu_logprobs, _scored(on_cpu, prompt + tokens)[-len(tokens):], atol=0.03, rtol=0)


@pytest.mark.slow
def test_deepseek_decode_replays_in_npu_graphs(fake_npu, tmp_path, default_model_dir):
    """enforce_eager=False: the MLA decode op is captured in a task group from one workspace per batch size
    (_get_max_workspace, as vllm-ascend), re-issued with each step's lengths; tokens equal eager mode's."""
    from backend import LLM, SamplingParams

    model_dir = make_tiny_model("deepseek_v2", tmp_path / "v2", **NPU_SHAPE)
    args = dict(model=str(model_dir), tokenizer=str(default_model_dir), device="npu", dtype="bfloat16", num_kv_blocks=8,
                max_num_seqs=2, max_model_len=256)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], list(range(20, 60)))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    graphed = LLM(enforce_eager=False, **args)
    graphs = graphed.engine.runner.decode_graphs
    assert fake_npu.calls["_npu_fused_infer_attention_score_v2_get_max_workspace"] == len(graphs.batch_sizes)
    captured, replays = fake_npu.calls["npu_fused_infer_attention_score_v2.out"], graphs.num_replays
    graphed_tokens = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert graphs.num_replays - replays == 11  # one prefill step, then every decode step a replay
    assert fake_npu.calls["npu_fused_infer_attention_score_v2.out"] > captured  # the replays' updates

    eager = LLM(**args)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params)] == graphed_tokens


def test_shapes_the_npu_ops_do_not_take_are_refused_at_load(fake_npu, tmp_path):
    with pytest.raises(ModelLoadError, match="the NPU's MLA ops take a 512 \\+ 64 latent.*kv_lora_rank 32"):
        load_model(make_tiny_model("deepseek_v2", tmp_path / "v2"), ops_for("npu"), device="npu", dtype="bfloat16")


@pytest.mark.parametrize("heads", [4, 3])
def test_prefill_after_a_cached_prefix_merges_context_chunks(fake_npu, monkeypatch, heads):
    """VA's _compute_prefill_context: the new tokens over themselves, the prefix in chunks (a budget of 256 context
    tokens a call here: chunks of 128 for two sequences with a prefix), merged by npu_attention_update; the result is
    causal attention over the whole context, as one call computes it (in fp32 here)."""
    from npu_llm_kernels import npu_mla

    monkeypatch.setattr(npu_mla, "CONTEXT_BUDGET", 256)
    torch.manual_seed(0)
    query_lens, kv_lens = [5, 7, 3], [300, 7, 130]  # prefixes of 295, 0 and 127 tokens: 3 context chunks
    tokens, keys = sum(query_lens), sum(kv_lens)
    q_nope, q_pe = torch.randn(tokens, heads, 128), torch.randn(tokens, heads, 64)
    k_nope, k_pe, v = torch.randn(keys, heads, 128), torch.randn(keys, 1, 64), torch.randn(keys, heads, 128)
    scale = 192 ** -0.5
    mla = npu_mla.NpuMLA(None, heads, 512, 64, scale)
    out = mla.prefill(*(t.bfloat16().to("npu") for t in (q_nope, q_pe, k_nope, k_pe, v)), query_lens, kv_lens)
    assert fake_npu.calls["npu_fused_infer_attention_score"] == 4 and fake_npu.calls["npu_attention_update"] == 1
    expected, q_start, k_start = [], 0, 0
    for q_len, kv_len in zip(query_lens, kv_lens):
        q = torch.cat((q_nope, q_pe), -1)[q_start:q_start + q_len].bfloat16().float()
        k = torch.cat((k_nope, k_pe.expand(-1, heads, -1)), -1)[k_start:k_start + kv_len].bfloat16().float()
        scores = torch.einsum("qnd,knd->nqk", q, k) * scale
        future = torch.arange(kv_len)[None, :] > torch.arange(q_len)[:, None] + (kv_len - q_len)
        weights = scores.masked_fill(future, float("-inf")).softmax(-1)
        expected.append(torch.einsum("nqk,knd->qnd", weights, v[k_start:k_start + kv_len].bfloat16().float()))
        q_start, k_start = q_start + q_len, k_start + kv_len
    torch.testing.assert_close(out.cpu().float(), torch.cat(expected), atol=2e-2, rtol=2e-2)


def test_the_context_chunks_stay_within_the_merge_ops_16_parts(fake_npu):
    from npu_llm_kernels.npu_mla import context_chunk

    assert context_chunk([300, 0, 127]) == 64 * 1024  # (VA's budget shared by the two with a prefix)
    assert context_chunk([2_000_000]) == 133_376  # 15 chunks of whole blocks: 16 parts with the new tokens'
    assert context_chunk([10] * 4096) == 128


@pytest.fixture
def torch_npu_2_5_1(monkeypatch, request):
    """The fake playing torch_npu 2.5.1.post1 (op-plugin 7.1.0): no npu_fused_infer_attention_score_v2 and no
    workspace APIs."""
    monkeypatch.setenv("FAKE_TORCH_NPU_VERSION", "2.5.1.post1")
    return request.getfixturevalue("fake_npu")


def test_a_torch_npu_without_the_mla_ops_is_refused_before_any_weight(torch_npu_2_5_1, tmp_path):
    assert torch_npu_2_5_1.__version__ == "2.5.1.post1"
    assert not hasattr(torch_npu_2_5_1, "npu_fused_infer_attention_score_v2")
    gc.collect()  # (the tensors earlier tests left to the collector go now, not during the load)
    allocated = torch.npu.memory_allocated()
    with pytest.raises(ModelLoadError, match="torch_npu 2.5.1.post1 lacks .*npu_fused_infer_attention_score_v2.*, "
                                             "which latent attention \\(MLA\\) call on the NPU: install torch_npu "
                                             "2.6.0.post3, 2.7.1 or 2.8.0 \\(CANN 8.3.RC1\\) or later"):
        load_model(make_tiny_model("deepseek_v2", tmp_path / "v2", **NPU_SHAPE), ops_for("npu"), device="npu",
                   dtype="bfloat16")
    assert torch.npu.memory_allocated() <= allocated
    # a dense model's ops are all in that release
    model, _, _ = load_model(make_tiny_model("llama", tmp_path / "llama"), ops_for("npu"), device="npu",
                             dtype="bfloat16")
    assert next(model.parameters()).device.type == "npu"


def test_mla_ops_reject_what_the_real_ops_reject(fake_npu):
    npu = torch.device("npu")
    bf16 = dict(dtype=torch.bfloat16, device=npu)
    kv, gamma = torch.randn(2, 1, 1, 576, **bf16), torch.ones(512, **bf16)
    cos, sin = torch.ones(2, 1, 1, 64, **bf16), torch.zeros(2, 1, 1, 64, **bf16)
    rope_cache, latent_cache = torch.zeros(4, 128, 1, 64, **bf16), torch.zeros(4, 128, 1, 512, **bf16)
    slots = torch.tensor([0, 1], device=npu)

    def cache_write(**changed):
        call = dict(kv=kv, gamma=gamma, cos=cos, sin=sin, index=slots, k_cache=rope_cache, ckv_cache=latent_cache,
                    cache_mode="PA")
        call.update(changed)
        return fake_npu.npu_kv_rmsnorm_rope_cache(*[call.pop(k) for k in list(call)[:7]], **call)

    cache_write()  # as npu_mla.py calls it
    for changed, why in [(dict(index=slots.int()), "index must be int64"),
                         (dict(kv=torch.randn(2, 1, 1, 320, **bf16)), "576"),
                         (dict(kv=kv.float()), "float16/bfloat16"),
                         (dict(cache_mode="PA_NZ"), "not part of the fake")]:
        with pytest.raises(fake_npu.NpuOpError, match=why):
            cache_write(**changed)

    with pytest.raises(fake_npu.NpuOpError, match="D must be 64"):
        fake_npu.npu_interleave_rope(torch.randn(2, 4, 1, 32, **bf16), cos[..., :32], sin[..., :32])

    query, query_rope = torch.randn(2, 4, 1, 512, **bf16), torch.randn(2, 4, 1, 64, **bf16)
    key, key_rope = latent_cache.view(-1, 1, 128, 512), rope_cache.view(-1, 1, 128, 64)
    decode = dict(query_rope=query_rope, key_rope=key_rope, num_query_heads=4, num_key_value_heads=1,
                  input_layout="BNSD_NBSD", softmax_scale=0.1, block_table=torch.zeros(2, 1, dtype=torch.int32,
                                                                                          device=npu),
                  block_size=128, actual_seq_kvlen=[3, 5])
    out, _ = fake_npu.npu_fused_infer_attention_score_v2(query, key, key, **decode)
    assert out.shape == (4, 2, 1, 512)  # NBSD
    for changed, why in [(dict(num_query_heads=3), "1, 2, 4, ..., 128"),
                         (dict(actual_seq_kvlen=torch.tensor([3, 5])), "host list"),
                         (dict(actual_seq_kvlen=[3, 500]), "within the block table"),
                         (dict(input_layout="TND_NTD"), "not part of the fake")]:
        with pytest.raises(fake_npu.NpuOpError, match=why):
            fake_npu.npu_fused_infer_attention_score_v2(query, key, key, **{**decode, **changed})
    with pytest.raises(fake_npu.NpuOpError, match="a value other than the latent key"):
        fake_npu.npu_fused_infer_attention_score_v2(query, key, key.clone(), **decode)

    q, k = torch.randn(6, 4, 128, **bf16), torch.randn(6, 4, 128, **bf16)
    mask = torch.ones(2048, 2048, dtype=torch.int8, device=npu).triu(1)
    prefill = dict(query_rope=torch.randn(6, 4, 64, **bf16), key_rope=torch.randn(6, 4, 64, **bf16), num_heads=4,
                   num_key_value_heads=4, input_layout="TND", sparse_mode=3, atten_mask=mask, scale=0.1,
                   actual_seq_lengths=[2, 6], actual_seq_lengths_kv=[2, 6])
    fake_npu.npu_fused_infer_attention_score(q, k, k, **prefill)
    for changed, why in [(dict(actual_seq_lengths=[2, 4]), "cumulative, ending at the 6 tokens"),
                         (dict(atten_mask=mask.tril()), "1 above the diagonal"),
                         (dict(sparse_mode=2), "not part of the fake")]:
        with pytest.raises(fake_npu.NpuOpError, match=why):
            fake_npu.npu_fused_infer_attention_score(q, k, k, **{**prefill, **changed})
    with pytest.raises(fake_npu.NpuOpError, match="bfloat16 only"):
        fake_npu.npu_fused_infer_attention_score(q.half(), k.half(), k.half(), **prefill)


def test_the_rotary_op_rotates_deepseeks_interleaved_pairs(fake_npu):
    """npu_interleave_rope on rows in DeepSeek's layout equals transformers' DeepSeek V2 rotary (complex pairs), its
    output in halves: x0, x2, ... | x1, x3, ... (q and k alike, so q . k is DeepSeek's)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    torch.manual_seed(0)
    x = torch.randn(3, 2, 64)  # [tokens, heads, rope]
    angles = torch.rand(3, 32) * 6
    table = {name: torch.cat((f, f), -1).view(3, 1, 1, 64).bfloat16().to("npu")
             for name, f in (("cos", angles.cos()), ("sin", angles.sin()))}
    ours = fake_npu.npu_interleave_rope(x.view(3, 2, 1, 64).bfloat16().to("npu"), table["cos"], table["sin"])
    rows = x.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, rope]
    theirs, _ = apply_rotary_emb(rows, rows, torch.polar(torch.ones_like(angles), angles).unsqueeze(0))
    theirs = theirs[0].transpose(0, 1)
    halves = torch.cat((theirs[..., 0::2], theirs[..., 1::2]), dim=-1)
    torch.testing.assert_close(ours.view(3, 2, 64).cpu().float(), halves, atol=3e-2, rtol=3e-2)
