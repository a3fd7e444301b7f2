"""Token sampling for a batch, vectorised: grammars, penalties, temperature, top-k, top-p, min-p, seeds, logprobs.

Each seeded request draws its randomness from its own generator, so its samples do not
depend on what else is in the batch (with speculative decoding they may: whether a draft is verified in a step
depends on the step's budget and blocks). A categorical draw inverts the row's cumulative distribution at one
uniform: one random number per row, where vLLM's exponential race (argmax of p / Exp(1)) needs one per token, which
eager torch draws on the CPU at about 20 ns each (70 ms a step for 64 rows of a 49k vocabulary).
Logprobs are raw: the model's log-softmax before penalties, temperature and filtering
(vLLM v1's default logprobs_mode, "raw_logprobs"), over the tokens a request's grammar allows.

One order ranks tokens, the one greedy sampling picks from: by logit, and among equal logits the lower token id
first (the first maximum, which is what argmax returns). A token's rank is its place in that order, so greedy's
token is always rank 1 and appears first among the top alternatives, even where bf16 logits tie (they often do
on CPUs that compute bf16 natively).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.engine.outputs import Logprob

from backend.engine.request import Request
from backend.engine.structured_outputs import apply_grammars


@dataclass
class SampledToken:
    token_id: int
    # when asked for: the sampled token first, then the top `logprobs` alternatives (decoded_token still None)
    logprobs: dict[int, Logprob] | None = None
    logprob: float = 0.0  # the sampled token's (0.0 when logprobs were not asked for)


def sample(logits: torch.Tensor, requests: list[Request], drafts: list[int | None] | None = None,
           ahead: list[list[int]] | None = None, draft_probs: torch.Tensor | None = None) -> list[SampledToken]:
    """logits [B, V] fp32, one row per request (left as they are). One SampledToken per request.

    drafts (speculative decoding): a row's draft token, kept by rejection sampling (vLLM's rejection sampler): with
    probability min(1, p(draft) / q(draft)), where q is the distribution the draft was drawn from (draft_probs
    [B, V], its rows for the drafted rows); where it is rejected the sample comes from the normalised residual
    max(p - q, 0). Without draft_probs a draft counts as one-hot (vLLM's rule for drafts with no probabilities:
    n-gram, and the argmax drafts of draft models and MTP layers): kept with probability p(draft), else sampled
    from p without it. The sample's distribution is p either way, and the draft is verified where the sample
    equals it (greedy: the argmax).

    ahead: tokens a row's request does not hold yet but its logits come after (a verified draft): penalties and
    min_tokens count them as the request's own output."""
    device = logits.device
    params = [r.params for r in requests]
    ahead = ahead or [[]] * len(requests)
    wants_logprobs = any(p.logprobs is not None for p in params)
    penalties = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params)
    # The caller may sample these rows again, one by one, if this batch fails: grammars, min_tokens and penalties
    # change a copy. Without them (a plain batch) nothing below writes to the rows, and no copy is made.
    copy_first = penalties or any(r.grammar is not None or r.params.min_tokens for r in requests)
    if copy_first:
        logits = logits.clone()
    apply_grammars(logits, [r.grammar for r in requests])  # (nothing to do when no row has a grammar)
    # what logprobs report: before any processing
    raw_logits = (logits.clone() if copy_first else logits) if wants_logprobs else None
    _apply_min_tokens(logits, requests, ahead)
    if penalties:
        _apply_penalties(logits, requests, ahead)

    if not all(p.greedy or p.temperature == 1 for p in params):
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
        logits = logits / temperature[:, None]

    greedy = [p.greedy for p in params]
    # max's indices are argmax's (the first of equal maxima), and on CPU it is 2.5x faster over a vocabulary
    tokens = logits.max(dim=-1).indices if any(greedy) else None
    if not all(greedy):
        probs = _filtered_probs(logits, params)
        drafted = [row for row, d in enumerate(drafts or ()) if d is not None and not params[row].greedy]
        kept = _keep_drafts(probs, requests, drafts, drafted, draft_probs) if drafted else None
        drawn = _inverse_cdf(probs, requests)
        tokens = drawn if tokens is None else torch.where(torch.tensor(greedy, device=device), tokens, drawn)
        if kept is not None:
            rows, draft_ids = torch.tensor(drafted, device=device), torch.tensor([drafts[r] for r in drafted], device=device)
            tokens[rows] = torch.where(kept, draft_ids, tokens[rows])

    sampled = [SampledToken(token) for token in tokens.tolist()]
    if raw_logits is not None:
        entries = ranked_logprobs(raw_logits, tokens, [p.logprobs or 0 for p in params])
        for row, p in enumerate(params):
            if p.logprobs is not None:
                token = sampled[row]
                token.logprobs, token.logprob = entries[row], entries[row][token.token_id].logprob
    return sampled


