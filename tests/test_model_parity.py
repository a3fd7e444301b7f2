"""Our paged-cache Llama family matches Hugging Face transformers in fp32."""
from __future__ import annotations

import random

import pytest
import torch

from backend.engine.runner import ModelRunner, SequenceChunk
from backend.models.loader import load_model
from npu_llm_kernels import ops_for
from npu_llm_kernels.metadata import cdiv
from tests.conftest import hf_model

DECODE_STEPS = 32


def _greedy_through_paged_cache(model, prompt: list[int], block_size: int, steps: int):
    """Prefill the prompt, then greedy-decode `steps` tokens one at a time; all step logits."""
    num_blocks = 64
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, device="cpu")
    blocks = random.Random(0).sample(range(num_blocks), cdiv(len(prompt) + steps, block_size))
    logits = [runner.execute([SequenceChunk(prompt, 0, blocks)]).logits[0]]
    tokens = prompt + [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(runner.execute([SequenceChunk(tokens[-1:], len(tokens) - 1, blocks)]).logits[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) :], torch.stack(logits)


def _prompt_logits(model, prompt: list[int], block_size: int) -> torch.Tensor:
    from npu_llm_kernels import AttentionMetadata

    runner = ModelRunner(model, num_blocks=64, block_size=block_size, device="cpu")
    blocks = list(range(cdiv(len(prompt), block_size)))
    metadata = AttentionMetadata.build([len(prompt)], [len(prompt)], [blocks], block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), runner.kv_caches, metadata)
        return model.compute_logits(hidden).float()


def _check_against_hf(model_dir, prompt, block_size, atol: float = 1e-3):
    ours, _, _ = load_model(model_dir, ops_for("cpu"), dtype="float32")
    reference = hf_model(model_dir)
    tokens, step_logits = _greedy_through_paged_cache(ours, prompt, block_size, DECODE_STEPS)
    with torch.no_grad():
        hf_logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
    n = len(prompt)
    assert (_prompt_logits(ours, prompt, block_size) - hf_logits[:n]).abs().max() < atol
    assert (step_logits - hf_logits[n - 1 : n - 1 + DECODE_STEPS]).abs().max() < atol
    assert tokens == hf_logits[n - 1 : n - 1 + DECODE_STEPS].argmax(-1).tolist()


@pytest.mark.parametrize("block_size", [16, 128])
def test_tiny_models_match_transformers(tiny_model_dir, block_size, cpu_level):
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    _check_against_hf(tiny_model_dir, prompt, block_size)


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    _check_against_hf(default_model_dir, prompt, 16)
