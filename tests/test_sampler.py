"""Sampler semantics on hand-made logits (no model): filters, penalties, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from backend.engine.request import Request

from backend.engine.sampling_params import SamplingParams
from backend.engine.sampler import sample

VOCAB = 50


def _request(prompt=(1, 2, 3), output=(), **params):
    r = Request("r", list(prompt), SamplingParams(**params), max_tokens=100, eos_ids={0})
    r.token_ids.extend(output)
    return r


def _tokens(logits: torch.Tensor, requests) -> list[int]:
    return [s.token_id for s in sample(logits, requests)]


def _logits(rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def _draws(logits: torch.Tensor, n: int = 300, **params) -> set[int]:
    return {sample(logits, [_request(**params)])[0].token_id for _ in range(n)}


def test_greedy_is_argmax():
    logits = _logits(3)
    requests = [_request(temperature=0) for _ in range(3)]
    assert _tokens(logits.clone(), requests) == logits.argmax(-1).tolist()


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
    alone = _tokens(logits[1:2], [_request(seed=7)])[0]
    batch = [_request(), _request(seed=7), _request(temperature=0), _request(seed=8)]
    for _ in range(3):
        batch[1] = _request(seed=7)
        assert _tokens(logits.clone(), batch)[1] == alone


def test_penalties():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.9
    # token 5 was generated twice: frequency + presence push it below token 6
    r = _request(output=(5, 5), temperature=0, frequency_penalty=0.1, presence_penalty=0.05)
    assert _tokens(logits.clone(), [r]) == [6]
    # repetition penalty also covers the prompt: positive logits are divided
    prompt_hit = torch.zeros(1, VOCAB)
    prompt_hit[0, 2] = 1.0
    prompt_hit[0, 9] = 0.8
    assert _tokens(prompt_hit.clone(), [_request(temperature=0, repetition_penalty=1.5)]) == [9]
    assert _tokens(prompt_hit.clone(), [_request(temperature=0)]) == [2]


def test_min_tokens_masks_eos():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # eos
    assert _tokens(logits.clone(), [_request(temperature=0, min_tokens=2)]) != [0]
    assert _tokens(logits.clone(), [_request(temperature=0)]) == [0]


def test_logprobs_are_raw_whatever_the_processing():
    """vLLM v1's default: the model's log-softmax, before penalties, temperature and min_tokens masking."""
    logits = _logits()
    expected = torch.log_softmax(logits[0], -1)
    for params in (dict(temperature=0.5, seed=1), dict(temperature=0), dict(temperature=0, min_tokens=5),
                   dict(temperature=0.8, seed=2, repetition_penalty=1.7, presence_penalty=1.0)):
        [out] = sample(logits, [_request(output=(4, 4), logprobs=3, **params)])
        top3 = expected.topk(3).indices.tolist()
        assert set(top3) | {out.token_id} == set(out.logprobs), params
        assert next(iter(out.logprobs)) == out.token_id  # the sampled token first
        for tid, lp in out.logprobs.items():
            assert math.isclose(lp.logprob, expected[tid].item(), abs_tol=1e-5), params
            assert lp.rank == int((expected > expected[tid]).sum()) + 1, params  # true 1-based rank
        assert math.isclose(out.logprob, expected[out.token_id].item(), abs_tol=1e-5)
    [only] = sample(logits, [_request(temperature=1.0, seed=5, logprobs=0)])
    assert list(only.logprobs) == [only.token_id]  # logprobs=0: the sampled token alone


def test_tied_logits_rank_the_greedy_token_first():
    """vLLM's tie rule, which vllm_backend's tests hold: one token per position has rank 1, the one greedy picks (the
    lower id of equal logits), and the top alternatives list it first; ties at the k-th place take the lower ids."""
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, [31, 7]] = 4.0  # tied first
    logits[0, [40, 12, 25]] = 1.0  # tied third, with two places left for them when logprobs=4
    [greedy] = sample(logits, [_request(temperature=0, logprobs=4)])
    assert greedy.token_id == 7
    assert [(tid, lp.rank) for tid, lp in greedy.logprobs.items()] == [(7, 1), (31, 2), (12, 3), (25, 4)]
    assert greedy.logprobs[7].logprob == greedy.logprobs[31].logprob
    [alone] = sample(logits, [_request(temperature=0, logprobs=0)])
    assert alone.logprobs == {7: greedy.logprobs[7]}
    # a sampled token takes its place in the same order: 31 is rank 2 however it was drawn
    drawn = {s.token_id: s.logprobs for s in (sample(logits, [_request(temperature=1.0, top_k=2, logprobs=1)])[0]
                                              for _ in range(100))}
    assert set(drawn) == {7, 31} and [lp.rank for lp in drawn[31].values()] == [2, 1]


def test_sampling_leaves_the_logits_as_they_were():
    logits = _logits(2)
    before = logits.clone()
    sample(logits, [_request(temperature=0.7, seed=3, presence_penalty=1.0, output=(1,)), _request(min_tokens=3)])
    assert torch.equal(logits, before)


def test_top_k_above_the_vocabulary_is_off_and_above_int64_refused():
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="top_k"):
        SamplingParams(top_k=2**63, top_p=0.9)
    logits = _logits()
    for seed in range(20):  # the same seeded draw as with top_k off, and no overflow on the way
        huge = _tokens(logits, [_request(top_k=2**63 - 1, top_p=0.9, seed=seed)])
        assert huge == _tokens(logits, [_request(top_k=-1, top_p=0.9, seed=seed)])


def test_numbers_that_would_break_a_tensor_are_refused():
    import pydantic

    for bad in (dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")),
                dict(repetition_penalty=float("inf")), dict(seed=2**63), dict(stop_token_ids=[-1]),
                dict(stop_token_ids=[2**63]), dict(max_tokens=2**63), dict(n=0), dict(logprobs=21)):
        with pytest.raises(pydantic.ValidationError):
            SamplingParams(**bad)
    # a tiny temperature is greedy, not a division that overflows to NaN
    logits = _logits()
    assert _tokens(logits, [_request(temperature=1e-30)]) == [int(logits.argmax())]


def test_penalties_equal_the_hand_computed_logits():
    """vLLM's rules, written out: repetition penalty on prompt and output tokens (positive logits divided,
    negative ones multiplied), then frequency x count and presence on output tokens only."""
    from backend.engine.sampler import _apply_penalties

    logits = torch.tensor([[0.5, 2.0, -1.0, 3.0, -0.5, 1.5, 0.0, -2.0, 0.7, 1.0]])
    prompt, output = (1, 2, 3), (5, 5, 7, 2)
    rep, freq, pres = 1.3, 0.2, 0.5
    expected = logits[0].tolist()
    for t in range(len(expected)):
        if t in prompt + output:
            expected[t] = expected[t] / rep if expected[t] > 0 else expected[t] * rep
        count = output.count(t)
        expected[t] -= freq * count + pres * (count > 0)
    processed = logits.clone()
    _apply_penalties(processed, [_request(prompt, output, repetition_penalty=rep, frequency_penalty=freq,
                                          presence_penalty=pres)])
    assert processed[0].tolist() == pytest.approx(expected, abs=1e-6)


def _distribution(row: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """The distribution a sampler must draw from, in plain Python: softmax(logits / T) restricted to the top k,
    then to the smallest prefix whose mass reaches top_p, then to tokens at least min_p x the likeliest."""
    order = sorted(range(len(row)), key=lambda t: -row[t])[: top_k if top_k > 0 else len(row)]

    def softmax(tokens):
        top = max(row[t] / temperature for t in tokens)
        weights = {t: math.exp(row[t] / temperature - top) for t in tokens}
        total = sum(weights.values())
        return {t: w / total for t, w in weights.items()}

    probs, kept, mass = softmax(order), [], 0.0
    for t in order:
        kept.append(t)
        mass += probs[t]
        if mass >= top_p:
            break
    probs = softmax(kept)
    biggest = max(probs.values())
    probs = {t: p for t, p in probs.items() if p >= min_p * biggest}
    total = sum(probs.values())
    return {t: p / total for t, p in probs.items()}


@pytest.mark.parametrize("params", [
    dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=6, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=-1, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=10, top_p=0.9, min_p=0.1),
])
def test_draws_follow_softmax_after_filters(params):
    """Empirical frequencies of 20,000 draws against the distribution computed by hand: a chi-square test."""
    torch.manual_seed(1234)
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 1.5
    expected = _distribution(logits[0].tolist(), **params)
    batch, counts = 4000, torch.zeros(12)
    for _ in range(5):
        tokens = _tokens(logits.expand(batch, -1).clone(), [_request(**params) for _ in range(batch)])
        counts += torch.bincount(torch.tensor(tokens), minlength=12)
    draws = counts.sum().item()
    assert set(counts.nonzero().flatten().tolist()) <= set(expected)  # nothing outside the filtered support
    chi2 = sum((counts[t].item() - draws * p) ** 2 / (draws * p) for t, p in expected.items())
    assert chi2 < CHI2_999[len(expected) - 1], (chi2, expected)


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 0.5}, {"temperature": 0.001}])
def test_a_draft_the_target_equals_is_kept(filters):
    """Where the filters leave the target one-hot at the draft, the residual max(p - q, 0) is all zeros: the draft is
    kept, and the draw from that empty row (whose token is discarded) must not fail the batch."""
    logits = _logits(2)
    draft = int(logits[0].argmax())
    logits[0, draft] += 50
    requests = [_request(**{"temperature": 1.0, **filters}), _request(temperature=1.0)]
    tokens = [s.token_id for s in sample(logits, requests, [draft, None])]
    assert tokens[0] == draft and 0 <= tokens[1] < logits.shape[1]


def test_draws_over_a_vocabulary_of_many_blocks_follow_softmax():
    """The draw sums its running totals a block of tokens at a time (sampler.CDF_BLOCK): tokens at both ends of
    blocks, in the first and the last (cut short) block, and none between them, drawn at their probabilities."""
    from backend.engine.sampler import CDF_BLOCK

    torch.manual_seed(99)
    live = [0, CDF_BLOCK - 1, CDF_BLOCK, CDF_BLOCK + 44, 2 * CDF_BLOCK - 1, 3 * CDF_BLOCK, 4 * CDF_BLOCK + 3,
            4 * CDF_BLOCK + 4, 4 * CDF_BLOCK + 9, 4 * CDF_BLOCK + 10]
    vocab = 4 * CDF_BLOCK + 11
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, live] = torch.randn(len(live), generator=torch.Generator().manual_seed(5))
    expected = dict(zip(live, logits[0, live].softmax(-1).tolist()))
    batch, counts = 4000, torch.zeros(vocab)
    for _ in range(5):
        tokens = _tokens(logits.expand(batch, -1).clone(), [_request(temperature=1.0) for _ in range(batch)])
        counts += torch.bincount(torch.tensor(tokens), minlength=vocab)
    draws = counts.sum().item()
    assert set(counts.nonzero().flatten().tolist()) <= set(live)
    chi2 = sum((counts[t].item() - draws * p) ** 2 / (draws * p) for t, p in expected.items())
    assert chi2 < CHI2_999[len(expected) - 1], (chi2, expected)


# The chi-square distribution's 0.999 quantile for 1..11 degrees of freedom (a false alarm once in 1,000 runs).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26}


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.3}])
def test_a_draft_keeps_the_distribution(filters):
    """Speculative decoding: a row with a draft token samples it with its probability after every filter, and the
    other tokens with theirs (rejection sampling of a one-hot draft), here over 40000 rows with draft token 1.
    min_p leaves the filtered row unnormalised: kept against that, the draft came out ~10% too rarely."""
    n = 40000
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0, 0.5]]).repeat(n, 1)
    requests = [_request(temperature=1.0, **filters) for _ in range(n)]
    plain = torch.bincount(torch.tensor(_tokens(logits, requests)), minlength=5) / n
    drafted = torch.bincount(torch.tensor([s.token_id for s in sample(logits, requests, [1] * n)]), minlength=5) / n
    torch.testing.assert_close(drafted, plain, atol=0.012, rtol=0)
