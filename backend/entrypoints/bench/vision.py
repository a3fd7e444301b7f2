"""`npu-llm bench vision`: what a picture costs a chat request on a vision-language model. The same question, asked
with one picture and without, on one engine, one request at a time, interleaved: time to first token (the picture's
tower and its tokens' prefill) and output tokens/s. Each picture is new (a different seed: the encoder cache never
hits); a last round sends the first picture again (the encoder cache hits; the prefix cache is reset first, so that
only the tower is saved). With --baseline hf, transformers' model computes the same prompt's first token (its forward
over the prompt and the picture, in the same dtype) for the TTFT's baseline. One JSON line; only the ratios mean
anything across machines."""
from __future__ import annotations

import json
import statistics
import time

import numpy as np

from backend.config import EngineConfig
from backend.engine.engine import LLMEngine
from backend.engine.sampling_params import SamplingParams

QUESTION = "Describe the picture in detail."


def picture(size: int, seed: int):
    """A size x size picture of smooth colour fields (noise would be no picture a tower sees in use)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    channels = [np.sin(2 * np.pi * (rng.uniform(0.5, 3) * x + rng.uniform(0.5, 3) * y + rng.uniform())) for _ in "rgb"]
    return Image.fromarray(((np.stack(channels, -1) + 1) * 127.5).astype(np.uint8))


def timed(engine: LLMEngine, request_id: str, prompt: dict, max_tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT in s, output tokens/s after the first, the prompt's token ids) of one request run alone."""
    sent = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first = None
    while True:
        for output in engine.step():
            if output.request_id != request_id:
                continue
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter()
            if output.finished:
                decode_s = time.perf_counter() - first
                return first - sent, (len(output.outputs[0].token_ids) - 1) / decode_s, output.prompt_token_ids
        if failure := engine.take_failures().get(request_id):
            raise RuntimeError(f"request {request_id} failed: {failure}")


def hf_first_token_s(model_dir: str, prompt_ids: list[int], image, dtype) -> float:
    """transformers' time to the first token of the prompt with its picture: one forward over both."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    global _hf
    if _hf is None or _hf[0] != model_dir:
        _hf = (model_dir, AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval(),
               AutoImageProcessor.from_pretrained(model_dir))
    _, model, processor = _hf
    ids = torch.tensor([prompt_ids])
    start = time.perf_counter()
    with torch.inference_mode():
        pixels = processor(images=[image], return_tensors="pt")
        model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).long(),
              pixel_values=pixels["pixel_values"].to(dtype), image_grid_thw=pixels["image_grid_thw"],
              logits_to_keep=1)
    return time.perf_counter() - start


_hf = None  # (transformers' model, loaded once)


def run_vision_bench(args) -> dict:
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    dtype = engine.model.dtype
    try:
        if not engine.model.is_multimodal:
            raise SystemExit(f"{args.model}: not a vision-language model")
        tokenizer = engine.tokenizer
        with_image = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], tokenize=False,
            add_generation_prompt=True)
        text_only = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                                  add_generation_prompt=True)
        timed(engine, "warm-up", {"prompt": with_image, "multi_modal_data": {"image": picture(args.image_size, 0)}}, 2)
        runs = {"text": [], "image": []}
        for i in range(args.num_prompts):
            engine.kv.reset_prefix_cache()
            runs["text"].append(timed(engine, f"text-{i}", {"prompt": text_only}, args.output_len))
            engine.kv.reset_prefix_cache()
            image = {"prompt": with_image, "multi_modal_data": {"image": picture(args.image_size, i + 1)}}
            runs["image"].append(timed(engine, f"image-{i}", image, args.output_len))
        engine.kv.reset_prefix_cache()
        again = {"prompt": with_image, "multi_modal_data": {"image": picture(args.image_size, 1)}}
        cached_ttft = timed(engine, "image-again", again, args.output_len)[0]
    finally:
        engine.shutdown()
    summary = {kind: {"mean_ttft_s": round(statistics.mean(r[0] for r in rs), 4),
                      "output_tokens_per_s": round(statistics.mean(r[1] for r in rs), 2),
                      "prompt_tokens": len(rs[0][2])} for kind, rs in runs.items()}
    result = {"model": args.model, "image_size": args.image_size, "num_prompts": args.num_prompts,
              "output_len": args.output_len, **summary,
              "ttft_ratio_image_vs_text": round(summary["image"]["mean_ttft_s"] / summary["text"]["mean_ttft_s"], 3),
              "output_rate_ratio_image_vs_text": round(summary["image"]["output_tokens_per_s"]
                                                       / summary["text"]["output_tokens_per_s"], 3),
              "ttft_image_again_s": round(cached_ttft, 4),
              "ttft_ratio_image_again_vs_new": round(cached_ttft / summary["image"]["mean_ttft_s"], 3)}
    if args.baseline == "hf":
        images = [picture(args.image_size, i + 1) for i in range(args.num_prompts)]
        hf_first_token_s(args.model, runs["image"][0][2], picture(args.image_size, 0), dtype)  # (warm-up, as ours)
        hf = statistics.mean(hf_first_token_s(args.model, runs["image"][0][2], image, dtype) for image in images)
        result["hf_mean_ttft_s"] = round(hf, 4)
        result["ttft_ratio_vs_hf"] = round(summary["image"]["mean_ttft_s"] / hf, 3)
    print(json.dumps(result), flush=True)
    return result
