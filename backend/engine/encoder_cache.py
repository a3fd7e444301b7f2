"""vLLM's encoder cache: the vision encoder's output of each image, kept by the image's content hash, so that an
image runs through the encoder once however many chunks its tokens are split into, however often a prompt with it is
preempted and recomputed, and for every later request that sends it again. Least recently used images go first once
the cache holds more than its capacity in embedding rows (one row an image token)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

# vLLM sizes its encoder cache at least max_num_batched_tokens, and at least the largest image: this many rows
DEFAULT_CAPACITY_ROWS = 16384


class EncoderCache:
    def __init__(self, capacity_rows: int = DEFAULT_CAPACITY_ROWS):
        self.capacity_rows = capacity_rows
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.rows = 0
        self.encoder_runs = 0  # images the encoder computed (a hit does not count)
        self.hits = 0

    def get(self, key: bytes, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The image's embeddings [tokens, hidden]: cached, or encoded now and kept."""
        embeddings = self.entries.get(key)
        if embeddings is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            return embeddings
        embeddings = encode()
        self.encoder_runs += 1
        self.entries[key] = embeddings
        self.rows += len(embeddings)
        while self.rows > self.capacity_rows and len(self.entries) > 1:  # (one image larger than it all still fits)
            _, evicted = self.entries.popitem(last=False)
            self.rows -= len(evicted)
        return embeddings
