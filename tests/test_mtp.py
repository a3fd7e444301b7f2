"""Speculative decoding with DeepSeek V3's multi-token-prediction layer (speculative_config, vLLM's deepseek_mtp).

Greedy: the tokens with MTP on are those with it off, through chunked prefill, a prefix-cache hit and preemption,
with drafts both accepted and rejected and every block back in the pool. Sampling: the joint distribution of three
sampled tokens equals the target model's own (computed exactly from transformers' logits) within a chi-square
test. The metrics count the drafts, and a checkpoint without the layer, or a drafter npu-llm does not have, is
refused by name."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from tests.conftest import add_mtp_layer, hf_model, make_tiny_model

MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 1}


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory):
    """TINY's 512-token vocabulary (the default model's tokenizer reads its ids): its logits are decisive enough
    for the drafts of add_mtp_layer to be accepted at times."""
    return add_mtp_layer(make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("mtp") / "v3"))


def test_greedy_tokens_with_mtp_are_those_without(v3_with_mtp, default_model_dir):
    rng = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 500, (40,), generator=rng).tolist()
    prompts = [shared, shared + [7, 8], torch.randint(3, 500, (70,), generator=rng).tolist()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    args = dict(model=str(v3_with_mtp), tokenizer=str(default_model_dir), dtype="float32", block_size=16,
                num_kv_blocks=12, max_num_batched_tokens=32, max_num_seqs=3)
    with LLM(**args) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    with LLM(**args, speculative_config=MTP) as drafting:
        outputs = drafting.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = drafting.engine.stats()
        assert drafting.engine.kv.num_free_blocks == 12
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0
    spec = stats.spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens == spec.num_drafts  # both outcomes happened
    assert spec.num_accepted_tokens_per_pos == [spec.num_accepted_tokens]
    assert stats.num_generation_tokens == 3 * 24  # (an accepted draft and the token after it: two in one step)


def test_sampled_tokens_keep_the_target_distribution(v3_with_mtp, default_model_dir):
    """3000 seeded requests sample three tokens each (top-3, temperature 0.8) with MTP drafting; the counts of the
    27 outcomes against the exact probabilities from transformers: the chi-square test's p-value is above 0.01
    (seeded, so the figure is the same each run; a sampler that kept drafts at 1.5 p(draft) gives p ~ 1e-29)."""
    prompt = [5, 17, 99, 4, 250, 31]
    top_k, temperature, n = 3, 0.8, 3000
    reference = hf_model(v3_with_mtp)

    def top(prefix):  # the target's next-token distribution after prefix, as the sampler filters it
        with torch.no_grad():
            logits = reference(torch.tensor([prefix])).logits[0, -1] / temperature
        values, ids = logits.topk(top_k)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist()))

    exact = {}
    for a, pa in top(prompt).items():
        for b, pb in top(prompt + [a]).items():
            for c, pc in top(prompt + [a, b]).items():
                exact[a, b, c] = pa * pb * pc

    with LLM(model=str(v3_with_mtp), tokenizer=str(default_model_dir), dtype="float32", max_num_seqs=256,
             speculative_config=MTP) as llm:
        params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True, seed=i)
                  for i in range(n)]
        outputs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
        spec = llm.engine.stats().spec_decode
    counts = {outcome: 0 for outcome in exact}
    sampled = [tuple(o.outputs[0].token_ids) for o in outputs]
    assert all(triple in exact for triple in sampled)  # every draw within the top-3 paths
    for triple in sampled:
        counts[triple] += 1
    outcomes = sorted(exact, key=exact.get)
    expected = [exact[o] * n for o in outcomes]
    observed = [counts[o] for o in outcomes]
    # the rarest outcomes pooled until each cell expects at least 5 (the test's validity condition)
    while expected[0] < 5:
        expected[1] += expected.pop(0)
        observed[1] += observed.pop(0)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    # chi-square with len - 1 degrees of freedom: P(X >= statistic) is the regularised upper incomplete gamma
    pvalue = torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2), torch.tensor(statistic / 2)).item()
    assert pvalue > 0.01, (pvalue, observed, expected)
    assert 0.1 * n < spec.num_accepted_tokens < spec.num_draft_tokens  # drafts kept and rejected, often


@pytest.mark.parametrize("spec,why", [
    ({"method": "eagle", "num_speculative_tokens": 1}, "method must be one of deepseek_mtp, mtp"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 3}, "num_speculative_tokens must be 1"),
    ({"method": "mtp", "model": "x"}, "must be a dict of method and num_speculative_tokens"),
])
def test_speculative_configs_npu_llm_cannot_honour_are_refused(spec, why):
    with pytest.raises(ValueError, match=why):
        EngineConfig(speculative_config=spec)


def test_a_checkpoint_without_an_mtp_layer_is_refused(tmp_path, default_model_dir):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(default_model_dir))
    model_dir = make_tiny_model("deepseek_v2", tmp_path / "v2", vocab_size=vocab)
    with pytest.raises(Exception, match="needs a checkpoint with a multi-token-prediction layer"):
        LLM(model=str(model_dir), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=8,
            speculative_config=MTP)


@pytest.mark.slow
def test_triton_reports_the_spec_decode_metrics(tmp_path, default_model_dir):
    """A real tritonserver with speculative_config in its engine arguments: after a request, vLLM's spec-decode
    counters are on /metrics, and they add up (the accepted tokens, over all positions, are among the drafted)."""
    import re
    import urllib.request

    from transformers import AutoTokenizer

    from tests.conftest import generate_through_triton, served_by_triton

    vocab = len(AutoTokenizer.from_pretrained(default_model_dir))  # (the request is text)
    model_dir = add_mtp_layer(make_tiny_model("deepseek_v3", tmp_path / "v3", vocab_size=vocab))
    engine_args = {"model": str(model_dir), "tokenizer": str(default_model_dir), "dtype": "float32",
                   "num_kv_blocks": 64, "speculative_config": MTP}
    with served_by_triton(engine_args, tmp_path / "tritonserver.log") as server:
        try:
            generate_through_triton(server, {"text_input": "Draft a token, verify it", "exclude_input_in_output": True,
                                             "parameters": {"temperature": 0, "max_tokens": 16, "ignore_eos": True}})
            server.settled()
            counts = {name: server.metric(f"vllm:spec_decode_{name}_total")
                      for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
            [per_position] = [float(m[1]) for m in re.finditer(
                r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{.*position="0".*\} (\S+)$', text, re.M)]
            generated = server.metric("vllm:generation_tokens_total")
        except Exception:
            raise AssertionError(server.log()[-4000:])
    assert generated == 16
    assert 0 < counts["num_drafts"] == counts["num_draft_tokens"] < 16, counts  # a draft a decode step at most
    assert counts["num_accepted_tokens"] == per_position <= counts["num_draft_tokens"], counts


def test_a_sampling_fault_after_a_verified_draft_fails_its_request_alone(tmp_path, default_model_dir, monkeypatch):
    """The token after a verified draft is sampled in a second round. A fault there, for one sequence of an n=2
    request, fails that request (both its sequences) and nothing else, and the step goes on."""
    from backend.engine import step_runner as step_runner_module

    model_dir = add_mtp_layer(make_tiny_model("deepseek_v3", tmp_path / "v3"), layer_scale=0.0)  # every draft holds
    real_sample = step_runner_module.sample

    def sample(logits, requests, drafts=None, ahead=None):
        # the second round: the verified draft is ahead of the request's tokens, and still its draft
        if ahead and any(r.request_id == "poison#0" and r.draft_token_ids and more == r.draft_token_ids
                         for r, more in zip(requests, ahead)):
            raise RuntimeError("injected sampler fault")
        return real_sample(logits, requests, drafts, ahead)

    args = dict(model=str(model_dir), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(**args) as plain:
        [expected] = plain.generate([{"prompt_token_ids": [5, 6, 7]}], params)
    with LLM(**args, speculative_config=MTP) as llm:
        monkeypatch.setattr(step_runner_module, "sample", sample)
        engine = llm.engine
        engine.add_request("good", {"prompt_token_ids": [5, 6, 7]}, params)
        # 16 tokens: none cached at admission (the last must run), so the two sequences run in step; the
        # verified draft completes their first block, which the prefix cache then registers
        engine.add_request("poison", {"prompt_token_ids": list(range(9, 25))},
                           SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
        outputs = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs[output.request_id] = output
        failures = engine.take_failures()
        assert list(failures) == ["poison"] and "injected sampler fault" in str(failures["poison"])
        assert outputs["good"].outputs[0].token_ids == expected.outputs[0].token_ids
        assert engine.stats().spec_decode.num_accepted_tokens > 0
        assert engine.kv.num_free_blocks == 32
