"""What an attention kernel needs to know about one flattened batch.

A step runs one flat batch of tokens. Sequences are ordered decodes first (one new token
each), then prefill chunks (any number of new tokens, possibly after a cached prefix),
the vLLM v1 convention: the decode part is one batched kernel call, the prefill part one
call per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of blocks of b that hold a items."""
    return -(-a // b)


@dataclass
class GraphCapture:
    """What the layers of one decode graph share while it is captured."""

    # Kernels whose attention op takes host arguments append a function that re-issues it with
    # the step's context lengths before each replay.
    updates: list[Callable[[torch.Tensor], None]] = field(default_factory=list)
    # The attention op's scratch memory: the layers run one after another, so one serves them all
    # (and the graphs of one batch size, captured widest first, share it too).
    workspace: torch.Tensor | None = None


# The slot of a token whose K/V is written nowhere, as vLLM and vllm-ascend pad: kernels whose module sets
# SKIPS_PAD_SLOTS skip it; the others write the scratch block's slots instead (see AttentionMetadata.build).
PAD_SLOT_ID = -1


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # new tokens per sequence in this step
    context_lens: list[int]  # KV length per sequence after this step (cached + new)
    num_decodes: int  # the leading run of sequences with exactly one new token (batched as decodes)
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token, or PAD_SLOT_ID
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, unused tail entries are 0
    context_lens_tensor: torch.Tensor  # [num_seqs] int32
    graph_capture: GraphCapture | None = None  # set only while a decode graph is captured

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        dropped_block: int | None = None,
    ) -> "AttentionMetadata":
        """dropped_block: a block whose slots are written nowhere (PAD_SLOT_ID, which the kernels that set
        SKIPS_PAD_SLOTS skip): the scratch block of dummy steps and of a captured batch's padding rows."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1

        max_blocks = max((len(b) for b in block_tables), default=0)
        table = np.zeros((len(block_tables), max(max_blocks, 1)), dtype=np.int32)
        for row, blocks in zip(table, block_tables):
            row[: len(blocks)] = blocks

        # Positions of the new tokens, then their slots: bt[seq, pos // bs] * bs + pos % bs.
        seq_index = np.repeat(np.arange(len(query_lens)), query_lens)
        starts = np.repeat(np.asarray(context_lens) - np.asarray(query_lens), query_lens)
        offsets = np.arange(len(seq_index)) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
        positions = starts + offsets
        blocks = table[seq_index, positions // block_size].astype(np.int64)
        slots = blocks * block_size + positions % block_size
        if dropped_block is not None:
            slots[blocks == dropped_block] = PAD_SLOT_ID

        return cls(
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            num_decodes=num_decodes,
            block_size=block_size,
            slot_mapping=torch.from_numpy(slots).to(device),
            block_tables=torch.from_numpy(table).to(device),
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.int32, device=device),
        )

    def decodes(self) -> "AttentionMetadata":
        """The metadata of the leading decode sequences alone (their tokens are the batch's first num_decodes)."""
        n = self.num_decodes
        return AttentionMetadata(
            query_lens=self.query_lens[:n],
            context_lens=self.context_lens[:n],
            num_decodes=n,
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[:n],
            block_tables=self.block_tables[:n],
            context_lens_tensor=self.context_lens_tensor[:n],
            graph_capture=self.graph_capture,
        )
