"""Speculative decoding with DeepSeek V3's multi-token-prediction layer (speculative_config, vLLM's deepseek_mtp),
where it differs from the other methods (tests/test_spec_decode.py has what they share): a checkpoint without the
layer is refused; a sampling fault after a verified draft fails its request alone."""
from __future__ import annotations

import pytest
from backend import LLM, SamplingParams
from tests.conftest import add_mtp_layer, make_tiny_model

MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 1}


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory):
    """TINY's 512-token vocabulary (the default model's tokenizer reads its ids): its logits are decisive enough
    for the drafts of add_mtp_layer to be accepted at times."""
    return add_mtp_layer(make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("mtp") / "v3"))


def test_a_checkpoint_without_an_mtp_layer_is_refused(tmp_path, default_model_dir):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(default_model_dir))
    model_dir = make_tiny_model("deepseek_v2", tmp_path / "v2", vocab_size=vocab)
    with pytest.raises(Exception, match="needs a checkpoint with a multi-token-prediction layer"):
        LLM(model=str(model_dir), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=8,
            speculative_config=MTP)


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
