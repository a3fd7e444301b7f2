"""Engine behaviour on the default model: prefix caching, abort, n, seeds, stops, streaming, bad input."""
from __future__ import annotations

import pytest

from backend import LLM, SamplingParams
from backend.engine.tokenizer import chat_prompt_ids

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=256, block_size=16)


def _run_until_done(engine):
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def test_prefix_cache_computes_only_the_suffix(llm):
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.encode(" ".join(f"word{i}" for i in range(60)))[:48]  # exactly 3 blocks
    first = prefix + tokenizer.encode(" and the first ending")
    second = prefix + tokenizer.encode(" but a different, longer second ending")
    llm.generate({"prompt_token_ids": first}, GREEDY)
    before = engine.stats()
    [hit] = llm.generate({"prompt_token_ids": second}, GREEDY)
    after = engine.stats()
    computed = after.num_computed_tokens - before.num_computed_tokens
    generated = after.num_generation_tokens - before.num_generation_tokens
    # the prompt's 3 cached blocks are skipped; each generated token but the last is computed once
    assert computed == len(second) - 48 + generated - 1
    assert hit.metrics.num_cached_tokens == 48

    cold = LLM(dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    [reference] = cold.generate({"prompt_token_ids": second}, GREEDY)
    assert hit.outputs[0].token_ids == reference.outputs[0].token_ids


def test_abort_frees_blocks_immediately(llm):
    engine = llm.engine
    engine.add_request("long", "Write a long story about a dragon.", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.stats().kv_cache_usage > 0
    engine.abort_request("long")
    assert engine.stats().kv_cache_usage == 0
    [final] = _run_until_done(engine)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert 0 < len(final.outputs[0].token_ids) < 200


def test_n_samples_are_reproducible_and_distinct(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    first = llm.generate("Tell me about cats.", params)[0]
    # a different batch around it must not change seeded samples
    second = llm.generate(["Unrelated filler prompt.", "Tell me about cats."], [SamplingParams(temperature=1.0), params])[1]
    texts = [o.text for o in first.outputs]
    assert len(first.outputs) == 3
    assert [o.text for o in second.outputs] == texts
    assert len(set(texts)) == 3


def test_stop_string_and_stop_token(llm):
    prompt = "Count from one to ten in words: one, two, three,"
    [full] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))
    assert " five" in full.outputs[0].text
    [cut] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[" five"]))
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == " five"
    assert cut.outputs[0].text == full.outputs[0].text.split(" five")[0]
    [kept] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[" five"], include_stop_str_in_output=True))
    assert kept.outputs[0].text == cut.outputs[0].text + " five"

    third_token = full.outputs[0].token_ids[2]
    [by_token] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[third_token]))
    assert by_token.outputs[0].finish_reason == "stop" and by_token.outputs[0].stop_reason == third_token
    assert by_token.outputs[0].token_ids == full.outputs[0].token_ids[:3]


def test_length_and_min_tokens(llm):
    [short] = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 3
    eos = llm.get_tokenizer().eos_token_id
    chat = chat_prompt_ids(llm.get_tokenizer(), [{"role": "user", "content": "Say OK."}])
    [free] = llm.generate({"prompt_token_ids": chat}, SamplingParams(temperature=0, max_tokens=40))
    assert free.outputs[0].finish_reason == "stop" and free.outputs[0].token_ids[-1] == eos
    n = len(free.outputs[0].token_ids)
    [forced] = llm.generate({"prompt_token_ids": chat}, SamplingParams(temperature=0, max_tokens=40, min_tokens=n + 2))
    assert len(forced.outputs[0].token_ids) >= n + 2


def test_chinese_streams_without_broken_characters(llm):
    engine = llm.engine
    prompt = chat_prompt_ids(llm.get_tokenizer(), [{"role": "user", "content": "请用中文介绍一下北京。🙂"}])
    engine.add_request("zh", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=60))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.outputs[0].delta)
            final = output
    text = final.outputs[0].text
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(ord(ch) > 0x2E80 for ch in text), text  # the reply does contain CJK (or emoji) characters


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bad_requests_leave_the_engine_serving(llm):
    engine = llm.engine
    engine.add_request("good", "The capital of Italy is", GREEDY)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", "", GREEDY)
    limit = engine.config.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", {"prompt_token_ids": [5] * limit}, GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("long2", {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=limit))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", "again", GREEDY)
    outputs = _run_until_done(engine)
    assert [o.request_id for o in outputs if o.finished] == ["good"]
    assert engine.stats().kv_cache_usage == 0


def test_graph_mode_falls_back_to_eager_on_cpu():
    from backend.config import EngineConfig

    config = EngineConfig(enforce_eager=False)
    config.finalize("cpu", 2048)
    assert config.enforce_eager  # torch has no CPU graphs
    config = EngineConfig(enforce_eager=False)
    config.finalize("cuda", 2048)
    assert not config.enforce_eager
