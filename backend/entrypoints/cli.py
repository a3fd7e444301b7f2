"""The `npu-llm` command."""
from __future__ import annotations

import argparse
import logging
import sys

from backend.config import EngineConfig
from backend.models.registry import DEFAULT_MODEL

GRACEFUL_SHUTDOWN_S = 5


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed for reproducible samples")


def _cmd_chat(args) -> int:
    from backend.entrypoints.chat import run_chat
    from backend.engine.engine import LLMEngine
    from backend.engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.sampling_seed
    )
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    run_chat(engine, params, args.system)
    return 0


def _cmd_serve(args) -> int:
    from backend.entrypoints.serve import serve

    return serve(args)


def _cmd_gateway(args) -> int:
    import os

    import uvicorn

    from backend.gateway.app import GatewaySettings, create_app

    settings = GatewaySettings(
        triton_url=args.triton_url,
        triton_model=args.triton_model,
        served_model_name=args.served_model_name or args.tokenizer,
        tokenizer=args.tokenizer,
        api_key=args.api_key or os.environ.get("NPU_LLM_API_KEY") or None,
        cors_origins=args.cors_origin or [],
        max_body_bytes=args.max_body_bytes,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        prefill_urls=args.prefill,
        decode_urls=args.decode,
        allow_kv_transfer_params=args.allow_kv_transfer_params,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=args.allowed_media_domains,
    )
    # On SIGTERM, open streams get GRACEFUL_SHUTDOWN_S to finish, then are cancelled (which cancels them in Triton).
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0


def _cmd_ui(args) -> int:
    from ui.chat import run_ui

    return run_ui(args)


def _cmd_up(args) -> int:
    from backend.entrypoints.up import up

    return up(args)


def _cmd_loadtest(args) -> int:
    from loadtest.run import run_loadtest

    return run_loadtest(args)


def _cmd_doctor(args) -> int:
    from backend.entrypoints.doctor import doctor

    return doctor(args)


def _cmd_verify(args) -> int:
    from backend.entrypoints.verify import run_verify

    return run_verify(args)


def _cmd_quantize(args) -> int:
    from backend.entrypoints.quantize import quantize_checkpoint

    out = quantize_checkpoint(args.model, args.out, args.scheme, args.calibration, args.calibration_tokens,
                              args.tokenizer, args.format, args.group_size)
    print(f"{args.scheme} checkpoint ({args.format}) written to {out}")
    return 0


def _cmd_bench(args) -> int:
    from backend.entrypoints.bench.throughput import run_throughput_bench

    run_throughput_bench(args)
    return 0


def _cmd_bench_moe(args) -> int:
    from backend.entrypoints.bench.moe import run_moe_bench

    run_moe_bench(args)
    return 0


def _cmd_bench_lora(args) -> int:
    from backend.entrypoints.bench.lora import run_lora_bench

    run_lora_bench(args)
    return 0


def _cmd_bench_spec(args) -> int:
    from backend.entrypoints.bench.speculative import run_spec_bench

    run_spec_bench(args)
    return 0


def _cmd_bench_kv_pool(args) -> int:
    from backend.entrypoints.bench.kv_pool import run_kv_pool_bench

    run_kv_pool_bench(args)
    return 0


def _cmd_bench_vision(args) -> int:
    from backend.entrypoints.bench.vision import run_vision_bench

    run_vision_bench(args)
    return 0


