"""`npu-llm chat`: an interactive terminal chat on the engine, streaming tokens as they come."""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

from backend.engine.engine import LLMEngine
from backend.engine.sampling_params import SamplingParams
from backend.engine.tokenizer import chat_prompt_ids


def run_chat(engine: LLMEngine, params: SamplingParams, system: str | None, out=sys.stdout, inp=sys.stdin) -> None:
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    print(f"npu-llm chat: {engine.config.model} on {engine.engine_info().device}. Ctrl-C stops a reply, Ctrl-D quits.",
          file=out, flush=True)
    while True:
        out.write("\nyou> ")
        out.flush()
        line = inp.readline()
        if not line:  # end of input
            out.write("\n")
            return
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.strip()})
        reply = _stream_reply(engine, chat_prompt_ids(engine.tokenizer, history), params, out)
        history.append({"role": "assistant", "content": reply})


@contextmanager
def _ctrl_c_sets(stopped: threading.Event):
    """While a reply streams, Ctrl-C (SIGINT) only sets a flag the step loop reads. A KeyboardInterrupt
    could land anywhere, even where Python can only print and drop it (a finalizer, a callback)."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stopped.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stream_reply(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams, out) -> str:
    out.write("bot> ")
    request_id = engine.add_request(None, {"prompt_token_ids": prompt_ids}, params)
    text, stopped = "", threading.Event()
    with _ctrl_c_sets(stopped):
        while engine.has_unfinished_requests() and not stopped.is_set():
            for output in engine.step():
                completion = output.outputs[0]
                out.write(completion.delta)
                out.flush()
                text = completion.text
    if stopped.is_set() and engine.has_unfinished_requests():
        engine.abort_request(request_id)
        engine.step()  # collects the abort
        out.write(" [stopped]")
    failure = engine.take_failures().get(request_id)
    if failure is not None:
        out.write(f" [failed: {failure!r}]")
    out.write("\n")
    return text
