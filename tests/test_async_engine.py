"""AsyncEngine: concurrent streams, abort on early exit, errors confined to their requests."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from backend.engine.async_engine import AsyncEngine
from backend.engine.engine import LLMEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine.from_config(EngineConfig(dtype="float32", num_kv_blocks=256))
    yield eng
    eng.shutdown()


async def _collect(engine, prompt, params, request_id=None):
    deltas, last = [], None
    async for output in engine.generate(prompt, params, request_id):
        deltas.append(output.outputs[0].delta)
        last = output
    return "".join(deltas), last


async def _wait_idle(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def test_concurrent_streams_match_offline_results(engine):
    prompts = ["The capital of France is", "Water boils at", "My favourite colour is", "1 + 1 ="]
    params = SamplingParams(temperature=0, max_tokens=12)

    async def main():
        return await asyncio.gather(*(_collect(engine, p, params) for p in prompts))

    results = asyncio.run(main())
    offline = LLM(dtype="float32", num_kv_blocks=64).generate(prompts, params)
    for (streamed, last), reference in zip(results, offline):
        assert last.finished
        assert streamed == last.outputs[0].text == reference.outputs[0].text
        assert last.metrics.arrival_time <= last.metrics.first_token_time <= last.metrics.finish_time


def test_leaving_a_stream_aborts_and_frees(engine):
    async def main():
        stream = engine.generate("Tell me a long story.", SamplingParams(max_tokens=300, ignore_eos=True))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        return await _wait_idle(engine)

    stats = asyncio.run(main())
    assert stats.num_generation_tokens < 300


def test_invalid_request_raises_at_the_caller_and_others_go_on(engine):
    async def main():
        good = asyncio.create_task(_collect(engine, "Hello", SamplingParams(temperature=0, max_tokens=8)))
        with pytest.raises(ValueError, match="prompt is empty"):
            await _collect(engine, "", SamplingParams())
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(engine, {"prompt_token_ids": [3] * 10_000}, SamplingParams())
        return await good

    text, last = asyncio.run(main())
    assert last.finished and text


def test_explicit_abort_ends_the_stream_with_abort(engine):
    async def main():
        params = SamplingParams(max_tokens=500, ignore_eos=True)  # still running when the abort comes
        task = asyncio.create_task(_collect(engine, "Count to a thousand:", params, "victim"))
        await asyncio.sleep(0.5)
        engine.abort("victim")
        return await task

    _, last = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"


def test_failing_step_fails_its_requests_not_the_loop(engine, monkeypatch):
    runner = engine.engine.runner
    original = runner.execute
    calls = {"n": 0}

    def flaky(chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return original(chunks)

    monkeypatch.setattr(runner, "execute", flaky)

    async def main():
        with pytest.raises(RuntimeError, match="injected device fault"):
            await _collect(engine, "first", SamplingParams(max_tokens=4))
        await _wait_idle(engine)
        return await _collect(engine, "second", SamplingParams(temperature=0, max_tokens=4))

    text, last = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason in ("length", "stop")



def test_the_engine_is_built_on_its_step_thread_and_a_failed_build_raises_here(monkeypatch, tmp_path):
    """Built on the step thread, the engine's torch work has one OpenMP pool (docs/performance.md, "One OpenMP
    pool"); a model that cannot load still raises at the caller, and leaves no step thread behind."""
    built_on = []
    build = LLMEngine.__init__

    def recording_build(self, config):
        built_on.append(threading.current_thread())
        build(self, config)

    monkeypatch.setattr(LLMEngine, "__init__", recording_build)
    eng = AsyncEngine.from_config(EngineConfig(dtype="float32", num_kv_blocks=64))
    try:
        assert built_on == [eng._thread] and eng._thread is not threading.current_thread()
    finally:
        eng.shutdown()
    with pytest.raises(Exception, match="no-such-model"):
        AsyncEngine.from_config(EngineConfig(model=str(tmp_path / "no-such-model"), dtype="float32"))
    assert len(built_on) == 2
    built_on[1].join(5)  # (it ends right after handing over the error)
    assert not built_on[1].is_alive()
