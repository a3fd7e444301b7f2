"""Reasoning output (vLLM's `--reasoning-parser`): a thinking model's `<think>…</think>` split off its answer,
into the message's `reasoning_content` and `reasoning` (the field's newer name in vLLM; both are sent).

- `qwen3` (Qwen3, QwQ, SmolLM3): a think block that opens the output is reasoning; so is the start of the output
  when the prompt left one open (a chat template that ends the prompt with `<think>`, as Qwen3.5's and QwQ's
  do). An output that does not start thinking is all answer, `</think>` or not.
- `deepseek_r1`: the output is reasoning until `</think>`, whether or not it writes `<think>` itself (DeepSeek-R1's
  template puts `<think>\\n` in the prompt; older ones left it to the model).

Either way an output cut short inside its thinking is all reasoning, and the think block's tags reach neither
field. The split works on text, so a tokenizer without `<think>` as a token of its own is split the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"
DEEPSEEK_ASSISTANT = "<｜Assistant｜>"  # (full-width bars) DeepSeek's chat templates' assistant turn

_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


def reasoning_parser(tokenizer, setting: str = "auto") -> str | None:
    """The model's reasoning format: the setting when it names one ("none": no parser), else read off the
    tokenizer (None where it cannot tell: the output is all content)."""
    if setting != "auto":
        return None if setting == "none" else setting
    template = getattr(tokenizer, "chat_template", None) or ""
    name = str(getattr(tokenizer, "name_or_path", "")).lower().replace("_", "-")
    if "deepseek-r1" in name or (DEEPSEEK_ASSISTANT in template and THINK_END in template):
        return "deepseek_r1"
    if THINK_START in template:
        return "qwen3"
    return None


def reasoning_delta(text: str) -> dict:
    return {"reasoning_content": text, "reasoning": text}


@dataclass
class ReasoningSplit:
    """One choice's text, as it streams, split into reasoning and content deltas.

    `thinking`: whether output that does not open with `<think>` of its own is reasoning (until `</think>`).
    A tail that may be the start of a tag is held back until the next text tells.
    """

    thinking: bool
    _state: str = _OPENING  # at the output's start: a think block may open it
    _held: str = ""

    def feed(self, text: str) -> list[dict]:
        self._held += text
        parts = []
        if self._state == _OPENING:
            head = self._held.lstrip()
            if head.startswith(THINK_START):
                self._state, self._held = _REASONING, head[len(THINK_START):]
            elif THINK_START.startswith(head):  # only whitespace or part of the tag so far: undecided
                return []
            else:
                self._state = _REASONING if self.thinking else _CONTENT
        if self._state == _REASONING:
            end = self._held.find(THINK_END)
            if end < 0:  # reasoning goes on; keep back what may be the start of </think>
                cut = len(self._held) - _tag_prefix_at_end(self._held, THINK_END)
                reasoning, self._held = self._held[:cut], self._held[cut:]
                return [reasoning_delta(reasoning)] if reasoning else []
            reasoning, self._held = self._held[:end], self._held[end + len(THINK_END):]
            self._state = _CONTENT
            if reasoning:
                parts.append(reasoning_delta(reasoning))
        content, self._held = self._held, ""  # the answer: streams as it comes
        if content:
            parts.append({"content": content})
        return parts

    def finish(self) -> list[dict]:
        """What was held back, at the end of the output (a tag's beginning that never completed)."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self._state == _OPENING:
            self._state = _REASONING if self.thinking else _CONTENT
        return [reasoning_delta(held)] if self._state == _REASONING else [{"content": held}]


def reasoning_split(parser: str, prompt: str, constrained: bool) -> ReasoningSplit:
    """A choice's split. A constrained output (a grammar, a forced tool call) is the answer from its first token:
    this engine applies the grammar from the start (vLLM can hold it back until the thinking ends), so it holds
    reasoning only where the grammar itself writes a think block."""
    if constrained:
        return ReasoningSplit(thinking=False)
    if parser == "deepseek_r1":
        return ReasoningSplit(thinking=True)
    return ReasoningSplit(thinking=prompt.rstrip().endswith(THINK_START))


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (0: none)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)
