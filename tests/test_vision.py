"""Qwen2.5-VL and Qwen3-VL: tiny random checkpoints in their published layout, served with images (vLLM's
multi_modal_data), equal transformers' greedy tokens and logprobs in fp32 with one and two images of different sizes,
with chunked prefill splitting an image's tokens, a prefix-cache hit with the same image and none with another, and
preemption; the vision tower runs once per image (the encoder cache); two ranks equal one; bad images and mismatched
placeholders fail at admission."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from tests.conftest import make_tiny_qwen_vl, random_image

STEPS = 12


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory, default_model_dir):
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_5_vl"), default_model_dir)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def each_vl_dir(request, tmp_path_factory, default_model_dir):
    return make_tiny_qwen_vl(tmp_path_factory.mktemp(request.param), default_model_dir, request.param)


def _prompt(tokenizer, num_images: int, text: str) -> str:
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def _transformers_greedy(model_dir, prompt_ids: list[int], images: list, steps: int):
    """transformers' greedy tokens and each one's logprob, without a KV cache (every step sees the whole sequence)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    pixels = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt") if images else {}
    ids, logprobs = torch.tensor([prompt_ids]), []
    with torch.no_grad():
        for _ in range(steps):
            kinds = (ids == model.config.image_token_id).long()
            logits = model(input_ids=ids, mm_token_type_ids=kinds, **pixels).logits[0, -1].log_softmax(-1)
            ids = torch.cat((ids, logits.argmax().reshape(1, 1)), dim=1)
            logprobs.append(float(logits.max()))
    return ids[0, len(prompt_ids):].tolist(), logprobs


def _greedy(llm, prompts: list[dict]):
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1))
    return outputs


def test_greedy_tokens_equal_transformers_with_chunks_hits_and_preemption(each_vl_dir):
    """One image, two images of different sizes, the first again (a prefix hit), the first's text with another
    image (no hit past the image's first block), and a text-only prompt: all equal transformers, in a step budget
    smaller than an image's tokens (chunked prefill splits them) and a cache too small for all at once (preemption)."""
    first, second, other = random_image(84, 56, 1), random_image(40, 30, 2), random_image(84, 56, 3)
    vl_dir = each_vl_dir
    with LLM(model=str(vl_dir), dtype="float32", block_size=16, max_num_batched_tokens=20, num_kv_blocks=8,
             max_num_seqs=4) as llm:
        tokenizer = llm.get_tokenizer()
        cases = [([first], _prompt(tokenizer, 1, "What is this?")),
                 ([first, second], _prompt(tokenizer, 2, "Compare the two.")),
                 ([first], _prompt(tokenizer, 1, "What is this?")),
                 ([other], _prompt(tokenizer, 1, "What is this?")),
                 ([], _prompt(tokenizer, 0, "No picture here."))]
        outputs = _greedy(llm, [{"prompt": p, "multi_modal_data": {"image": images}} for images, p in cases])
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        assert llm.engine.kv.num_free_blocks == 8  # every block back in the pool
        # the first image's 6 tokens span a chunk boundary of a 20-token budget: its tower ran once all the same
        assert llm.engine.runner.encoder_cache.encoder_runs == 3  # first, second, other
    for (images, _), output in zip(cases, outputs):
        expected, logprobs = _transformers_greedy(vl_dir, output.prompt_token_ids, images, STEPS)
        completion = output.outputs[0]
        assert completion.token_ids == expected
        ours = [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(vl_dir):
    """A prompt whose image comes early and whose text is long: sent again with the same image, its blocks come from
    the prefix cache; with another image of the same size (the same token ids), none past the image do."""
    image, other = random_image(84, 56, 1), random_image(84, 56, 4)
    with LLM(model=str(vl_dir), dtype="float32", block_size=16) as llm:
        prompt = _prompt(llm.get_tokenizer(), 1, "Describe it in words. " * 12)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        [base] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params)
        [again] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params)
        [swapped] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": other}}, params)
        assert swapped.prompt_token_ids == base.prompt_token_ids  # the same placeholder tokens
        image_start = base.prompt_token_ids.index(llm.engine.model_config.vision_language.image_token_id)
        assert again.metrics.num_cached_tokens >= len(base.prompt_token_ids) - 16
        assert swapped.metrics.num_cached_tokens <= image_start // 16 * 16  # nothing from the image's first block on
        assert llm.engine.runner.encoder_cache.encoder_runs == 2  # (the image again: from the encoder cache)


def test_palette_images_are_told_apart(vl_dir):
    """Two palette images of the same indices and different colours are two images (the hash is of the pixels)."""
    from PIL import Image

    indices = Image.new("P", (56, 56))
    red, blue = indices.copy(), indices.copy()
    red.putpalette([255, 0, 0] * 256)
    blue.putpalette([0, 0, 255] * 256)
    with LLM(model=str(vl_dir), dtype="float32", block_size=16) as llm:
        prompt = _prompt(llm.get_tokenizer(), 1, "Which colour?")
        for image in (red, blue):
            llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, SamplingParams(max_tokens=1))
        assert llm.engine.runner.encoder_cache.encoder_runs == 2


