"""Continuous batching gives every request exactly what Hugging Face generate gives it alone."""
from __future__ import annotations

import pytest
import torch

from backend import LLMEngine, SamplingParams
from tests.conftest import hf_model

MAX_TOKENS = 20


def _prompts(tokenizer) -> list[list[int]]:
    shared = tokenizer.encode(
        "You are a careful assistant. Answer in one short sentence, and never use more words than needed. "
        "Here is the question of the day, asked by a curious student:"
    )
    questions = [
        "Why is the sky blue?", "What is a prime number?", "Name a large ocean.", "How do bees make honey?",
        "What is the boiling point of water?", "Who wrote Hamlet?", "What do plants need to grow?",
        "Why do we sleep?",
    ]
    others = [
        "Once upon a time", "The three primary colours are", "def fibonacci(n):", "Paris is the capital of",
        "A haiku about autumn:", "List three fruits:", "In 1969, humans", "The quick brown fox",
    ]
    return [shared + tokenizer.encode(" " + q) for q in questions] + [tokenizer.encode(o) for o in others]


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """Greedy continuations from transformers, one prompt at a time."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = hf_model(default_model_dir)
    prompts = _prompts(tokenizer)
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        tokens = out[0, len(p):].tolist()
        if tokenizer.eos_token_id in tokens:  # we stop at EOS and keep it, as generate does
            tokens = tokens[: tokens.index(tokenizer.eos_token_id) + 1]
        expected.append(tokens)
    return prompts, expected


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_batched_greedy_equals_hf_generate(reference, prefix_caching):
    prompts, expected = reference
    # 14 blocks of 16 tokens cannot hold 16 sequences of ~45 tokens: preemption. A 24-token budget chunks long prompts.
    engine = LLMEngine(dtype="float32", num_kv_blocks=14, block_size=16, max_num_batched_tokens=24,
                       enable_prefix_caching=prefix_caching, max_num_seqs=16)
    assert max(map(len, prompts)) > 24
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        for _ in range(2):  # requests arrive while others are running
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), {"prompt_token_ids": p}, params)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    for i, tokens in enumerate(expected):
        assert results[str(i)] == tokens, f"prompt {i}"
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0
    if prefix_caching:
        assert stats.prefix_cache_hit_rate > 0


@pytest.mark.slow
def test_without_chunked_prefill_each_prompt_runs_whole_and_equals_hf_generate(reference):
    """enable_chunked_prefill=False: a prompt enters only when its whole prefill fits the step's budget."""
    prompts, expected = reference
    limit = max(map(len, prompts)) + MAX_TOKENS  # the budget must hold the longest prompt whole
    engine = LLMEngine(dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=limit,
                       max_num_batched_tokens=limit, enable_chunked_prefill=False, max_num_seqs=4)
    assert sum(sorted(map(len, prompts))[-2:]) > limit  # two long prompts never share a step: chunking would split one
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)  # none partial
    assert [results[str(i)] for i in range(len(prompts))] == expected
