"""`npu-llm bench lora`: output tokens/s with LoRA adapters spread over the requests against the base model alone, on
the same random prompts, in one process and one engine (runs interleaved, so that the machine's drift hits both).
The adapters are random, in PEFT's format, written to a temporary folder: what they compute is not the point, their
cost is. One JSON line; only the ratio means anything across machines."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from backend.config import EngineConfig
from backend.engine.llm import LLM
from backend.engine.lora_request import LoRARequest
from backend.engine.sampling_params import SamplingParams
from backend.entrypoints.bench.throughput import random_prompts
from backend.models.lora_adapter import checkpoint_shape


def write_random_adapter(config, path: Path, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """A PEFT LoRA adapter of random weights for a model of `config`, every layer's `targets`, at `path`."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in targets:
            part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            out_features, in_features = checkpoint_shape(config, target)
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) / rank
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                          "target_modules": list(targets)}))
    return path


def _timed(llm: LLM, prompts, params, loras) -> float:
    llm.reset_prefix_cache()  # (each run computes its prompts)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, loras)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == params.max_tokens * len(prompts)
    return elapsed


def run_lora_bench(args) -> dict:
    config = EngineConfig.from_cli_args(args)
    config.enable_lora = True
    config.max_loras = max(config.max_loras, args.adapters)
    config.max_lora_rank = max(config.max_lora_rank, args.rank)
    llm = LLM(**config.to_dict())
    engine = llm.engine
    prompts = random_prompts(engine.tokenizer, engine.model_config.vocab_size, args.num_prompts, args.input_len,
                             config.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="npu-llm-lora-bench-") as folder:
        adapters = [LoRARequest(f"bench-{i}", i + 1, str(write_random_adapter(
            engine.model_config, Path(folder) / f"adapter-{i}", args.rank, tuple(args.targets), seed=i)))
            for i in range(args.adapters)]
        spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
        llm.generate([{"prompt_token_ids": prompts[0][:16]}] * len(adapters), params.model_copy(update={"max_tokens": 2}),
                     adapters)  # warm-up: every adapter read, every slot loaded once
        base, lora = [], []
        for _ in range(args.repeats):  # interleaved
            base.append(_timed(llm, prompts, params, None))
            lora.append(_timed(llm, prompts, params, spread))
    tokens = args.output_len * len(prompts)
    result = {
        "model": config.model, "device": engine.engine_info().device, "dtype": engine.engine_info().dtype,
        "num_prompts": len(prompts), "output_tokens": tokens, "adapters": args.adapters, "rank": args.rank,
        "targets": list(args.targets),
        "base_output_tokens_per_s": [round(tokens / s, 1) for s in base],
        "lora_output_tokens_per_s": [round(tokens / s, 1) for s in lora],
        "lora_vs_base": round(sum(base) / sum(lora), 3),
    }
    print(json.dumps(result), flush=True)
    return result
