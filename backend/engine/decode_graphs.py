"""Decode steps captured once as device graphs and replayed (vLLM's CUDA graphs, vllm-ascend's ACL graphs).

A decode step runs a few small kernels per layer over a handful of tokens, so on an accelerator
the host's launch overhead dominates it; a captured graph launches them all at once. A graph fixes
shapes and addresses, so:
- a decode batch runs padded to the next captured batch size, its inputs copied into the buffers
  the graphs were captured reading. Padding rows write their K/V nowhere where the kernels skip padded
  slots (the NPU's), else into the runner's scratch block, which no request owns; they never reach the lm_head;
- attention is captured for a context width (the kernels' decode_graph_widths); the narrowest that
  covers the batch's longest sequence is replayed, and batches longer than all of them run eagerly;
- where the attention op takes context lengths as host data (the NPU), the kernels register an
  update that re-issues it with the step's lengths before the replay (GraphCapture.updates).
Prefill and mixed steps always run eagerly.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from backend.platform import Platform
from npu_llm_kernels import AttentionMetadata
from npu_llm_kernels.metadata import PAD_SLOT_ID, GraphCapture, cdiv

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's batch sizes to capture (1, 2, 4, then multiples of 8), up to the largest batch there can be."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


@dataclass
class _Captured:
    graph: object
    hidden: torch.Tensor  # the graph's output: [batch size, hidden]
    capture: GraphCapture  # host-argument re-issues to run before each replay, the attention workspace


class DecodeGraphs:
    def __init__(self, model, kv_caches, platform: Platform, block_size: int, scratch_block: int,
                 dropped_block: int | None, max_num_seqs: int, max_len: int):
        """dropped_block: the scratch block where the kernels skip its slots (the runner's), else None."""
        if platform.graph_api is None:
            raise ValueError(f"torch has no device graphs on {platform.name}")
        self.model, self.kv_caches, self.platform = model, kv_caches, platform
        self.block_size, self.scratch_block, self.dropped_block = block_size, scratch_block, dropped_block
        self.batch_sizes = capture_sizes(max_num_seqs)
        self.widths = model.ops.decode_graph_widths(max_len, block_size)
        size, max_blocks, device = self.batch_sizes[-1], cdiv(max_len, block_size), platform.device
        # The inputs every graph reads; padding rows point at the scratch block with one token of context.
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        padding_slot = scratch_block * block_size if dropped_block is None else PAD_SLOT_ID
        self.slot_mapping = torch.full((size,), padding_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((size, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.num_replays = 0

    def covers(self, query_lens: list[int], context_lens: list[int]) -> bool:
        return (
            all(q == 1 for q in query_lens)
            and len(query_lens) <= self.batch_sizes[-1]
            and max(context_lens) <= self.widths[-1]
        )

    @torch.inference_mode()
    def capture(self) -> None:
        graph_class, capturing, new_pool = self.platform.graph_api
        start, pool = time.perf_counter(), new_pool()
        # Largest first, so the smaller graphs fit into the memory the largest one reserved.
        for size in reversed(self.batch_sizes):
            workspace = None  # the attention op's, shared by the graphs of one batch size (widest first)
            for width in reversed(self.widths):
                self._forward(size, self._metadata(size, width))  # warm-up: no lazy initialisation under capture
                graph, metadata = graph_class(), self._metadata(size, width, GraphCapture(workspace=workspace))
                with capturing(graph, pool=pool):
                    hidden = self._forward(size, metadata)
                self.graphs[size, width] = _Captured(graph, hidden, metadata.graph_capture)
                workspace = metadata.graph_capture.workspace
        self.platform.synchronize()
        log.info("captured %d decode graphs (batch sizes %s, context widths %s) in %.1f s", len(self.graphs),
                 self.batch_sizes, self.widths, time.perf_counter() - start)

    @torch.inference_mode()
    def run(self, token_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [batch, hidden] of one decode token per sequence (covers() must hold)."""
        batch = len(token_ids)
        size = next(s for s in self.batch_sizes if s >= batch)
        width = next(w for w in self.widths if w >= max(context_lens))
        padding = size - batch
        context_lens = context_lens + [1] * padding
        inputs = AttentionMetadata.build(
            [1] * size, context_lens, block_tables + [[self.scratch_block]] * padding, self.block_size,
            dropped_block=self.dropped_block,
        )
        self.input_ids[:size].copy_(torch.tensor(token_ids + [0] * padding))
        self.positions[:size].copy_(inputs.context_lens_tensor - 1)
        self.slot_mapping[:size].copy_(inputs.slot_mapping)
        self.block_tables[:size, : inputs.block_tables.shape[1]].copy_(inputs.block_tables)
        self.context_lens[:size].copy_(inputs.context_lens_tensor)
        captured = self.graphs[size, width]
        for update in captured.capture.updates:
            update(inputs.context_lens_tensor)
        captured.graph.replay()
        self.num_replays += 1
        return captured.hidden[:batch]

    def _metadata(self, size: int, width: int, capture: GraphCapture | None = None) -> AttentionMetadata:
        # Host-side lengths are the width: shapes (and the NPU op's workspace) are sized for the longest
        # context the graph will see; the real lengths come from context_lens or the graph updates.
        return AttentionMetadata(
            query_lens=[1] * size, context_lens=[width] * size, num_decodes=size, block_size=self.block_size,
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            context_lens_tensor=self.context_lens[:size], graph_capture=capture,
        )

    def _forward(self, size: int, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)