def ranked_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[dict[int, Logprob]]:
    """vLLM's logprobs for each row of fp32 logits [n, vocab]: tokens[row] first, then the tops[row] most likely
    tokens, each with its log-softmax and its rank in the module's order (decoded_token still None)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    chosen_ranks = _ranks(logits, tokens).tolist()
    k = min(max(tops, default=0), logits.shape[1])
    top_ids = _top_ids(logits, k) if k else tokens.new_empty(len(tokens), 0)
    top_values = logprobs.gather(1, top_ids).tolist()
    entries = []
    for row, (token, top, ids) in enumerate(zip(tokens.tolist(), tops, top_ids.tolist())):
        entry = {token: Logprob(chosen[row], chosen_ranks[row])}
        for rank, (tid, lp) in enumerate(zip(ids[:top], top_values[row][:top]), start=1):
            entry.setdefault(tid, Logprob(lp, rank))
        entries.append(entry)
    return entries


def _ranks(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's token's rank: 1 + the tokens with a greater logit + those with an equal one and a lower id.
    (The comparisons are written as floats: summing a bool tensor is ten times slower on CPU.)"""
    values = logits.gather(1, tokens[:, None])
    counted = torch.empty_like(logits)
    ranks = 1 + torch.gt(logits, values, out=counted).sum(dim=-1)
    tied = (torch.ge(logits, values, out=counted).sum(dim=-1) + 1 - ranks).nonzero()[:, 0]  # another token ties: few
    for row in tied.tolist():
        ranks[row] += (logits[row, : tokens[row]] == values[row]).sum()
    return ranks.long()


