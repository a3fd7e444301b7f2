"""One request can't harm another: bad parameters are refused at the door, a failure while sampling or
detokenizing one request ends that request alone, ids can be reused safely, and a dead engine says so."""
from __future__ import annotations

import asyncio

import pytest

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from backend.engine import step_runner as step_runner_module
from backend.engine.async_engine import AsyncEngine, EngineDeadError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, seed=i, max_tokens=10, ignore_eos=True) for i in range(3)]
PROMPTS = ["The capital of France is", "Water boils at", "My favourite colour is"]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy tokens when it runs by itself."""
    return {p: llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS}


@pytest.fixture(scope="module")
def alone_seeded(llm):
    """Each prompt's seeded samples (SEEDED[i]) when it runs by itself."""
    return {p: llm.generate(p, SEEDED[i])[0].outputs[0].token_ids for i, p in enumerate(PROMPTS)}


def _run(engine):
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    return outputs


def test_parameters_the_model_cannot_take_are_refused_by_add_request(llm):
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("bad", "hi", SamplingParams(stop_token_ids=[vocab], min_tokens=2))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("bad", "hi", SamplingParams(n=9))
    for prompt in (["a", "b"], [1.5, 2], None, 3, {"prompt_token_ids": "abc"}, [True]):
        with pytest.raises(ValueError, match="prompt"):
            engine.add_request("bad", prompt, GREEDY)
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0


def test_a_request_whose_sampling_fails_fails_alone(llm, alone_seeded, monkeypatch):
    real_sample = step_runner_module.sample

    def sample(logits, requests, drafts=None, ahead=None):
        sampled = real_sample(logits, requests, drafts, ahead)  # the batch's seeded generators have drawn: a late failure
        if any(r.params.seed == 666 for r in requests):
            raise RuntimeError("injected sampler fault")
        return sampled

    monkeypatch.setattr(step_runner_module, "sample", sample)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"good-{i}", prompt, SEEDED[i])
    engine.add_request("poison", "Tell me a story.", SamplingParams(seed=666, max_tokens=10))
    outputs = _run(engine)
    failures = engine.take_failures()
    assert list(failures) == ["poison"] and "injected sampler fault" in str(failures["poison"])
    assert "poison" not in outputs
    for i, prompt in enumerate(PROMPTS):  # the same seeded samples as alone: the failed batch's draws were rewound
        assert outputs[f"good-{i}"].outputs[0].token_ids == alone_seeded[prompt]
        assert outputs[f"good-{i}"].outputs[0].finish_reason == "length"
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0


def test_a_request_whose_detokenizer_fails_fails_alone(llm, alone):
    engine = llm.engine
    engine.add_request("good", PROMPTS[0], GREEDY)
    engine.add_request("poison", PROMPTS[1], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=10))
    for state in engine.outputs.parents["poison"].states:  # a tokenizer that breaks on this request's text
        state.detokenizer.tokenizer = None
    outputs = _run(engine)
    assert list(engine.take_failures()) == ["poison"]
    assert outputs["good"].outputs[0].token_ids == alone[PROMPTS[0]]
    assert engine.stats().kv_cache_usage == 0


def test_offline_generate_raises_for_a_failed_request_and_leaves_the_engine_clean(llm, alone, monkeypatch):
    real_execute = llm.engine.runner.execute
    monkeypatch.setattr(llm.engine.runner, "execute", lambda chunks: 1 / 0)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.setattr(llm.engine.runner, "execute", real_execute)
    assert not llm.engine.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == [alone[p] for p in PROMPTS]


def test_a_stop_string_is_not_cut_out_of_the_text_while_min_tokens_forbids_stopping(llm):
    prompt = "Count from one to ten in words: one, two, three,"
    [full] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))
    assert " five" in full.outputs[0].text
    [held] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[" five"], min_tokens=8))
    out = held.outputs[0]
    tokenizer = llm.get_tokenizer()
    # " five" came before min_tokens: it stays in the text, which matches the tokens, and generation went on
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.text.startswith(full.outputs[0].text[: full.outputs[0].text.index(" five") + 5])
    assert len(out.token_ids) > 8


def test_output_logprobs_are_a_snapshot(llm):
    engine = llm.engine
    engine.add_request("lp", PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            first = first or output
    assert len(first.outputs[0].logprobs) == len(first.outputs[0].token_ids) == 1


@pytest.fixture(scope="module")
def async_engine():
    engine = AsyncEngine.from_config(EngineConfig(dtype="float32", num_kv_blocks=256, max_num_seqs=8))
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params, request_id=None):
    last = None
    async for output in engine.generate(prompt, params, request_id):
        last = output
    return last


def test_a_reused_request_id_is_not_aborted_by_its_predecessor(async_engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        stream = async_engine.generate("Tell me a long story.", SamplingParams(max_tokens=200), "same-id")
        async for _ in stream:
            break  # leaves early: aborts "same-id"
        await stream.aclose()
        return await _collect(async_engine, PROMPTS[0], params, "same-id")

    last = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 12


def test_a_prompt_of_the_wrong_type_is_refused_and_the_engine_goes_on(async_engine):
    async def main():
        with pytest.raises(ValueError, match="prompt token ids"):
            await _collect(async_engine, ["a", "b"], SamplingParams())
        return await _collect(async_engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))

    assert asyncio.run(main()).finished
    assert async_engine.is_running


@pytest.fixture
def tiny_engine(tiny_llama_dir, default_model_dir):
    deaths = []
    config = EngineConfig(model=str(tiny_llama_dir), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=64)
    engine = AsyncEngine.from_config(config, on_dead=deaths.append)
    engine.deaths = deaths
    yield engine
    engine.shutdown(timeout=5)


async def _first_output_then(engine, fault):
    """A long request; once its first output is out, fault() breaks the engine; returns the stream."""
    stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
    await anext(stream)
    fault()
    return stream


def test_a_dead_engine_fails_every_stream_and_refuses_new_ones(tiny_engine):
    def break_scheduler():  # a failure no request owns: the engine's state is suspect
        tiny_engine.engine.scheduler.schedule = lambda: 1 / 0

    async def main():
        stream = await _first_output_then(tiny_engine, break_scheduler)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await _collect(tiny_engine, [1, 2, 3], SamplingParams())

    asyncio.run(main())
    assert not tiny_engine.is_running
    assert len(tiny_engine.deaths) == 1 and isinstance(tiny_engine.deaths[0], ZeroDivisionError)


def test_forward_passes_failing_in_a_row_stop_the_engine(tiny_engine):
    def break_device():
        tiny_engine.engine.runner.execute = lambda chunks: 1 / 0

    async def main():
        stream = await _first_output_then(tiny_engine, break_device)
        with pytest.raises(ZeroDivisionError):  # the first failures fail their requests only
            async for _ in stream:
                pass
        for _ in range(step_runner_module.MAX_FAILED_STEPS - 1):
            with pytest.raises((ZeroDivisionError, EngineDeadError)):
                await _collect(tiny_engine, [1, 2, 3], SamplingParams())
        with pytest.raises(EngineDeadError):
            await _collect(tiny_engine, [1, 2, 3], SamplingParams())

    asyncio.run(main())
    assert not tiny_engine.is_running and len(tiny_engine.deaths) == 1


def test_requests_after_shutdown_fail_at_once(tiny_engine):
    tiny_engine.shutdown()

    async def main():
        with pytest.raises(EngineDeadError, match="shutting down"):
            await asyncio.wait_for(_collect(tiny_engine, [1, 2, 3], SamplingParams()), timeout=5)

    asyncio.run(main())
