"""`npu-llm bench serving`: what Triton and the gateway cost on top of the engine.

On the same prompts: TTFT and ITL at concurrency 1 in-process (AsyncEngine), through Triton
gRPC and through the gateway (SSE), printed as ratios to in-process; then output tokens/s through
the gateway at several concurrencies. The in-process engine runs alone first, then the stack, so
the two never share the CPU. Prefix caching is off for all paths, since they replay the same prompts.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time

from backend.entrypoints.bench.throughput import random_prompts
from backend.config import EngineConfig
from backend.engine.sampling_params import SamplingParams


def _latencies(chunk_times: list[list[float]]) -> dict:
    ttft = [c[0] for c in chunk_times if c]
    itl = [b - a for c in chunk_times for a, b in zip(c, c[1:])]
    return {"ttft_ms": round(statistics.mean(ttft) * 1000, 2), "itl_ms": round(statistics.mean(itl) * 1000, 2)}


async def _in_process(config: EngineConfig, prompts: list[str], params: SamplingParams) -> list[list[float]]:
    from backend.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(config)
    try:
        await _one_engine(engine, prompts[0], params)  # warm-up
        return [await _one_engine(engine, p, params) for p in prompts]
    finally:
        engine.shutdown()


async def _one_engine(engine, prompt, params) -> list[float]:
    start, times = time.perf_counter(), []
    async for out in engine.generate(prompt, params):
        if out.outputs[0].delta:
            times.append(time.perf_counter() - start)
    return times


async def _one_gateway(client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[list[float], int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, times, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                times.append(time.perf_counter() - start)
    return times, tokens


async def _one_grpc(client, prompt: str, max_tokens: int) -> list[float]:
    from backend.gateway.client import infer_input

    params = json.dumps({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    inputs = [infer_input("text_input", prompt.encode()), infer_input("stream", True),
              infer_input("sampling_parameters", params.encode()), infer_input("return_finish_reason", True)]

    async def requests():
        yield {"model_name": "llm", "inputs": inputs}

    start, times = time.perf_counter(), []
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise RuntimeError(error)
        if result.as_numpy("text_output")[0]:
            times.append(time.perf_counter() - start)
        if result.as_numpy("finish_reason")[0] != b"None":
            break
    return times


async def _through_stack(args, prompts: list[str]) -> dict:
    import httpx
    import tritonclient.grpc.aio as grpcclient

    gateway = f"http://127.0.0.1:{args.gateway_port}"
    grpc = grpcclient.InferenceServerClient(f"localhost:{args.grpc_port}")
    results = {}
    async with httpx.AsyncClient() as http:
        await _one_gateway(http, gateway, args.served_model, prompts[0], args.output_len)  # warm-up
        results["triton_grpc"] = _latencies([await _one_grpc(grpc, p, args.output_len) for p in prompts])
        results["gateway"] = _latencies([(await _one_gateway(http, gateway, args.served_model, p, args.output_len))[0]
                                         for p in prompts])
        throughput = {}
        for users in args.concurrency:
            queue = [prompts[i % len(prompts)] for i in range(max(users * 2, len(prompts)))]

            async def worker():
                total = 0
                while queue:
                    _, tokens = await _one_gateway(http, gateway, args.served_model, queue.pop(), args.output_len)
                    total += tokens
                return total

            start = time.perf_counter()
            tokens = sum(await asyncio.gather(*(worker() for _ in range(users))))
            throughput[str(users)] = round(tokens / (time.perf_counter() - start), 1)
        results["gateway_output_tokens_per_s"] = throughput
    await grpc.close()
    return results


def run_serving_bench(args) -> dict:
    from backend.engine.tokenizer import load_tokenizer
    from backend.models.loader import load_config
    from backend.models.registry import resolve_model
    from backend.entrypoints.serve import checked_engine_args
    from backend.entrypoints.up import running_stack

    # Every path sees the same prompts, so the prefix cache would favour whichever runs later: off.
    args.engine_arg = (args.engine_arg or []) + ["enable_prefix_caching=false"]
    config = checked_engine_args(args)[2].config  # model.json + --engine-arg: the engine the stack will run
    model_dir = resolve_model(config.model)
    tokenizer = load_tokenizer(model_dir)
    ids = random_prompts(tokenizer, load_config(model_dir).vocab_size, args.num_prompts, args.input_len, config.seed)
    prompts = [tokenizer.decode(p) for p in ids]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    in_process = _latencies(asyncio.run(_in_process(config, prompts, params)))
    with running_stack(args, with_ui=False):
        stack = asyncio.run(_through_stack(args, prompts))
    result = {
        "model": config.model, "dtype": config.dtype, "prompts": len(prompts), "input_len": args.input_len,
        "output_len": args.output_len, "in_process": in_process, **stack,
        "ratio_vs_in_process": {
            path: {k: round(stack[path][k] / in_process[k], 2) for k in ("ttft_ms", "itl_ms")}
            for path in ("triton_grpc", "gateway")
        },
    }
    print(json.dumps(result), flush=True)
    return result
