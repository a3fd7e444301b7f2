"""Drafting with a smaller model of the same vocabulary (vLLM's "draft_model"): k greedy tokens, one forward pass of
the draft model each.

Its KV cache is tensors of its own indexed by the target's block tables: a block id holds both models' keys and
values for the same positions, so the target's allocation, prefix-cache hits, preemption and freeing hold for the
draft model too, with no block table of its own to keep. It runs over every position the target computed and kept,
then the new last token of each request that drafts, whose logits give the first draft."""
from __future__ import annotations

from backend.engine.kv_cache import KVCacheManager
from backend.engine.runner import ModelRunner, SequenceChunk
from backend.engine.spec_decode.drafter import KeptPositions


class DraftModelProposer:
    runs_every_position = True

    def __init__(self, runner: ModelRunner, kv: KVCacheManager):
        self.runner, self.kv = runner, kv

    def propose(self, kept: list[KeptPositions]) -> list[list[int]]:
        chunks, drafting = [], []
        for p in kept:
            request = p.request
            # the new last token's position needs a slot (never at another's expense: no slot, no drafts)
            wants = bool(p.num_wanted) and self.kv.allocate(request, 1)
            end = request.num_computed_tokens + wants
            chunks.append(SequenceChunk(request.token_ids[p.start : end], p.start, p.block_ids, wants))
            if wants:
                drafting.append(p)
        drafts = {id(p): [token] for p, token in zip(drafting, self._greedy(chunks))}
        for j in range(1, max((p.num_wanted for p in drafting), default=0)):
            going = [p for p in drafting if p.num_wanted > j and self.kv.allocate(p.request, j + 1)]
            if not going:
                break
            step = [SequenceChunk([drafts[id(p)][-1]], p.request.num_computed_tokens + j, p.block_ids)
                    for p in going]
            for p, token in zip(going, self._greedy(step)):
                drafts[id(p)].append(token)
        return [drafts.get(id(p), []) for p in kept]

    def _greedy(self, chunks: list[SequenceChunk]) -> list[int]:
        """The draft model's argmax after each chunk that wants logits, in their order (vLLM drafts greedily)."""
        return self.runner.execute(chunks).logits.argmax(-1).tolist()