def _cmd_bench_serving(args) -> int:
    if args.disaggregate:
        from backend.entrypoints.bench.disaggregated import run_disaggregated_bench

        run_disaggregated_bench(args)
        return 0
    from backend.entrypoints.bench.serving import run_serving_bench

    run_serving_bench(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npu-llm", description="LLM serving on Ascend NPUs, CUDA and CPU.")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)

    chat = commands.add_parser("chat", help="chat with a model in the terminal")
    EngineConfig.add_cli_args(chat)
    _sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=_cmd_chat)

    serve = commands.add_parser("serve", help="serve the model repository with NVIDIA Triton")
    from backend.entrypoints.serve import add_serve_args
    from backend.triton.launcher import DEFAULT_REPOSITORY

    add_serve_args(serve)
    serve.set_defaults(func=_cmd_serve)

    gateway = commands.add_parser("gateway", help="OpenAI-compatible HTTP API in front of Triton")
    gateway.add_argument("--triton-url", default="localhost:8001", help="Triton gRPC address")
    gateway.add_argument("--triton-model", default="llm")
    gateway.add_argument("--served-model-name", default=None, help="the model name clients use (default: --tokenizer)")
    gateway.add_argument("--tokenizer", default=DEFAULT_MODEL, help="tokenizer (chat template) of the model")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=9000)
    gateway.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env NPU_LLM_API_KEY)")
    gateway.add_argument("--cors-origin", action="append", help="allowed CORS origin (repeatable)")
    gateway.add_argument("--max-body-bytes", type=int, default=1 << 20,
                         help="the largest request body (images sent as data: URLs count: raise it for big images)")
    gateway.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                         help="vision-language models: file:// image URLs are read from under this folder (else refused)")
    gateway.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                         help="vision-language models: http(s) image URLs are fetched from these hosts only (else "
                              "refused)")
    gateway.add_argument("--tool-call-parser", choices=("auto", "hermes", "llama3_json"), default="auto",
                         help="the model's tool-call format for tool_choice=auto (default: read off its chat template)")
    gateway.add_argument("--reasoning-parser", choices=("auto", "none", "qwen3", "deepseek_r1"), default="auto",
                         help="split a thinking model's <think>...</think> into reasoning_content (default: read off "
                              "its chat template; none where it does not think)")
    gateway.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                         help="disaggregated prefill: the gRPC URLs of the prefill Tritons (kv_producer engines); with "
                              "--decode, the gateway is their proxy (docs/disaggregation.md)")
    gateway.add_argument("--decode", nargs="+", default=[], metavar="URL",
                         help="the gRPC URLs of the decode Tritons (kv_consumer engines)")
    gateway.add_argument("--allow-kv-transfer-params", action="store_true",
                         help="pass a client's kv_transfer_params to the engine (for a proxy in front); else dropped")
    gateway.set_defaults(func=_cmd_gateway)

    ui = commands.add_parser("ui", help="Gradio chat UI (a client of the gateway)")
    ui.add_argument("--gateway-url", default="http://127.0.0.1:9000")
    ui.add_argument("--metrics-url", nargs="+", default=["http://127.0.0.1:8002/metrics"], metavar="URL",
                    help="Triton's metrics endpoint (several: the decode servers of a disaggregated deployment)")
    ui.add_argument("--prefill-metrics-url", nargs="+", default=[], metavar="URL",
                    help="disaggregated: the prefill servers' metrics endpoints, shown as a role of their own")
    ui.add_argument("--api-key", default=None, help="the gateway's API key, if it has one (or env NPU_LLM_API_KEY)")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=7860)
    ui.set_defaults(func=_cmd_ui)

    up = commands.add_parser("up", help="Triton + gateway + chat UI, from one command")
    add_serve_args(up)
    up.add_argument("--host", default="127.0.0.1", help="where the gateway and the UI listen")
    up.add_argument("--gateway-port", type=int, default=9000)
    up.add_argument("--ui-port", type=int, default=7860)
    up.add_argument("--disaggregate", metavar="xPyD", default=None,
                    help="prefill/decode disaggregation on this machine: x prefill and y decode Tritons (e.g. 1P1D), "
                         "the KV moved by Mooncake, the gateway as their proxy (docs/disaggregation.md)")
    up.add_argument("--kv-port", type=int, default=14579,
                    help="with --disaggregate: the first server's KV side channel (server k: + 10 k)")
    up.add_argument("--kv-pool", action="store_true",
                    help="a KV pool over Mooncake Store: start mooncake_master on loopback and give every engine a "
                         "MooncakeStoreConnector (with --disaggregate: prefill servers save, decode servers load; "
                         "docs/kv-pool.md)")
    up.add_argument("--kv-pool-port", type=int, default=50051,
                    help="with --kv-pool: the master's RPC port (its admin and metrics server: + 1)")
    up.set_defaults(func=_cmd_up)

    loadtest = commands.add_parser("loadtest", help="locust load test with a TTFT/ITL/TPOT/throughput report")
    from loadtest.run import add_loadtest_args

    add_loadtest_args(loadtest)
    # the ports of the stack (--start-stack starts it there; otherwise where to find the target)
    add_serve_args(loadtest, engine_flags=False)
    loadtest.add_argument("--gateway-port", type=int, default=9000)
    loadtest.add_argument("--bind-host", dest="host", default="127.0.0.1", help=argparse.SUPPRESS)
    loadtest.set_defaults(func=_cmd_loadtest)

    doctor = commands.add_parser("doctor", help="check the NPU/CUDA/Triton/model setup")
    doctor.add_argument("--model", default=DEFAULT_MODEL)
    doctor.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY),
                        help="whose llm model's layout (data and tensor parallel) to check")
    doctor.add_argument("--engine-arg", action="append", metavar="KEY=VALUE", help="a model.json key, as serve takes it")
    doctor.set_defaults(func=_cmd_doctor)

    verify = commands.add_parser("verify", help="check that the device computes what the CPU computes (fp32 reference)")
    EngineConfig.add_cli_args(verify)
    verify.add_argument("--steps", type=int, default=32, help="decode steps compared per prompt")
    verify.add_argument("--reference", default=None, metavar="MODEL",
                        help="compare with this model instead (a quantized model's unquantized source)")
    verify.set_defaults(func=_cmd_verify)

    quantize = commands.add_parser("quantize", help="write a W8A8 or W8A16 checkpoint of a model "
                                                    "(compressed-tensors or msModelSlim)")
    quantize.add_argument("--model", default=DEFAULT_MODEL, help="an unquantized model folder, GGUF file or name")
    quantize.add_argument("--out", required=True, help="the folder to write (new or empty)")
    quantize.add_argument("--scheme", choices=("w8a8_dynamic", "w8a8", "w8a16"), default="w8a8_dynamic",
                          help="activations quantized per token as the model runs, with calibrated static scales, "
                               "or left in the model's dtype (w8a16)")
    quantize.add_argument("--group-size", type=int, default=None,
                          help="w8a16 in compressed-tensors' format: a weight scale per group of so many input "
                               "features (default: one per output channel)")
    quantize.add_argument("--format", choices=("compressed-tensors", "ascend"), default="compressed-tensors",
                          help="compressed-tensors (llm-compressor's; served with no flag) or ascend (msModelSlim's; "
                               "served with quantization=ascend)")
    quantize.add_argument("--calibration", metavar="FILE.jsonl", default=None,
                          help='calibration text for static scales, one {"text": ...} a line (default: shipped text)')
    quantize.add_argument("--calibration-tokens", type=int, default=512, help="tokens of it to run")
    quantize.add_argument("--tokenizer", default=None, help="the calibration text's tokenizer (default: the model's)")
    quantize.set_defaults(func=_cmd_quantize)

    bench = commands.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="kind", required=True)
    throughput = kinds.add_parser("throughput", help="offline throughput, ours vs. Hugging Face generate")
    EngineConfig.add_cli_args(throughput)
    throughput.add_argument("--num-prompts", type=int, default=64)
    throughput.add_argument("--input-len", default="64:512", help="N or MIN:MAX (uniform)")
    throughput.add_argument("--output-len", type=int, default=128)
    throughput.add_argument("--baseline", choices=("hf", "unconstrained", "none"), default="hf",
                            help="what our run is compared with: transformers' generate, or (with --structured-outputs) "
                                 "the same run unconstrained")
    throughput.add_argument("--structured-outputs", metavar="JSON", default=None,
                            help='constrain every output, e.g. \'{"json": {"type": "array", "minItems": 100}}\'')
    throughput.add_argument("--hf-batch-size", type=int, default=16)
    throughput.add_argument("--profile", dest="profile_dir", metavar="DIR",
                            help="profile the timed run: a trace and a per-step breakdown into DIR")
    throughput.set_defaults(func=_cmd_bench)
    lora = kinds.add_parser("lora", help="output tokens/s with LoRA adapters spread over the requests vs. the base "
                                         "model alone")
    EngineConfig.add_cli_args(lora)
    lora.add_argument("--num-prompts", type=int, default=64)
    lora.add_argument("--input-len", default="64:512", help="N or MIN:MAX (uniform)")
    lora.add_argument("--output-len", type=int, default=128)
    lora.add_argument("--adapters", type=int, default=4, help="random adapters, spread round-robin over the prompts")
    lora.add_argument("--rank", type=int, default=16)
    lora.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
    lora.add_argument("--repeats", type=int, default=2, help="base and LoRA runs, interleaved")
    lora.set_defaults(func=_cmd_bench_lora)
    spec = kinds.add_parser("spec", help="output tokens/s with speculative decoding vs. plain decoding, on chat "
                                         "prompts that copy or lightly edit a passage")
    EngineConfig.add_cli_args(spec)  # (--speculative-config: n-gram, 4 tokens, suffixes of 2-4 when not given)
    spec.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    spec.add_argument("--output-len", type=int, default=128, help="max_tokens (greedy, stops at EOS)")
    spec.add_argument("--repeats", type=int, default=2, help="plain and speculative runs, interleaved")
    spec.add_argument("--deepen", type=int, default=1, metavar="N",
                      help="the model drafts for a target built from it, N times as deep (its copied layers' outputs "
                           "scaled down): a draft model's speed-up without a second checkpoint")
    spec.set_defaults(func=_cmd_bench_spec)
    pool = kinds.add_parser("kv-pool", help="multi-turn chat TTFT with a KV pool (CPU offload; Mooncake Store across "
                                            "two engines) vs. without, turns coming back after leaving the KV cache")
    EngineConfig.add_cli_args(pool)
    pool.add_argument("--conversations", type=int, default=16)
    pool.add_argument("--turns", type=int, default=6)
    pool.add_argument("--system-tokens", type=int, default=1536, help="the shared system prompt's length")
    pool.add_argument("--output-len", type=int, default=32, help="max_tokens of each reply (greedy)")
    pool.add_argument("--kv-blocks", type=int, default=160,
                      help="num_kv_blocks, unless --num-kv-blocks is given: room for a few conversations only")
    pool.add_argument("--offload-gb", type=float, default=1.0, help="kv_offloading_size of the offload run")
    pool.add_argument("--instances", type=int, default=2, help="engines sharing the Mooncake Store (1: no store run)")
    pool.set_defaults(func=_cmd_bench_kv_pool)
    vision = kinds.add_parser("vision", help="a vision-language model's chat request with a picture vs. without: TTFT "
                                             "and output tokens/s")
    EngineConfig.add_cli_args(vision)
    vision.add_argument("--image-size", type=int, default=448, help="the pictures' side, in pixels")
    vision.add_argument("--num-prompts", type=int, default=4, help="requests of each kind, interleaved")
    vision.add_argument("--output-len", type=int, default=64, help="max_tokens (greedy, never stopping early)")
    vision.add_argument("--baseline", choices=("hf", "none"), default="hf",
                        help="hf: transformers' first token of the picture's prompt, in the same dtype")
    vision.set_defaults(func=_cmd_bench_vision)
    moe = kinds.add_parser("moe", help="one MoE layer's experts: the fused CPU kernel vs. the per-expert loop")
    moe.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    moe.add_argument("--experts", type=int, default=64)
    moe.add_argument("--top-k", type=int, default=8)
    moe.add_argument("--hidden", type=int, default=512)
    moe.add_argument("--intermediate", type=int, default=192, help="one expert's intermediate size")
    moe.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    moe.set_defaults(func=_cmd_bench_moe)
    serving = kinds.add_parser("serving", help="serving overhead: in-process vs. Triton gRPC vs. gateway")
    add_serve_args(serving)
    serving.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    serving.add_argument("--gateway-port", type=int, default=9000)
    serving.add_argument("--served-model", default=DEFAULT_MODEL)
    serving.add_argument("--num-prompts", type=int, default=8)
    serving.add_argument("--input-len", default="128")
    serving.add_argument("--output-len", type=int, default=64)
    serving.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64],
                         help="with --disaggregate: the first value is the number of decoding streams")
    serving.add_argument("--disaggregate", metavar="xPyD", default=None,
                         help="compare this disaggregated layout with a colocated stack on a mixed load: decoding "
                              "streams while long prompts arrive (backend/entrypoints/bench/disaggregated.py)")
    serving.add_argument("--kv-port", type=int, default=14579, help=argparse.SUPPRESS)
    serving.add_argument("--long-len", type=int, default=1024, help="with --disaggregate: tokens of a long prompt")
    serving.add_argument("--num-long", type=int, default=6, help="with --disaggregate: long prompts that arrive")
    serving.add_argument("--long-every-s", type=float, default=1.5,
                         help="with --disaggregate: seconds between long arrivals")
    serving.set_defaults(func=_cmd_bench_serving)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        # a bad flag, a missing model or device: one clear line, no traceback
        print(f"npu-llm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
