"""`npu-llm bench throughput`: our LLM vs. Hugging Face `generate` on the same random prompts, one JSON line.
With --structured-outputs, a constrained run vs. the same run unconstrained (--baseline unconstrained)."""
from __future__ import annotations

import json
import random
import sys
import time

import torch

from backend.config import EngineConfig
from backend.engine.llm import LLM
from backend.engine.sampling_params import SamplingParams


def random_prompts(tokenizer, vocab_size: int, num_prompts: int, input_len: str, seed: int) -> list[list[int]]:
    """Seeded random-token prompts, lengths uniform in MIN:MAX (or exactly N), no special tokens."""
    lo, _, hi = input_len.partition(":")
    lo, hi = int(lo), int(hi or lo)
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    pool = [t for t in range(vocab_size) if t not in special]
    return [[rng.choice(pool) for _ in range(rng.randint(lo, hi))] for _ in range(num_prompts)]


def _hf_generate(model_dir, dtype: torch.dtype, prompts, output_len: int, batch_size: int, pad_id: int) -> float:
    """Seconds for transformers' generate over static, left-padded batches (greedy, exact lengths)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True).eval()  # (never a .bin)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                do_sample=False, pad_token_id=pad_id,
            )
        assert out.shape[1] == width + output_len
    return time.perf_counter() - start


def _timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    llm.reset_prefix_cache()  # each timed run computes its prompts: none is served from an earlier run's blocks
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - start, outputs


def run_throughput_bench(args) -> dict:
    config = EngineConfig.from_cli_args(args)
    llm = LLM(**config.to_dict())
    engine = llm.engine
    prompts = random_prompts(engine.tokenizer, engine.model_config.vocab_size, args.num_prompts, args.input_len, config.seed)
    unconstrained = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    params = unconstrained
    if args.structured_outputs:  # a grammar keeps the output going instead of ignore_eos (which it refuses)
        params = SamplingParams(temperature=0, max_tokens=args.output_len,
                                structured_outputs=json.loads(args.structured_outputs))
    num_prompt_tokens = sum(map(len, prompts))

    llm.generate([{"prompt_token_ids": prompts[0][:16]}], params.model_copy(update={"max_tokens": 2}))  # warm-up
    before = engine.stats()
    if config.profile_dir:
        llm.start_profile()
    elapsed, outputs = _timed_generate(llm, prompts, params)
    profile = llm.stop_profile() if config.profile_dir else None
    stats = engine.stats()
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if num_output_tokens != args.output_len * len(prompts):
        raise SystemExit(f"outputs ended before --output-len ({num_output_tokens} of {args.output_len * len(prompts)} "
                         "tokens): give --structured-outputs a spec that needs more tokens (e.g. a large minItems)")

    result = {
        "model": config.model,
        "device": engine.engine_info().device,
        "dtype": engine.engine_info().dtype,
        "num_prompts": len(prompts),
        "prompt_tokens": num_prompt_tokens,
        "output_tokens": num_output_tokens,
        "ours": {
            "elapsed_s": round(elapsed, 2),
            "output_tokens_per_s": round(num_output_tokens / elapsed, 1),
            "total_tokens_per_s": round((num_output_tokens + num_prompt_tokens) / elapsed, 1),
        },
        "kv_cache_waste": round(stats.kv_cache_waste, 4),
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
    }
    if args.baseline == "unconstrained":
        base_elapsed, _ = _timed_generate(llm, prompts, unconstrained)
        result["unconstrained"] = {"elapsed_s": round(base_elapsed, 2),
                                   "output_tokens_per_s": round(num_output_tokens / base_elapsed, 1)}
        result["output_throughput_ratio"] = round(base_elapsed / elapsed, 2)
    if args.baseline == "hf":
        dtype = getattr(torch, engine.engine_info().dtype)
        pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
        hf_elapsed = _hf_generate(engine.model_dir, dtype, prompts, args.output_len, args.hf_batch_size, pad)
        result["hf"] = {
            "elapsed_s": round(hf_elapsed, 2),
            "batch_size": args.hf_batch_size,
            "output_tokens_per_s": round(num_output_tokens / hf_elapsed, 1),
            "total_tokens_per_s": round((num_output_tokens + num_prompt_tokens) / hf_elapsed, 1),
        }
        result["output_throughput_ratio"] = round(hf_elapsed / elapsed, 2)
    if profile is not None:
        print(profile.table(), file=sys.stderr, flush=True)
        result["profile"] = {"trace": profile.trace_path, "note": "timed with profiling on: slower than without"}
    print(json.dumps(result), flush=True)
    return result