def _top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's first k token ids in the module's order, [n, k]. topk alone breaks ties as it likes: within its
    k, equal logits are put lower id first; where the k-th logit ties a token topk left out (rare), the row is taken
    again from all the tokens at that logit, lowest ids first."""
    vocab = logits.shape[1]
    values, ids = logits.topk(min(k + 1, vocab), dim=-1)  # (one more: does a token left out tie the k-th?)
    cut = (values[:, k] == values[:, k - 1]).nonzero()[:, 0].tolist() if k < vocab else []
    values, ids = values[:, :k], ids[:, :k]
    ids, by_id = ids.sort(dim=-1)
    ids = ids.gather(1, values.gather(1, by_id).sort(dim=-1, descending=True, stable=True).indices)
    for row in cut:
        kth = values[row, -1]
        above = ids[row][logits[row, ids[row]] > kth]
        ids[row] = torch.cat([above, (logits[row] == kth).nonzero()[:, 0][: k - len(above)]])
    return ids


def _apply_min_tokens(logits: torch.Tensor, requests: list[Request], ahead: list[list[int]]) -> None:
    for row, r in enumerate(requests):
        if r.num_output_tokens + len(ahead[row]) < r.params.min_tokens and r.stop_token_ids:
            stops = list(r.stop_token_ids)
            kept = logits[row, stops].clone()
            logits[row, stops] = float("-inf")
            if r.grammar is not None and not bool(logits[row].isfinite().any()):
                logits[row, stops] = kept  # the grammar can only end here: it wins over min_tokens


def _apply_penalties(logits: torch.Tensor, requests: list[Request], ahead: list[list[int]] | None = None) -> None:
    """OpenAI presence/frequency penalties on output tokens; repetition penalty on prompt + output (as vLLM)."""
    batch, vocab = logits.shape
    device = logits.device
    ahead = ahead or [[]] * batch
    outputs = _padded([r.output_token_ids + more for r, more in zip(requests, ahead)], vocab, device)
    everything = _padded([r.token_ids + more for r, more in zip(requests, ahead)], vocab, device)
    counts = torch.zeros(batch, vocab + 1, device=device).scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float))[:, :vocab]
    seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device).scatter_(1, everything, True)[:, :vocab]

    rep = torch.tensor([r.params.repetition_penalty for r in requests], device=device)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    freq = torch.tensor([r.params.frequency_penalty for r in requests], device=device)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in requests], device=device)[:, None]
    logits.sub_(freq * counts + pres * (counts > 0))


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Softmax after top-k, top-p and min-p filtering (each only where some request asks for it)."""
    device = logits.device
    top_k = [min(p.top_k, logits.shape[1]) if p.top_k > 0 else logits.shape[1] for p in params]
    top_p = [p.top_p for p in params]
    if any(k < logits.shape[1] for k in top_k) or any(p < 1 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=device)[None, :]
        drop = ranks >= torch.tensor(top_k, device=device)[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= torch.tensor(top_p, device=device)[:, None]
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _keep_drafts(probs: torch.Tensor, requests: list[Request], drafts: list[int | None], rows: list[int],
                 draft_probs: torch.Tensor | None) -> torch.Tensor:
    """Whether each drafted row keeps its draft (a uniform below p(draft) / q(draft)); the rows of probs become the
    residual max(p - q, 0) in place, so that the draw after samples the rejected ones from it."""
    device = probs.device
    uniforms = torch.rand(len(rows), device=device)
    for i, row in enumerate(rows):
        if requests[row].generator is not None:
            uniforms[i] = torch.rand(1, generator=requests[row].generator).item()
    index = torch.tensor(rows, device=device)
    draft_ids = torch.tensor([drafts[row] for row in rows], device=device)
    p = probs[index] / probs[index].sum(dim=-1, keepdim=True)  # (min-p filtering leaves the rows unnormalised)
    if draft_probs is None:  # one-hot at the draft
        q = torch.zeros_like(p).scatter_(1, draft_ids[:, None], 1.0)
    else:
        q = draft_probs[index].to(p.dtype)
        q = q / q.sum(dim=-1, keepdim=True)
    at = torch.arange(len(rows), device=device)
    kept = uniforms * q[at, draft_ids] < p[at, draft_ids]  # u < p/q, written without dividing by q
    probs[index] = (p - q).clamp_(min=0.0)
    return kept


# _inverse_cdf's running totals go a block of this many tokens at a time: over the row's blocks first, then over the
# tokens of the one block the uniform falls in.
CDF_BLOCK = 256


def _inverse_cdf(probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """One draw per row of probs [B, V] (unnormalised: min-p and a rejected draft leave rows so): the first token
    whose running total exceeds a uniform fraction of the row's mass. The running totals are fp64, over each block's
    fp32 sum and then within the block drawn, so that a token's share of the interval is its probability to fp32's
    precision of its block's mass (as the probabilities themselves are), wherever it lies in the vocabulary. A running
    total over the whole vocabulary in fp64 (a copy of the rows in fp64, then a sequential sum) took 8 of 11 ms on 64
    rows of a 49k vocabulary on a CPU; this takes under 1."""
    num_rows, vocab = probs.shape
    padded = probs if vocab % CDF_BLOCK == 0 else F.pad(probs, (0, -vocab % CDF_BLOCK))
    blocks = padded.reshape(num_rows, -1, CDF_BLOCK)
    block_totals = blocks.sum(dim=-1).double().cumsum(dim=-1)
    mass = block_totals[:, -1:]
    uniforms = torch.rand(num_rows, 1, dtype=torch.float64, device=probs.device)
    for row, r in enumerate(requests):
        if r.generator is not None:  # a CPU generator, whatever the device
            uniforms[row] = torch.rand(1, dtype=torch.float64, generator=r.generator).item()
    # strictly below the mass: the first block total above it then always ends a block of mass > 0
    points = torch.minimum(uniforms * mass, torch.nextafter(mass, torch.zeros_like(mass)))
    # (held to the last block for a row of no mass: a draft whose target it equals leaves a residual of zeros, and
    # that row keeps its draft, whatever is drawn here)
    block = torch.searchsorted(block_totals, points, right=True).clamp_(max=blocks.shape[1] - 1)
    before = torch.where(block > 0, block_totals.gather(1, (block - 1).clamp(min=0)), 0.0)
    totals = blocks[torch.arange(num_rows, device=probs.device), block[:, 0]].cumsum(dim=-1, dtype=torch.float64)
    # The block's sum and its running total add in different orders: what is left of the point may round below 0 or
    # past the running total's end. Held within [0, end), the first total above it is a token of probability > 0.
    rest = torch.minimum((points - before).clamp(min=0.0), torch.nextafter(totals[:, -1:], torch.zeros_like(before)))
    return (block * CDF_BLOCK + torch.searchsorted(totals, rest, right=True))[:, 0]
