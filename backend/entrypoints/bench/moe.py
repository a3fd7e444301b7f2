"""`npu-llm bench moe`: one MoE layer's experts, the platform's fused_experts against the per-expert F.linear
loop (torch_ref), at decode and prefill sizes, in one process. Prints the ratio per size; only ratios mean
anything across machines."""
from __future__ import annotations

import time

import torch

from npu_llm_kernels import ops_for, torch_ref


def _seconds_per_call(fn, budget_s: float = 0.5) -> float:
    fn()  # warm: caches, thread pool
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s or calls < 3:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def run_moe_bench(args) -> list[dict]:
    torch.manual_seed(0)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    ops = ops_for("cpu")
    w13 = (torch.randn(args.experts, 2 * args.intermediate, args.hidden) / 16).to(dtype)
    w2 = (torch.randn(args.experts, args.hidden, args.intermediate) / 16).to(dtype)
    packed = ops.pack_expert_weights(w13, w2)
    print(f"MoE layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert intermediate "
          f"{args.intermediate}, {args.dtype}; {torch.get_num_threads()} threads")
    print(f"{'tokens':>7} {'per-expert loop ms':>19} {'fused ms':>9} {'fused / loop':>13}")
    rows = []
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden).to(dtype)
            weights, ids = torch_ref.select_experts(torch.randn(tokens, args.experts), args.top_k, renormalize=True)
            loop = _seconds_per_call(lambda: torch_ref.fused_experts(x, w13, w2, weights, ids))
            fused = _seconds_per_call(lambda: ops.fused_experts(x, *packed, weights, ids))
            rows.append({"tokens": tokens, "loop_s": loop, "fused_s": fused, "speedup": loop / fused})
            print(f"{tokens:>7} {loop * 1e3:>19.3f} {fused * 1e3:>9.3f} {loop / fused:>12.2f}x")
    return rows
