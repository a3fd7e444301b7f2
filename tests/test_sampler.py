"""Sampler semantics on hand-made logits (no model): filters, penalties, seeds, logprobs."""
from __future__ import annotations

import math

import torch

from backend.engine.request import Request, SamplingParams
from backend.engine.sampler import sample

VOCAB = 50


def _request(prompt=(1, 2, 3), output=(), **params):
    r = Request("r", list(prompt), SamplingParams(**params), max_tokens=100, eos_ids={0})
    r.token_ids.extend(output)
    return r


def _logits(rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def _draws(logits: torch.Tensor, n: int = 300, **params) -> set[int]:
    return {sample(logits.clone(), [_request(**params)]).token_ids[0] for _ in range(n)}


def test_greedy_is_argmax():
    logits = _logits(3)
    requests = [_request(temperature=0) for _ in range(3)]
    assert sample(logits.clone(), requests).token_ids == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_restrict_the_support():
    logits = _logits()
    order = logits[0].argsort(descending=True).tolist()
    assert _draws(logits, top_k=1) == {order[0]}
    assert _draws(logits, top_k=3) <= set(order[:3])
    probs = logits[0].softmax(-1)
    assert _draws(logits, top_p=1e-6) == {order[0]}
    # the smallest set of tokens whose mass reaches top_p
    mass = probs[order].cumsum(0)
    nucleus = set(order[: int((mass < 0.5).sum()) + 1])
    assert _draws(logits, top_p=0.5) <= nucleus
    keep = {t for t in range(VOCAB) if probs[t] >= 0.2 * probs.max()}
    assert _draws(logits, min_p=0.2) <= keep
    assert len(_draws(logits, temperature=1.0)) > 3  # unfiltered sampling does spread


def test_seeded_rows_ignore_the_rest_of_the_batch():
    logits = _logits(4)
    alone = sample(logits[1:2].clone(), [_request(seed=7)]).token_ids[0]
    batch = [_request(), _request(seed=7), _request(temperature=0), _request(seed=8)]
    for _ in range(3):
        batch[1] = _request(seed=7)
        assert sample(logits.clone(), batch).token_ids[1] == alone


def test_penalties():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.9
    # token 5 was generated twice: frequency + presence push it below token 6
    r = _request(output=(5, 5), temperature=0, frequency_penalty=0.1, presence_penalty=0.05)
    assert sample(logits.clone(), [r]).token_ids == [6]
    # repetition penalty also covers the prompt: positive logits are divided
    prompt_hit = torch.zeros(1, VOCAB)
    prompt_hit[0, 2] = 1.0
    prompt_hit[0, 9] = 0.8
    assert sample(prompt_hit.clone(), [_request(temperature=0, repetition_penalty=1.5)]).token_ids == [9]
    assert sample(prompt_hit.clone(), [_request(temperature=0)]).token_ids == [2]


def test_min_tokens_masks_eos():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # eos
    assert sample(logits.clone(), [_request(temperature=0, min_tokens=2)]).token_ids != [0]
    assert sample(logits.clone(), [_request(temperature=0)]).token_ids == [0]


def test_logprobs_are_of_the_sampled_distribution():
    logits = _logits()
    out = sample(logits.clone(), [_request(temperature=0.5, seed=1, logprobs=3)])
    entry = out.logprobs[0]
    expected = torch.log_softmax(logits[0] / 0.5, -1)
    top3 = expected.topk(3).indices.tolist()
    token = out.token_ids[0]
    assert set(top3) | {token} == set(entry)
    for tid, lp in entry.items():
        assert math.isclose(lp, expected[tid].item(), abs_tol=1e-5)
    assert math.isclose(out.sampled_logprobs[0], expected[token].item(), abs_tol=1e-5)
