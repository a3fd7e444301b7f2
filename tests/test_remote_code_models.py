"""Checkpoints published with remote code, served without running it: a Qwen (v1) checkpoint written in its published
layout (config keys, `transformer.` tensors with q/k/v fused in c_attn, w1/w2, a qwen.tiktoken vocabulary) from a
random transformers Qwen2 model equals that model's greedy tokens, alone and over two ranks; its tokenizer encodes
and decodes as the published one does (tiktoken with Qwen's pattern and special tokens); ChatGLM is refused, naming
what to serve instead."""
from __future__ import annotations

import base64
import json
import unicodedata

import pytest
import torch
from safetensors.torch import save_file

from backend import LLM, SamplingParams
from backend.models.remote_code import QWEN_PATTERN, QWEN_SPECIAL_TOKENS
from tests.conftest import TINY, greedy_tokens, hf_model, make_tiny_model

TEXTS = ["Hello, world! How are you today?", "  leading spaces and\ttabs\n\nnew lines",
         "数字 12345 and 3.14159, émigré café", "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>"]
DECOMPOSED = "cafe\u0301"  # (Qwen's tokenizer reads it as NFC's "café")


def _byte_level_vocab(tokenizer_dir) -> list[bytes]:
    """The default model's byte-level BPE vocabulary as bytes, in its ids' order (special tokens left out)."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    ordered = sorted((i, token) for token, i in tokenizer.get_vocab().items() if token not in special)
    return [bytes(to_byte[char] for char in token) for _, token in ordered]


@pytest.fixture(scope="module")
def qwen_v1_dir(tmp_path_factory, default_model_dir):
    """A Qwen (v1) folder as published, and the transformers Qwen2 model it was written from (its reference)."""
    path = tmp_path_factory.mktemp("qwen-v1")
    ranks = _byte_level_vocab(default_model_dir)
    (path / "qwen.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    vocab = -(-(len(ranks) + len(QWEN_SPECIAL_TOKENS)) // 64) * 64  # (padded, as Qwen pads 151851 to 151936)
    reference_dir = make_tiny_model("qwen2", path / "reference", vocab_size=vocab, num_key_value_heads=4,
                                    tie_word_embeddings=False)
    from safetensors.torch import load_file

    ours = load_file(str(reference_dir / "model.safetensors"))
    tensors = {"transformer.wte.weight": ours["model.embed_tokens.weight"], "transformer.ln_f.weight":
               ours["model.norm.weight"], "lm_head.weight": ours["lm_head.weight"]}
    for i in range(TINY["num_hidden_layers"]):
        layer, theirs = f"model.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            tensors[f"{theirs}attn.c_attn.{kind}"] = torch.cat([ours[f"{layer}self_attn.{p}_proj.{kind}"]
                                                                for p in "qkv"])
        tensors |= {f"{theirs}ln_1.weight": ours[f"{layer}input_layernorm.weight"],
                    f"{theirs}ln_2.weight": ours[f"{layer}post_attention_layernorm.weight"],
                    f"{theirs}attn.c_proj.weight": ours[f"{layer}self_attn.o_proj.weight"],
                    f"{theirs}mlp.w1.weight": ours[f"{layer}mlp.up_proj.weight"],
                    f"{theirs}mlp.w2.weight": ours[f"{layer}mlp.gate_proj.weight"],
                    f"{theirs}mlp.c_proj.weight": ours[f"{layer}mlp.down_proj.weight"]}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    heads = TINY["num_attention_heads"]
    (path / "config.json").write_text(json.dumps({
        "architectures": ["QWenLMHeadModel"], "model_type": "qwen",
        "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig", "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
        "hidden_size": TINY["hidden_size"], "intermediate_size": 2 * TINY["intermediate_size"],
        "kv_channels": TINY["hidden_size"] // heads, "layer_norm_epsilon": TINY["rms_norm_eps"],
        "max_position_embeddings": 8192, "seq_length": TINY["max_position_embeddings"], "no_bias": True,
        "num_attention_heads": heads, "num_hidden_layers": TINY["num_hidden_layers"], "rotary_emb_base": 1000000.0,
        "rotary_pct": 1.0, "use_dynamic_ntk": True, "use_logn_attn": True, "tie_word_embeddings": False,
        "tokenizer_class": "QWenTokenizer", "vocab_size": vocab}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "QWenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}}))
    return path, reference_dir, ranks


def _published_encoding(ranks: list[bytes]):
    """What Qwen's own tokenizer (tokenization_qwen.py) builds from qwen.tiktoken: a tiktoken Encoding."""
    import tiktoken

    return tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks={t: i for i, t in enumerate(ranks)},
                             special_tokens={t: len(ranks) + i for i, t in enumerate(QWEN_SPECIAL_TOKENS)})


def test_the_tokenizer_encodes_and_decodes_as_the_published_one(qwen_v1_dir):
    from backend.engine.tokenizer import load_template_tokenizer, load_tokenizer

    path, _, ranks = qwen_v1_dir
    published = _published_encoding(ranks)
    for tokenizer in (load_tokenizer(path), load_template_tokenizer(path)):
        for text in TEXTS:
            ids = tokenizer.encode(text)
            assert ids == published.encode(text, allowed_special="all"), text
            assert tokenizer.decode(ids) == text
        assert tokenizer.encode(DECOMPOSED) == published.encode(unicodedata.normalize("NFC", DECOMPOSED))
        assert tokenizer.eos_token == "<|endoftext|>"
        assert tokenizer.convert_tokens_to_ids("<|im_end|>") == len(ranks) + 2


def test_greedy_tokens_equal_the_model_it_was_written_from(qwen_v1_dir):
    """Through a chat (ChatML, as Qwen-Chat's make_context writes it), alone and over two ranks; the prompt is the
    published tokenizer's ids."""
    path, reference_dir, ranks = qwen_v1_dir
    expected_model = hf_model(reference_dir)
    for ranks_count in (1, 2):
        with LLM(model=str(path), dtype="float32", block_size=16, tensor_parallel_size=ranks_count) as llm:
            [output] = llm.chat([{"role": "user", "content": "Name a colour."}],
                                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1))
            prompt, completion = output.prompt_token_ids, output.outputs[0]
            assert prompt[:3] == _published_encoding(ranks).encode("<|im_start|>system\n", allowed_special="all")
            assert completion.token_ids == greedy_tokens(expected_model, prompt, 12)
            # and each token's logprob (a tiny random model's greedy tokens alone would hide a swapped gate and up)
            with torch.no_grad():
                logits = expected_model(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1:-1]
            expected = logits.log_softmax(-1).gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            ours = torch.tensor([entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)])
            assert (ours - expected).abs().max() < 1e-3
            assert llm.engine.config.max_model_len == TINY["max_position_embeddings"]  # (seq_length: no NTK, no logn)


def test_chatglm_is_refused_naming_what_to_serve(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ChatGLMModel"], "model_type": "chatglm"}))
    with pytest.raises(Exception, match="glm-4-9b-chat-hf"):
        LLM(model=str(tmp_path))
