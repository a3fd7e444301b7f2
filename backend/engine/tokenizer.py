"""The model's tokenizer (transformers) and what the engine needs from it: chat prompts, EOS ids."""
from __future__ import annotations

import json
from pathlib import Path

from backend.models.registry import resolve_model
from backend.models.remote_code import is_qwen_v1_folder, qwen_v1_tokenizer


def load_tokenizer(name_or_path: str | Path):
    """The tokenizer of a folder, a .gguf file or the default model's name (as --tokenizer takes them); a Qwen (v1)
    folder's tiktoken vocabulary, converted (backend/models/remote_code.py)."""
    path = resolve_model(name_or_path)
    if is_qwen_v1_folder(path):
        return qwen_v1_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_template_tokenizer(name_or_path: str | Path):
    """A tokenizer for chat templates and decoding only, without torch (the gateway's): the fast tokenizer of
    tokenizer.json. AutoTokenizer would load torch, through the model config it reads; a folder without
    tokenizer.json still gets it."""
    path = resolve_model(name_or_path)
    if is_qwen_v1_folder(path):
        return qwen_v1_tokenizer(path)  # (no torch either)
    if not (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A text prompt's ids as the engine takes them: with the tokenizer's special tokens, unless the text already
    starts with its BOS (a chat template's rendering carries its own: no second one)."""
    bos = tokenizer.bos_token
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos))) if text else []


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation through the tokenizer's own chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    # the template writes the special tokens itself
    return tokenizer.encode(text, add_special_tokens=False)


def eos_token_ids(model_dir: Path, model_config, tokenizer) -> set[int]:
    """EOS ids from the model config, generation_config.json and the tokenizer (Llama 3 has several)."""
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(model_config, "eos_token_id", None))
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.is_file():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    add(tokenizer.eos_token_id)
    return ids
