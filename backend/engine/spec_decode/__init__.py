"""Speculative decoding (docs/speculative-decoding.md), as vLLM v1 does it: after each step a proposer drafts up to
num_speculative_tokens tokens for each request that decodes next; the next step runs them after its last token, k + 1
positions through the paged KV cache, in the same batch as plain decodes and prefills; the step's rejection sampler
(backend/engine/sampler.py, backend/engine/step_runner.py) keeps the drafts while they hold, and a token after the
last kept one. Drafts change how many tokens a step yields, never their distribution.

drafter.py: what every method shares (verified tokens joining their requests, the counts, the blocks);
ngram.py, draft_model.py, draft_head.py (an MTP layer or an EAGLE head): the proposers."""
from __future__ import annotations

from backend.config import SpeculativeConfig
from backend.engine.kv_cache import KVCacheManager
from backend.engine.runner import ModelRunner
from backend.engine.spec_decode.drafter import Drafter, KeptPositions, SpecDecodeStats
from backend.engine.spec_decode.draft_model import DraftModelProposer
from backend.engine.spec_decode.draft_head import DraftHeadProposer
from backend.engine.spec_decode.ngram import NgramProposer

__all__ = ["Drafter", "KeptPositions", "SpecDecodeStats", "make_drafter"]


def make_drafter(spec: SpeculativeConfig, runner: ModelRunner, draft_runner: ModelRunner | None,
                 kv: KVCacheManager) -> Drafter:
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "draft_model":
        proposer = DraftModelProposer(draft_runner, kv)
    else:
        proposer = DraftHeadProposer(runner, kv)
    return Drafter(proposer, k, kv)
