"""Engine start-up, the one-time work before the first step (vLLM v1 does it in EngineCore's start): this rank's
model loaded (the other ranks load theirs alongside: run_worker in backend/engine/workers.py), the tokenizer, the KV
cache sized and allocated, decode graphs captured, and a warm-up that pays every first-call cost.

The KV cache's size: on the CPU, kv_cache_memory_gb (a budget of its own); on accelerators, what
gpu_memory_utilization leaves once the weights and a profile of the largest step are counted (backend/engine/memory.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from backend.config import EngineConfig
from backend.engine import memory
from backend.engine.executor import ParallelRunner
from backend.engine.lora_manager import LoRAManager
from backend.engine.request import Request
from backend.engine.runner import ModelRunner
from backend.engine.sampler import sample
from backend.engine.sampling_params import SamplingParams
from backend.engine.tokenizer import eos_token_ids, load_tokenizer
from backend.models.loader import load_model
from backend.platform import Platform
from npu_llm_kernels import cpu as cpu_kernels, ops_for

log = logging.getLogger(__name__)


@dataclass
class Started:
    """What start-up hands the engine's step loop."""

    model: nn.Module
    model_config: object  # the checkpoint's Hugging Face config
    model_dir: Path
    tokenizer: object
    eos_token_ids: set[int]
    runner: ModelRunner | ParallelRunner  # a ParallelRunner under tensor parallel
    num_blocks: int  # KV blocks allocated
    memory_split: memory.MemorySplit | None  # how device memory was shared out (accelerators)
    # speculative decoding with a draft model: its runner, KV tensors of its own for the same blocks
    draft_runner: ModelRunner | None = None


def start(config: EngineConfig, platform: Platform, model_dir: Path, tp, workers) -> Started:
    """Load this rank's model and the tokenizer, size and allocate the KV cache, capture the decode graphs."""
    in_use_before = memory.allocated(platform)
    spec = config.speculative
    model, model_config, model_dir = load_model(
        model_dir, ops_for(platform.name), platform.device, config.dtype, config.max_model_len, tp,
        config.enable_expert_parallel, mtp=spec is not None and spec.uses_mtp, quantization=config.quantization,
        head=(spec.method, spec.model) if spec is not None and spec.uses_eagle else None,
    )
    draft_runner = _load_draft_model(config, platform, model_config) if spec and spec.method == "draft_model" else None
    tokenizer = load_tokenizer(config.tokenizer or model_dir)
    eos = eos_token_ids(model_dir, model_config, tokenizer)
    # the scratch block only; with enable_lora, the adapters' slots (filled as steps need them: set aside below)
    runner = ModelRunner(model, 0, config.block_size, platform.device, LoRAManager.for_config(model, config))
    if workers is not None:
        runner = ParallelRunner(runner, workers)
    weights = memory.allocated(platform) - in_use_before  # (and the rope table and the scratch block)
    if runner.lora is not None:
        weights += runner.lora.layers.slot_bytes(model)
    split = None
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    else:
        num_blocks, split = _blocks_that_fit(config, platform, model, runner, weights, eos, draft_runner)
    runner.allocate_kv_cache(num_blocks)
    if draft_runner is not None:
        draft_runner.allocate_kv_cache(num_blocks)
    if not config.enforce_eager:
        runner.capture_decode_graphs(platform, config.max_num_seqs, _graph_len(config))
    return Started(model, model_config, model_dir, tokenizer, eos, runner, num_blocks, split, draft_runner)


def _load_draft_model(config: EngineConfig, platform: Platform, target_config) -> ModelRunner:
    """speculative_config's draft model, in the target's dtype, on one rank; its vocabulary must be the target's
    (its token ids are the target's to verify)."""
    draft, draft_config, draft_dir = load_model(config.speculative.model, ops_for(platform.name), platform.device,
                                                config.dtype, config.max_model_len)
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model={str(draft_dir)!r}: its vocabulary has {draft_config.vocab_size} "
                         f"tokens, the target's {target_config.vocab_size}; a draft model must share the vocabulary")
    return ModelRunner(draft, 0, config.block_size, platform.device)


