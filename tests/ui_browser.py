"""The chat UI (`npu-llm ui`) as a real process, and the headless Chromium that drives it (Debian's, through
Playwright), for the UI's tests."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

from tests.conftest import GATEWAY_API_KEY, free_port

CHROMIUM = "/usr/bin/chromium"
# (without the background-networking flags Chromium's calls home are refused by this closed network, many at once)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@contextlib.contextmanager
def running_ui(gateway_url: str, metrics_url: str, log_dir: Path, api_key: str = GATEWAY_API_KEY,
               port: int | None = None):
    """`npu-llm ui` as a real process, a client of `gateway_url` showing the Triton metrics at `metrics_url`;
    yields its URL (on `port`, when given: a restarted UI at the same origin sees the same browser storage)."""
    from backend.entrypoints.serve import wait_http

    port = port or free_port()
    with open(log_dir / f"ui-{port}.log", "a") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "backend.entrypoints.cli", "ui", "--gateway-url", gateway_url, "--metrics-url", metrics_url,
             "--api-key", api_key, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/", process, "the UI", timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(15)


@contextlib.contextmanager
def chromium_page():
    """A page of a new headless Chromium (its own empty storage), 1280x900."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 900})
        finally:
            browser.close()


def open_ui(page, url: str) -> None:
    """The UI (re)loaded, its conversations restored from the browser's storage: the server panel fills in after
    that, which is the one sign waited for. Not the page's "load" event (once, on a fresh clone's CI, it did not
    come in 30 s after a restart of the UI, though the page was served), nor "networkidle" (the page holds a
    heartbeat stream open for its session state)."""
    page.goto(url, wait_until="commit", timeout=60000)
    page.wait_for_function("(p => p && !p.innerText.includes('connecting'))(document.querySelector('#server-panel'))",
                           timeout=60000)


def ask(page, text: str) -> None:
    """Send a message; returns once the chat took it (the box emptied, and with it the last reply's stats line, so
    that reply_done waits for this reply's)."""
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")
    page.wait_for_function("document.querySelector('#message textarea').value === ''", timeout=30000)


def bot_text(page) -> str:
    bots = page.locator("#chatbot .message.bot")
    return bots.last.inner_text() if bots.count() else ""


def chat_rows(page) -> list[str]:
    """Each message on the screen, in order."""
    return [text.strip() for text in page.locator("#chatbot .message-row").all_inner_texts()]


def reply_done(page) -> str:
    """The reply, once its stats line says it is complete (or the chat says the request failed)."""
    page.wait_for_function("(s => s.includes('failed') || ((s.includes('TTFT') || s.includes('no tokens')) && "
                           "!s.includes('streaming')))(document.querySelector('#reply-stats').innerText)",
                           timeout=120000)
    assert "failed" not in page.locator("#reply-stats").inner_text(), bot_text(page)
    return bot_text(page)


def watch_stats(page) -> None:
    """Record every text the stats line shows from now on (window.seenStats)."""
    page.evaluate("""() => { const stats = document.querySelector('#reply-stats'); window.seenStats = [];
        new MutationObserver(() => window.seenStats.push(stats.innerText))
            .observe(stats, {childList: true, subtree: true, characterData: true}); }""")


def set_field(page, field: str, value: str) -> None:
    page.locator(field).fill(value)
    page.locator(field).press("Enter")


def exported(page, button: str, suffix: str) -> str:
    """The file an export button makes (its name ends with suffix), as the browser downloads it."""
    page.locator(button).click()
    page.wait_for_function("s => [...document.querySelectorAll('#export-file a')].some(a => a.href.endsWith(s))",
                           arg=suffix, timeout=30000)
    response = page.request.get(page.locator("#export-file a").first.get_attribute("href"))
    assert response.ok, response.status
    return response.text()
