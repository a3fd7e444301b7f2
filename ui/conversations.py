"""The UI's conversations, as the browser keeps them: a JSON store of conversations, each with its messages (as the
chatbot shows them), its system prompt and sampling settings, and a title (the first user message's, until the
user renames it). Pure functions of the store: each returns a new one. Also a conversation as Markdown (its
export as JSON is the chat request it amounts to: chat_client.chat_request).
"""
from __future__ import annotations

import copy
import time
import uuid

from ui.images import within_budget
from ui.messages import as_openai, is_shown_only, text_of

# the side panel's fields, in the order build_app lays them out
SETTINGS = ("system", "temperature", "top_p", "max_tokens", "seed", "json_mode", "schema", "tools", "tool_choice",
            "model")
UNTITLED = "New chat"
TITLE_CHARS = 40


def empty_store() -> dict:
    return {"current": None, "conversations": []}


def current(store: dict) -> dict | None:
    return next((c for c in store["conversations"] if c["id"] == store["current"]), None)


def title(conversation: dict | None) -> str:
    """The title the user gave it, or the start of its first user message."""
    if conversation is None:
        return UNTITLED
    if conversation.get("title"):
        return conversation["title"]
    first = next((text for m in conversation["messages"]
                  if m["role"] == "user" and not is_shown_only(m) and (text := text_of(m["content"]))), "")
    words = " ".join(first.split())
    return (words[:TITLE_CHARS - 1] + "…" if len(words) > TITLE_CHARS else words) or UNTITLED


def listing(store: dict, query: str = "") -> list[tuple[str, str]]:
    """(title, id) of each conversation whose title holds the query (any case), the last one written to first."""
    query = query.strip().lower()
    newest_first = sorted(store["conversations"], key=lambda c: c["updated"], reverse=True)
    return [(title(c), c["id"]) for c in newest_first if query in title(c).lower()]


def loaded(value) -> dict:
    """The store as the browser handed it back, or an empty one where it is not one (another app's, or damaged)."""
    try:
        kept = [c for c in value["conversations"]
                if isinstance(c["id"], str) and isinstance(c["messages"], list) and isinstance(c["settings"], dict)
                and isinstance(c.get("title", ""), str) and isinstance(c["updated"], (int, float))]
        return {"current": value["current"] if isinstance(value["current"], str) else None, "conversations": kept}
    except (KeyError, TypeError):
        return empty_store()


def saved(store: dict, messages: list[dict], settings: dict) -> dict:
    """The store with the current conversation's messages and settings as they are now. A new chat becomes a
    conversation with its first message, one whose messages changed moves to the top of the list, and an empty
    one (new, or cleared) is not kept."""
    store = copy.deepcopy(store)
    conversation = current(store)
    if not messages:
        store["conversations"] = [c for c in store["conversations"] if c is not conversation]
        return store
    if conversation is None:
        conversation = {"id": uuid.uuid4().hex[:12], "title": "", "messages": [], "settings": {}, "updated": 0.0}
        store["conversations"].append(conversation)
        store["current"] = conversation["id"]
    if conversation["messages"] != messages:
        conversation["messages"], conversation["updated"] = copy.deepcopy(messages), time.time()
    conversation["settings"] = dict(settings)
    return within_budget(store)


def switched(store: dict, conversation_id: str | None) -> dict:
    """The store with that conversation current (None: a new chat, kept once it has a message)."""
    return {**store, "current": conversation_id}


def renamed(store: dict, new_title: str) -> dict:
    """The current conversation titled so (an empty title: its first user message's again)."""
    store = copy.deepcopy(store)
    if (conversation := current(store)) is not None:
        conversation["title"] = " ".join(new_title.split())
    return store


def deleted(store: dict) -> dict:
    """The store without the current conversation, and a new chat current."""
    return {"current": None, "conversations": [c for c in store["conversations"] if c["id"] != store["current"]]}


def as_markdown(name: str, messages: list[dict], settings: dict) -> str:
    """The conversation as a Markdown document: its title, then each message under its role, the system prompt
    first (the thoughts left out, as they are from what the model is sent)."""
    return "\n\n".join([f"# {name}"] + [f"## {m['role'].capitalize()}\n\n{_markdown(m['content'])}"
                                         for m in as_openai(messages, settings["system"])]) + "\n"


def _markdown(content) -> str:
    """A message's content in Markdown: its text, each picture a placeholder (its data would swamp the document)."""
    if isinstance(content, str):
        return content
    return "\n\n".join("🖼️ (picture)" if part["type"] == "image_url" else part["text"] for part in content)
