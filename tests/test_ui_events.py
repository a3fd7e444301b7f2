"""The chat UI's events as Gradio's server runs them (Blocks.process_api: what a page's requests arrive as), against
the session's gateway, in orders a browser cannot be made to hit on cue: a switch landing between a question and
its reply, or a question sent after a switch that the page has not drawn yet. Each conversation keeps its own
messages, and opening one without changing it leaves the list's order alone."""
from __future__ import annotations

import asyncio

import pytest
from gradio.state_holder import SessionState

from tests.conftest import GATEWAY_API_KEY
from ui.chat import UISettings, build_app
from ui.conversations import listing
from ui.messages import text_of

pytestmark = pytest.mark.slow
VALUES = ["", 0, 0.95, 4, -1, False, "", "", "auto", None]  # the side panel's settings: greedy, 4 tokens, the base model


def _conversation(cid: str, question: str, answer: str, updated: float) -> dict:
    return {"id": cid, "title": "", "updated": updated, "settings": {},
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def _texts(store: dict) -> dict[str, list[str]]:
    return {c["id"]: [text_of(m["content"]) for m in c["messages"]] for c in store["conversations"]}


class Page:
    """One browser page's requests to the app (one Gradio session), by handler name."""

    def __init__(self, app):
        self.app, self.state, self.fns = app, SessionState(app), {}
        for fn in app.fns.values():
            self.fns.setdefault(fn.name, fn)

    async def call(self, name: str, inputs: list, event: str = "event") -> dict:
        """The handler's answer; for a stream, its first output only (the rest waits, as if still in flight)."""
        return await self.app.process_api(self.fns[name], inputs, state=self.state, session_hash="page",
                                          event_id=event)

    async def to_the_end(self, name: str, inputs: list, event: str) -> None:
        out = await self.call(name, inputs, event)
        while out["is_generating"]:
            out = await self.app.process_api(self.fns[name], [], state=self.state, iterator=out["iterator"],
                                             session_hash="page", event_id=event)

    @property
    def session(self):
        return self.state[self.fns["restore"].inputs[0]._id]


def test_a_switch_and_a_question_in_either_order_leave_each_conversation_its_own(gateway):
    app = build_app(UISettings(gateway_url=gateway, api_key=GATEWAY_API_KEY))
    QUESTION = {"text": "Name a color.", "files": []}  # (the message box's value)

    async def scenario(order: str) -> dict:
        page = Page(app)
        stored = {"current": "c1", "conversations": [_conversation("c1", "one", "1", 1.0),
                                                     _conversation("c2", "two", "2", 2.0)]}
        await page.call("restore", [None, stored, ""])
        if order == "question, then switch":
            await page.call("send_message", [None, stored, QUESTION, "", *VALUES], "reply")  # (the question)
            await page.call("switch", [None, stored, "c2", "", *VALUES], "switch")
        else:  # the question's request was sent before the switch's answer reached the page
            await page.call("switch", [None, stored, "c2", "", *VALUES], "switch")
            await page.to_the_end("send_message", [None, stored, QUESTION, "", *VALUES], "reply")
        return page.session.store

    async def viewing(page: Page) -> list:
        stored = {"current": "c1", "conversations": [_conversation("c1", "one", "1", 1.0),
                                                     _conversation("c2", "two", "2", 2.0)]}
        await page.call("restore", [None, stored, ""])
        before = listing(page.session.store)
        for cid in ("c2", "c1", "c2"):
            await page.call("switch", [None, stored, cid, "", *VALUES], "switch")
        return [before, listing(page.session.store)]

    async def all_of_it():
        return (await scenario("question, then switch"), await scenario("switch, then question"),
                await viewing(Page(app)))

    cut, answered, (before, after) = asyncio.run(all_of_it())
    # the reply the switch cut off: its question stays with its conversation, the other is untouched
    assert cut["current"] == "c2" and _texts(cut) == {"c1": ["one", "1", "Name a color."], "c2": ["two", "2"]}
    # the question asked once c2 was current: answered there, after c2's own messages
    texts = _texts(answered)
    assert texts["c1"] == ["one", "1"] and texts["c2"][:3] == ["two", "2", "Name a color."], texts
    assert len(texts["c2"]) == 4 and texts["c2"][3]
    assert before == after == [("two", "c2"), ("one", "c1")]