def test_bad_images_and_placeholders_fail_at_admission(vl_dir):
    """Each refusal names what is wrong, and the engine serves the next request."""
    image = random_image(28, 28, 5)
    with LLM(model=str(vl_dir), dtype="float32", block_size=16, limit_mm_per_prompt={"image": 1}) as llm:
        tokenizer = llm.get_tokenizer()
        one, two = _prompt(tokenizer, 1, "Hi"), _prompt(tokenizer, 2, "Hi")
        params = SamplingParams(max_tokens=2)
        refusals = {
            "2 image placeholder": {"prompt": two, "multi_modal_data": {"image": [image]}},
            "At most 1 image": {"prompt": two, "multi_modal_data": {"image": [image, image]}},
            "expected a PIL image": {"prompt": one, "multi_modal_data": {"image": b"not an image"}},
            "multi_modal_data must be": {"prompt": one, "multi_modal_data": {"video": [image]}},
        }
        for message, prompt in refusals.items():
            with pytest.raises(ValueError, match=message):
                llm.generate(prompt, params)
        assert llm.generate({"prompt": one, "multi_modal_data": {"image": image}}, params)[0].outputs[0].token_ids


def test_a_text_only_model_refuses_images(default_model_dir):
    with LLM(model=str(default_model_dir), dtype="float32") as llm:
        with pytest.raises(ValueError, match="takes text only"):
            llm.generate({"prompt": "Hi", "multi_modal_data": {"image": random_image(28, 28, 6)}})


def test_two_ranks_equal_one(vl_dir):
    """Tensor parallel: the decoder sharded over two ranks (gloo), the tower on each; the same greedy tokens."""
    image = random_image(84, 56, 7)
    outputs = []
    for ranks in (1, 2):
        with LLM(model=str(vl_dir), dtype="float32", block_size=16, max_num_batched_tokens=20,
                 tensor_parallel_size=ranks) as llm:
            prompt = _prompt(llm.get_tokenizer(), 1, "Describe it.")
            outputs.append(_greedy(llm, [{"prompt": prompt, "multi_modal_data": {"image": image}}])[0])
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_a_draft_head_is_refused_for_a_vision_language_model(vl_dir):
    """MTP and EAGLE heads rotate by plain positions: refused at load, naming what drafts instead."""
    with pytest.raises(Exception, match="not served for a vision-language model"):
        LLM(model=str(vl_dir), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 1})


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_the_vision_tower_on_the_npu_equals_the_cpu_path(fake_npu, arch, tmp_path, default_model_dir):
    """On the (fake) NPU the tower rotates with npu_rotary_mul and attends with npu_fused_infer_attention_score in
    TND layout (sparse_mode 0, heads of 16 padded to 192): its image embeddings equal the CPU path's in bf16."""
    from transformers import AutoImageProcessor

    from backend.models.loader import load_model
    from npu_llm_kernels import ops_for

    model_dir = make_tiny_qwen_vl(tmp_path / arch, default_model_dir, arch)
    _sharpen_vision_attention(model_dir)
    pixels = AutoImageProcessor.from_pretrained(model_dir)(images=[random_image(84, 56, 9)], return_tensors="pt")
    grid = tuple(int(n) for n in pixels["image_grid_thw"][0])
    embeddings = {}
    for device in ("npu", "cpu"):
        model, _, _ = load_model(model_dir, ops_for(device), device=device, dtype="bfloat16")
        with torch.inference_mode():
            embeddings[device] = model.encode_image(pixels["pixel_values"], grid).float().cpu()
    assert fake_npu.calls["npu_rotary_mul"] > 0 and fake_npu.calls["npu_fused_infer_attention_score"] > 0
    # (bf16 rounding apart, about 6e-4 here; without the rotary the NPU's embeddings part by 2e-2)
    torch.testing.assert_close(embeddings["npu"], embeddings["cpu"], atol=4e-3, rtol=0)
    # heads the fused attention does not take are refused, as the op refuses them
    q = torch.zeros(4, 2, 80, dtype=torch.bfloat16, device="npu")
    with pytest.raises(Exception, match="heads of 128 or 192"):
        fake_npu.npu_fused_infer_attention_score(q, q, q, actual_seq_lengths=[4], actual_seq_lengths_kv=[4],
                                                 num_heads=2, num_key_value_heads=2, input_layout="TND", scale=1.0)


def _sharpen_vision_attention(model_dir) -> None:
    """The tower made to show its picture: no biases, and the attention's weights scaled up (at the init's scale it
    is near uniform and a small share of the residual stream, and a wrong rotary or window hardly shows)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(path)
    for name in [n for n in weights if "visual." in n]:
        if name.endswith("bias"):
            weights[name].zero_()  # (the fixture's large biases would swamp what the picture adds)
        elif name.endswith(("attn.qkv.weight", "attn.proj.weight")):
            weights[name] *= 8  # (and the attention's share of the residual stream made to matter)
    save_file(weights, path, metadata={"format": "pt"})
