"""Decode graphs with the portable (CUDA) kernels, captured and replayed on the CPU.

torch has no CPU graphs, so the capture goes through the fake torch_npu's recording NPUGraph
(tests/fake_torch_npu/torch_npu/_graphs.py), which replays recorded ops on whatever the captured
buffers hold, as a CUDA graph does. With npu_llm_kernels.cuda (torch_ref's ops) this runs the CUDA graph
path: device-side context lengths, a ladder of capture widths, padded batches and no host updates.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from backend.engine.decode_graphs import capture_sizes
from backend.engine.runner import ModelRunner, SequenceChunk
from backend.models.loader import load_model
from backend.platform import Platform
from npu_llm_kernels import ops_for

BLOCK_SIZE, MAX_LEN = 16, 256


@functools.cache
def _recording_graphs():
    path = Path(__file__).parent / "fake_torch_npu" / "torch_npu" / "_graphs.py"
    spec = importlib.util.spec_from_file_location("recording_graphs", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # only this file: torch.npu stays unregistered
    return module


class RecordingPlatform(Platform):
    """The CPU, with graphs recorded and replayed op by op."""

    @property
    def graph_api(self):
        graphs = _recording_graphs()
        return graphs.NPUGraph, graphs.graph, graphs.graph_pool_handle


def test_capture_sizes_follow_vllm():
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill every prompt in one step, then decode them together `steps` times."""
    tables = [list(range(i * MAX_LEN // BLOCK_SIZE, (i + 1) * MAX_LEN // BLOCK_SIZE)) for i in range(len(prompts))]
    logits = runner.execute([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)]).logits
    tokens = [p + [int(row.argmax())] for p, row in zip(prompts, logits)]
    for _ in range(steps):
        logits = runner.execute([SequenceChunk(t[-1:], len(t) - 1, b) for t, b in zip(tokens, tables)]).logits
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
    return [t[len(p) :] for t, p in zip(tokens, prompts)]


@pytest.mark.slow
def test_cuda_kernels_replayed_as_graphs_equal_eager(default_model_dir):
    model, _, _ = load_model(default_model_dir, ops_for("cuda"), torch.device("cpu"), "float32", MAX_LEN)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 19, 28, 216, 33, 28, 216], [9690, 198, 4237, 346, 253, 3046]]
    eager = _greedy(ModelRunner(model, 3 * MAX_LEN // BLOCK_SIZE, BLOCK_SIZE, "cpu"), prompts, steps=20)

    runner = ModelRunner(model, 3 * MAX_LEN // BLOCK_SIZE, BLOCK_SIZE, "cpu")
    runner.capture_decode_graphs(RecordingPlatform("cpu", torch.device("cpu")), max_num_seqs=4, max_len=MAX_LEN)
    graphs = runner.decode_graphs
    assert graphs.widths == [32, 64, 128, 256] and len(graphs.graphs) == 3 * 4
    assert _greedy(runner, prompts, steps=20) == eager
    assert graphs.num_replays == 20  # three sequences on the 4-row graphs: one padding row
    assert all(not captured.capture.updates for captured in graphs.graphs.values())  # lengths live on the device