@torch.inference_mode()
def warm_up(started: Started, config: EngineConfig) -> None:
    """All one-time work before the first request: the first prefill and decode step build the kernels (the CPU
    extension compiles on first use) and the matmul primitives; the first sample and the first tokenizer call load
    their code too."""
    begin = time.perf_counter()
    logits = started.runner.warm_up(min(config.max_num_batched_tokens, config.max_model_len - 1))
    if started.draft_runner is not None:
        started.draft_runner.warm_up(min(config.max_num_batched_tokens, config.max_model_len - 1))
    probe = Request("warm-up", [0], SamplingParams(temperature=1.0, top_p=0.9, seed=0), 1, started.eos_token_ids)
    sample(logits[:1], [probe])
    started.tokenizer.decode(started.tokenizer.encode("warm-up"))
    log.info("warm-up took %.1f s", time.perf_counter() - begin)


def log_ready(started: Started, config: EngineConfig, platform: Platform) -> None:
    device = f"cpu ({cpu_kernels.describe()})" if platform.name == "cpu" else platform.device
    per_token = ModelRunner.bytes_per_block(started.model, 1)
    log.info("engine ready: %s on %s, %d KV blocks of %d tokens, %d bytes a token (%s)", started.model_dir, device,
             started.num_blocks, config.block_size, per_token,
             "latent rows" if started.model.latent_kv else "keys and values")


def _blocks_that_fit(config: EngineConfig, platform: Platform, model: nn.Module, runner, weights: int,
                     eos, draft_runner: ModelRunner | None) -> tuple[int, memory.MemorySplit | None]:
    per_block = ModelRunner.bytes_per_block(model, config.block_size)
    if draft_runner is not None:  # (a block holds the draft model's keys and values too)
        per_block += ModelRunner.bytes_per_block(draft_runner.model, config.block_size)
    if platform.name == "cpu":  # (a budget of its own, the scratch block included)
        budget, split = config.kv_cache_memory_gb * 2**30 - per_block, None
    else:
        @torch.inference_mode()
        def largest_step() -> None:
            """The memory profile's forward pass: the largest step the scheduler can build, and its sampling."""
            logits = runner.profile_run(config.max_num_batched_tokens, config.max_model_len, config.max_num_seqs)
            params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
            sample(logits, [Request(f"profile-{i}", [0], params, 1, eos) for i in range(len(logits))])

        def trial_decode_graphs():
            return runner.build_decode_graphs(platform, config.max_num_seqs, _graph_len(config))

        split = memory.profile(platform, config.gpu_memory_utilization, weights, largest_step,
                               None if config.enforce_eager else trial_decode_graphs)
        budget = split.kv_cache
    blocks = int(budget // per_block)
    if blocks < 1:
        where = f" ({split.describe(0)})" if split else ""
        raise ValueError(f"no memory left for the KV cache{where}: raise gpu_memory_utilization or "
                         "kv_cache_memory_gb, or lower max_num_batched_tokens or max_num_seqs")
    if split:
        log.info("%s", split.describe(blocks))
    return blocks, split


def _graph_len(config: EngineConfig) -> int:
    return min(config.max_model_len, config.max_seq_len_to_capture)


def release(workers, runner: ModelRunner, kv_connector, draft_runner: ModelRunner | None = None) -> None:
    """An engine's shutdown (its finalizer): the workers and their process group first, then the KV connector (its
    threads, sockets and registrations), then rank 0's KV cache."""
    try:
        if workers is not None:
            workers.shutdown()
    finally:
        try:
            if kv_connector is not None:
                kv_connector.shutdown()
        finally:
            runner.release_kv_cache()
            if draft_runner is not None:
                draft_runner.release_kv_cache()
