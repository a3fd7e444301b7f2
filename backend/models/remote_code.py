"""Checkpoints published with remote code, read without running it: the original Qwen (`QWenLMHeadModel`: Qwen-1.8B,
7B, 14B, 72B and their -Chat), whose decoder is Qwen2's, and ChatGLM (`ChatGLMModel`), which is refused, naming its
successors: its decoder is GLM-4's, but its chat format tokenizes each message's parts apart (through SentencePiece),
which the text a chat template renders cannot reproduce.

Qwen (v1) as published: config.json of model_type "qwen" (its own keys), tensors under `transformer.` (q, k and v
fused in `c_attn`, with biases; the MLP's `w1` is up, `w2` the gate, as its `a1 * silu(a2)` computes them), and a
tiktoken vocabulary (`qwen.tiktoken`) with its special tokens after the last rank. Its config becomes a Qwen2Config;
its tensors are renamed onto ours (backend/models/loader.py); its tokenizer is the tiktoken file converted by
transformers' own TikTokenConverter, with Qwen's pre-tokenizer pattern and special tokens, and its chat format
(ChatML) as the chat template. Qwen's dynamic NTK and logn attention act only past `seq_length`, which is therefore
the longest sequence served (max_model_len): up to it the model computes as its remote code does.
"""
from __future__ import annotations

import re
from pathlib import Path

QWEN_V1 = "QWenLMHeadModel"
CHATGLM = ("ChatGLMModel", "ChatGLMForConditionalGeneration")
REMOTE_CODE_ARCHITECTURES = (QWEN_V1,)

# tokenization_qwen.py's
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *(f"<|extra_{i}|>" for i in range(205)))
QWEN_VOCAB_FILE = "qwen.tiktoken"
# Qwen-7B-Chat's chat format (its make_context, chat_format "chatml"), with its default system prompt
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen (v1) tensor names -> ours, after `transformer.h.{i}.` became `model.layers.{i}.`
QWEN_V1_NAMES = {".ln_1.": ".input_layernorm.", ".ln_2.": ".post_attention_layernorm.",
                 ".attn.c_attn.": ".self_attn.qkv_proj.", ".attn.c_proj.": ".self_attn.o_proj.",
                 ".mlp.w1.": ".mlp.up_proj.", ".mlp.w2.": ".mlp.gate_proj.", ".mlp.c_proj.": ".mlp.down_proj."}


def remote_code_config(raw: dict, model_dir: Path):
    """The transformers config a remote-code checkpoint's config.json amounts to (None: not one of those); a
    ValueError naming the checkpoint to serve instead where none is served."""
    architectures = raw.get("architectures") or []
    if any(a in CHATGLM for a in architectures):
        raise ValueError("ChatGLM checkpoints (ChatGLMModel: ChatGLM2, ChatGLM3) are not served: their chat format "
                         "(the remote code's build_chat_input) runs each message's role, metadata line and content "
                         "through SentencePiece apart, which no chat template reproduces, so its prompts would differ "
                         "from the published model's. Serve its successor in transformers' own classes instead: "
                         "THUDM/glm-4-9b-chat-hf (GlmForCausalLM) or GLM-4-9B-0414 (Glm4ForCausalLM)")
    if QWEN_V1 not in architectures:
        return None
    return _qwen_v1_config(raw, model_dir)


def _qwen_v1_config(raw: dict, model_dir: Path):
    from transformers import Qwen2Config

    if raw.get("rotary_pct", 1.0) != 1.0:
        raise ValueError(f"rotary_pct={raw['rotary_pct']}: Qwen checkpoints rotating part of each head are not served")
    heads = raw["num_attention_heads"]
    special = _special_token_ids(model_dir)
    config = Qwen2Config(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_hidden_layers=raw["num_hidden_layers"],
        intermediate_size=raw["intermediate_size"] // 2,  # (Qwen's counts both w1 and w2)
        num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=raw.get("kv_channels", raw["hidden_size"] // heads),
        max_position_embeddings=raw.get("seq_length", raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=raw.get("layer_norm_epsilon", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": float(raw.get("rotary_emb_base", 10000))},
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # (Qwen-Chat's chat() stops on all three)
        eos_token_id=[special[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] if special else None,
    )
    config.architectures = [QWEN_V1]
    return config


def qwen_v1_key(stored: str) -> str:
    """A Qwen (v1) tensor's name in our modules (other names pass as they are)."""
    if not stored.startswith("transformer."):
        return stored
    key = stored.replace("transformer.wte.", "model.embed_tokens.").replace("transformer.ln_f.", "model.norm.")
    key = re.sub(r"^transformer\.h\.(\d+)\.", r"model.layers.\1.", key)
    for theirs, ours in QWEN_V1_NAMES.items():
        key = key.replace(theirs, ours)
    return key


def _special_token_ids(model_dir: Path) -> dict[str, int]:
    """Qwen's special tokens' ids: after the vocabulary's last rank, in their order."""
    vocab = model_dir / QWEN_VOCAB_FILE
    if not vocab.is_file():
        return {}
    first = sum(1 for line in vocab.read_text().splitlines() if line.strip())
    return {token: first + i for i, token in enumerate(QWEN_SPECIAL_TOKENS)}


def qwen_v1_tokenizer(model_dir: Path):
    """Qwen's tokenizer as a fast tokenizer: qwen.tiktoken through transformers' TikTokenConverter, Qwen's pattern,
    NFC and special tokens, <|endoftext|> its end of text, ChatML its chat template."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converted = TikTokenConverter(vocab_file=str(model_dir / QWEN_VOCAB_FILE), pattern=QWEN_PATTERN).converted()
    # after the last rank, in their order (as tokenization_qwen.py numbers them; added here on every transformers)
    converted.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    converted.normalizer = normalizers.NFC()  # (tokenization_qwen.py normalizes every text to NFC first)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=converted, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def is_qwen_v1_folder(path: Path) -> bool:
    """A Qwen (v1) folder as published: its tiktoken vocabulary, no tokenizer.json."""
    return (path / QWEN_VOCAB_FILE).is_file() and not (path / "tokenizer.json").is_file()
