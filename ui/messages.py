"""The chat's messages as Gradio's chatbot holds them: OpenAI-style role/content dicts, whose content the chatbot
hands back as a list of parts ([{"type": "text", "text": ...}]) even where it was given a string.

A reply is a thought (the model's reasoning, a message with a metadata title, which the chatbot folds away once
its status is done) and then the answer. The thoughts stay on the screen only: the model is sent the conversation
without them, as OpenAI's API expects earlier turns; so do the UI's own notes (an error in place of a reply).
"""
from __future__ import annotations

import json

THINKING, THOUGHT = "💭 Thinking…", "💭 Thought"


def is_thought(message: dict) -> bool:
    return bool((message.get("metadata") or {}).get("title"))


def note(text: str) -> dict:
    """A message of the UI's own (an error, say): shown as the assistant's, but never sent or exported as one."""
    return {"role": "assistant", "content": f"⚠️ {text}", "metadata": {"log": "note"}}


def is_shown_only(message: dict) -> bool:
    """A thought or a note: on the screen, not in what the model is sent."""
    return is_thought(message) or (message.get("metadata") or {}).get("log") == "note"


def text_of(content) -> str:
    """A message's text, from a string or the chatbot's list of parts (a picture's file has none)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return ""
    return "".join(part.get("text") or "" for part in content or [] if isinstance(part, dict))


def as_openai(history: list[dict], system: str) -> list[dict]:
    """The conversation as OpenAI chat messages: the system prompt (if any), then each turn without its thoughts
    (and without the UI's notes); pictures (ui/images.py) as image_url parts of the user message they come before."""
    messages, pictures = [{"role": "system", "content": system}] if system.strip() else [], []
    for m in history:
        if is_shown_only(m):
            continue
        if "image" in m:
            pictures.append({"type": "image_url", "image_url": {"url": m["image"]}})
        elif pictures and m["role"] == "user":
            messages.append({"role": "user", "content": pictures + [{"type": "text", "text": text_of(m["content"])}]})
            pictures = []
        else:
            if pictures:  # (a turn of pictures alone)
                messages.append({"role": "user", "content": pictures})
                pictures = []
            messages.append({"role": m["role"], "content": text_of(m["content"])})
    return messages + ([{"role": "user", "content": pictures}] if pictures else [])


def shown(reasoning: str, answer: str, thinking: bool) -> list[dict]:
    """The reply as the chatbot's messages: the reasoning as a thought (pending while the model thinks), then the
    answer."""
    messages = []
    if reasoning:
        messages.append({"role": "assistant", "content": reasoning,
                         "metadata": {"title": THINKING if thinking else THOUGHT,
                                      "status": "pending" if thinking else "done"}})
    if answer or not reasoning:
        messages.append({"role": "assistant", "content": answer})
    return messages


def settled(messages: list[dict]) -> list[dict]:
    """The messages with a thought cut short (Stop, an error) marked done: no spinner left turning."""
    return [{**m, "metadata": {**m["metadata"], "title": THOUGHT, "status": "done"}}
            if is_thought(m) and m["metadata"].get("status") == "pending" else m for m in messages]


def reply_text(text: str, calls: dict[int, dict]) -> str:
    """The answer as shown: its text, then each tool call as its name and pretty-printed arguments."""
    parts = [text] if text else []
    for _, call in sorted(calls.items()):
        try:
            arguments = json.dumps(json.loads(call["arguments"]), indent=2)
        except json.JSONDecodeError:  # still streaming
            arguments = call["arguments"]
        parts.append(f"🔧 **{call['name']}**\n```json\n{arguments}\n```")
    return "\n\n".join(parts)


def before_reply(history: list[dict], index: int | None = None) -> list[dict]:
    """The conversation up to the user message that the reply at `index` answers (a user message's own index: up to
    it), so the reply can be generated anew; the last reply's when `index` is None. Later turns are dropped."""
    end = len(history) if index is None else min(index + 1, len(history))
    while end and history[end - 1]["role"] != "user":
        end -= 1
    while end < len(history) and "image" in history[end - 1] and history[end]["role"] == "user":
        end += 1  # (a picture's turn goes on to the question sent with it)
    return list(history[:end])
