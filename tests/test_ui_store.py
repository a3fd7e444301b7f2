"""The chat UI's conversation store and messages, as pure functions (the browser tests drive them through the page):
what is kept and in which order, what the model is sent, and the chat request a conversation amounts to."""
from __future__ import annotations

import pytest

from ui import conversations
from ui.chat_client import chat_request
from ui.messages import as_openai, before_reply, note, shown

SETTINGS = {"system": "Be brief.", "temperature": 0.5, "top_p": 0.9, "max_tokens": 64, "seed": -1, "json_mode": False,
            "schema": "", "tools": "", "tool_choice": "auto"}


def _user(text: str) -> dict:  # as the chatbot hands messages back: content as a list of parts
    return {"role": "user", "metadata": None, "content": [{"type": "text", "text": text}], "options": None}


def _answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_a_chat_is_kept_from_its_first_message_and_the_last_written_is_listed_first():
    store = conversations.saved(conversations.empty_store(), [], SETTINGS)
    assert store == conversations.empty_store()  # an empty new chat is not kept
    first = conversations.saved(store, [_user("Why is the sky blue? " * 5)], SETTINGS)
    (kept,) = first["conversations"]
    assert first["current"] == kept["id"] and kept["settings"] == SETTINGS
    assert conversations.title(kept) == "Why is the sky blue? Why is the sky blu…"  # its first message, cut

    second = conversations.saved(conversations.switched(first, None), [_user("Name a river.")], SETTINGS)
    assert [t for t, _ in conversations.listing(second)] == ["Name a river.", conversations.title(kept)]
    again = conversations.saved(conversations.switched(second, kept["id"]), kept["messages"],
                                {**SETTINGS, "temperature": 1.0})  # settings only: the order stays
    assert [t for t, _ in conversations.listing(again)] == ["Name a river.", conversations.title(kept)]
    assert conversations.current(again)["settings"]["temperature"] == 1.0
    moved = conversations.saved(again, kept["messages"] + [_answer("Rayleigh scattering.")], SETTINGS)
    assert [i for _, i in conversations.listing(moved)][0] == kept["id"]


def test_rename_search_delete_and_a_cleared_chat():
    store = conversations.saved(conversations.empty_store(), [_user("Name a river.")], SETTINGS)
    store = conversations.saved(conversations.switched(store, None), [_user("Name a mountain.")], SETTINGS)
    store = conversations.renamed(store, "  Peaks   and  hills ")
    assert [t for t, _ in conversations.listing(store)] == ["Peaks and hills", "Name a river."]
    assert [t for t, _ in conversations.listing(store, "RIVER")] == ["Name a river."]
    assert conversations.title(conversations.current(conversations.renamed(store, ""))) == "Name a mountain."
    gone = conversations.deleted(store)
    assert gone["current"] is None and [t for t, _ in conversations.listing(gone)] == ["Name a river."]
    cleared = conversations.saved(store, [], SETTINGS)  # Clear: an emptied conversation is not kept either
    assert [t for t, _ in conversations.listing(cleared)] == ["Name a river."]


@pytest.mark.parametrize("value", [None, "x", {"current": 3}, {"current": None, "conversations": [{"id": 1}]}])
def test_what_the_browser_hands_back_is_checked(value):
    assert conversations.loaded(value) == conversations.empty_store()


def test_the_model_is_sent_the_turns_without_thoughts_or_the_uis_notes():
    history = [_user("Hi"), *shown("thinking about it", "Hello!", thinking=False), _user("And?"),
               note("The gateway refused the request (400): max_tokens ...")]
    assert as_openai(history, "Be brief.") == [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello!"},
                                              {"role": "user", "content": "And?"}]
    markdown = conversations.as_markdown("Greeting", history, SETTINGS)
    assert markdown == ("# Greeting\n\n## System\n\nBe brief.\n\n## User\n\nHi\n\n## Assistant\n\nHello!\n\n"
                        "## User\n\nAnd?\n")


def test_before_reply_is_the_chat_up_to_the_question_a_reply_answers():
    history = [_user("Q1"), *shown("hmm", "A1", thinking=False), _user("Q2"), _answer("A2")]
    assert before_reply(history) == history[:4]  # the last reply
    assert before_reply(history, 1) == before_reply(history, 2) == history[:1]  # its thought or its answer
    assert before_reply(history, 3) == history[:4]  # a question: its own reply
    assert before_reply([]) == []


def test_the_chat_request_carries_the_settings_and_names_a_box_that_is_not_json():
    chosen = {**SETTINGS, "seed": 7, "json_mode": True, "schema": '{"type": "object"}',
              "tools": '[{"type": "function", "function": {"name": "f"}}]'}
    request = chat_request("m", [_user("Hi")], chosen)
    assert request == {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi"}],
                       "temperature": 0.5, "top_p": 0.9, "max_tokens": 64, "seed": 7,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "reply", "schema": {"type": "object"}}},
                       "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}
    assert "seed" not in chat_request("m", [], SETTINGS)  # -1: random
    with pytest.raises(ValueError, match="the tools list is not valid JSON"):
        chat_request("m", [], {**SETTINGS, "tools": "[{"})
