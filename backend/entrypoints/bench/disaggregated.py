"""`npu-llm bench serving --disaggregate xPyD`: what disaggregated prefill does to a mixed load, against a colocated
stack on the same load, one after the other on this machine.

The load: `--concurrency` streams decode short prompts while long prompts arrive, one every --long-every-s seconds
(each asking for a few tokens). Colocated, every long prefill takes a step of the engine the streams decode on, so
their inter-token latency (ITL) jumps; disaggregated, the prefill runs on a prefill server and the decode server only
pulls the KV. Reported: the streams' ITL (mean, p90, p99), the long prompts' TTFT, and the KV pull's share of that
TTFT (the decode server's npu_llm:kv_transfer_seconds_total over its pulls).

On one machine both layouts share its cores: a prefill server computing a long prompt slows the decode server next to
it, which separate machines would not. The figures show the scheduling effect (a decode step never waits for a
prefill), not the capacity of separate machines.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time

from backend.entrypoints.bench.throughput import random_prompts
from backend.entrypoints.bench.serving import _one_gateway
from backend.triton.scrape import Scrape

LONG_OUTPUT = 4  # tokens a long prompt asks for: its TTFT is what matters


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _mixed_load(gateway: str, model: str, short: list[str], long: list[str], output_len: int,
                      long_every_s: float) -> dict:
    import httpx

    async with httpx.AsyncClient() as http:
        await _one_gateway(http, gateway, model, short[0], 4)  # warm-up

        async def arrivals():
            ttfts = []
            for prompt in long:
                await asyncio.sleep(long_every_s)
                times, _ = await _one_gateway(http, gateway, model, prompt, LONG_OUTPUT)
                ttfts.append(times[0])
            return ttfts

        begin = time.perf_counter()
        streams = [_one_gateway(http, gateway, model, p, output_len) for p in short]
        *decoded, ttfts = await asyncio.gather(*streams, arrivals())
        wall = time.perf_counter() - begin
    gaps = [b - a for times, _ in decoded for a, b in zip(times, times[1:])]
    return {
        "itl_ms": {"mean": round(statistics.mean(gaps) * 1000, 1), "p90": round(_percentile(gaps, 0.9) * 1000, 1),
                   "p99": round(_percentile(gaps, 0.99) * 1000, 1)},
        "long_ttft_ms": round(statistics.mean(ttfts) * 1000, 1),
        "output_tokens_per_s": round(sum(tokens for _, tokens in decoded) / wall, 1),
    }


def run_disaggregated_bench(args) -> dict:
    from backend.engine.tokenizer import load_tokenizer
    from backend.models.loader import load_config
    from backend.models.registry import resolve_model
    from backend.entrypoints.serve import checked_engine_args
    from backend.entrypoints.up import plan_servers, running_stack

    args.engine_arg = (args.engine_arg or []) + ["enable_prefix_caching=false"]  # (both layouts see the same prompts)
    config = checked_engine_args(args)[2].config
    model_dir = resolve_model(config.model)
    tokenizer = load_tokenizer(model_dir)
    vocab = load_config(model_dir).vocab_size
    short = [tokenizer.decode(p) for p in random_prompts(tokenizer, vocab, args.concurrency[0], args.input_len, 1)]
    long = [tokenizer.decode(p) for p in random_prompts(tokenizer, vocab, args.num_long, str(args.long_len), 2)]
    gateway = f"http://127.0.0.1:{args.gateway_port}"
    layout, results = args.disaggregate, {}
    for name, disaggregate in (("colocated", None), (layout, layout)):
        args.disaggregate = disaggregate
        with running_stack(args, with_ui=False):
            results[name] = asyncio.run(_mixed_load(gateway, args.served_model, short, long, args.output_len,
                                                    args.long_every_s))
            if disaggregate:
                decode = [s for s in plan_servers(args, {}) if s.role == "decode"]
                scrape = Scrape([f"http://127.0.0.1:{s.metrics_port}/metrics" for s in decode], timeout=5)
                seconds = scrape.total("npu_llm:kv_transfer_seconds")  # (counters: _total dropped)
                pulls = scrape.total("npu_llm:kv_transfer_pulls")
                pull_ms = seconds / max(pulls, 1) * 1000
                results[name]["kv_pull_ms"] = round(pull_ms, 2)
                results[name]["kv_pull_share_of_long_ttft"] = round(pull_ms / results[name]["long_ttft_ms"], 3)
    colocated, apart = results["colocated"], results[layout]
    result = {
        "model": config.model, "dtype": config.dtype, "streams": len(short), "input_len": args.input_len,
        "output_len": args.output_len, "long_len": args.long_len, "long_prompts": len(long),
        "long_every_s": args.long_every_s, **results,
        f"{layout}_vs_colocated": {
            "itl_mean": round(apart["itl_ms"]["mean"] / colocated["itl_ms"]["mean"], 2),
            "itl_p99": round(apart["itl_ms"]["p99"] / colocated["itl_ms"]["p99"], 2),
            "long_ttft": round(apart["long_ttft_ms"] / colocated["long_ttft_ms"], 2),
        },
    }
    print(json.dumps(result), flush=True)
    return result
