"""Drafting with a head that reads the target's hidden states: the checkpoint's multi-token-prediction layer (vLLM's
"deepseek_mtp" / "mtp"; backend/models/mtp.py) or an EAGLE / EAGLE-3 head ("eagle", "eagle3";
backend/models/eagle.py). At position p the head reads the target's hidden state there and the token at p + 1, and
predicts the token at p + 2; it runs over every position the target computed and kept, prompt chunks included, so
that its own KV cache follows the target's. For k drafts it is applied again to its own hidden state and its last
draft, one position further each time, as vLLM recurses it."""
from __future__ import annotations

from backend.engine.kv_cache import KVCacheManager
from backend.engine.runner import DraftChunk, ModelRunner
from backend.engine.spec_decode.drafter import KeptPositions


class DraftHeadProposer:
    runs_every_position = True

    def __init__(self, runner: ModelRunner, kv: KVCacheManager):
        self.runner, self.kv = runner, kv

    def propose(self, kept: list[KeptPositions]) -> list[list[int]]:
        chunks = []
        for p in kept:
            request, num_kept = p.request, p.request.num_computed_tokens - p.start
            chunks.append(DraftChunk(request.token_ids[p.start + 1 : p.start + num_kept + 1], p.start, p.block_ids,
                                     list(range(p.first_row, p.first_row + num_kept)), p.num_wanted > 0))
        drafting = [p for p in kept if p.num_wanted]
        drafts = {id(p): [token] for p, token in zip(drafting, self.runner.draft(chunks, "step"))}
        rows = {id(p): row for row, p in enumerate(drafting)}  # each one's row of the head's last output
        for j in range(1, max((p.num_wanted for p in drafting), default=0)):
            # the j-th draft's position is num_computed - 1 + j: its KV needs a slot (never at another's expense)
            going = [p for p in drafting if p.num_wanted > j and self.kv.allocate(p.request, j)]
            if not going:
                break
            step = [DraftChunk([drafts[id(p)][-1]], p.request.num_computed_tokens - 1 + j, p.block_ids,
                               [rows[id(p)]], True) for p in going]
            for row, (p, token) in enumerate(zip(going, self.runner.draft(step, "draft"))):
                drafts[id(p)].append(token)
                rows[id(p)] = row
        return [drafts.get(id(p), []) for p in kept]
