"""N-gram drafting (vLLM's "ngram", prompt lookup decoding): the longest suffix of a request's tokens, of
prompt_lookup_min..prompt_lookup_max tokens, that occurred before, at its earliest place; the tokens that followed
it there are the drafts. No weights and no forward pass: copy-heavy work (quoting or editing a passage the prompt
holds, answers drawn from retrieved text) gains most."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from backend.engine.spec_decode.drafter import KeptPositions


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens after the earliest earlier occurrence of the longest matching suffix (vLLM's rule)."""
    # where a match can end: at the last token's value, before the last token (so the suffix never matches itself
    # and a token always follows); few places survive this, and only they are compared further
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = ends[ends >= n - 1] - (n - 1)
        if not len(starts):
            continue
        windows = sliding_window_view(tokens, n)[starts]
        matched = starts[(windows == tokens[-n:]).all(axis=1)]
        if len(matched):
            after = int(matched[0]) + n
            return tokens[after : after + k].tolist()
    return []


class NgramProposer:
    runs_every_position = False

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, kept: list[KeptPositions]) -> list[list[int]]:
        return [lookup(np.asarray(p.request.token_ids), p.num_wanted, self.min_n, self.max_n) if p.num_wanted else []
                for p in kept]
