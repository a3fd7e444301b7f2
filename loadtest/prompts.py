"""Prompts for load tests: synthetic ones of a chosen token length, or chat conversations from a JSONL file."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Prompt:
    messages: list[dict]  # for the chat API
    text: str  # the same request as plain text, for Triton's text_input
    max_tokens: int


def parse_range(spec: str) -> tuple[int, int]:
    """"N" or "MIN:MAX"."""
    lo, _, hi = str(spec).partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 0 < lo <= hi:
        raise ValueError(f"bad length range {spec!r}: expected N or MIN:MAX with 0 < MIN <= MAX")
    return lo, hi


class PromptSource:
    def __init__(self, tokenizer, prompt_len: str = "128", max_tokens: str = "64", dataset: str | None = None,
                 seed: int = 0):
        self.tokenizer = tokenizer
        self.prompt_len = parse_range(prompt_len)
        self.max_tokens = parse_range(max_tokens)
        self.rng = random.Random(seed)
        self.conversations = self._load(dataset) if dataset else None
        special = set(tokenizer.all_special_ids)
        # plain-word tokens decode and re-encode stably, so a prompt of N of them is ~N tokens
        self.words = [t for t in range(min(tokenizer.vocab_size, 20000))
                      if t not in special and tokenizer.decode([t]).strip().isalpha()]

    @staticmethod
    def _load(path: str) -> list[list[dict]]:
        conversations = []
        for line in Path(path).read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                conversations.append(item["messages"] if isinstance(item, dict) else item)
        if not conversations:
            raise ValueError(f"{path}: no conversations")
        return conversations

    def next(self) -> Prompt:
        max_tokens = self.rng.randint(*self.max_tokens)
        if self.conversations:
            messages = self.rng.choice(self.conversations)
            text = "\n".join(m["content"] for m in messages)
            return Prompt(messages, text, max_tokens)
        length = self.rng.randint(*self.prompt_len)
        text = self.tokenizer.decode([self.rng.choice(self.words) for _ in range(length)])
        return Prompt([{"role": "user", "content": text}], text, max_tokens)
