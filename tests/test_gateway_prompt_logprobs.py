"""Prompt logprobs through the whole stack (tritonserver, gateway, the openai SDK), as lm-evaluation-harness and
OpenAI's scoring recipe ask for them: `echo` with `logprobs` gives OpenAI's shape over prompt and completion (the
first token's logprob null), `max_tokens: 0` scores the prompt alone, and vLLM's `prompt_logprobs` extra works on
completions and chat. Every value equals the engine's own in this process (fp32)."""
from __future__ import annotations

import httpx
import pytest

from backend import SamplingParams
from backend.engine.tokenizer import chat_prompt_ids
from backend.models.registry import DEFAULT_MODEL
from tests.conftest import GATEWAY_API_KEY

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL
PROMPT = "Question: What is the capital of France? Answer: Paris"


@pytest.fixture(scope="module")
def client(gateway):
    from openai import OpenAI

    return OpenAI(base_url=f"{gateway}/v1", api_key=GATEWAY_API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def scored(reference_llm):
    """The engine's prompt logprobs (top 2) and greedy next token for PROMPT."""
    [out] = reference_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=2, prompt_logprobs=2))
    return out


def test_echo_with_logprobs_scores_every_prompt_token(client, scored):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1; it sums token_logprobs[ctxlen:-1]."""
    answer = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0)
    logprobs = answer.choices[0].logprobs
    ids = scored.prompt_token_ids
    assert len(logprobs.tokens) == len(ids) + 1  # every prompt token, then the generated one
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [entry[token].logprob for entry, token in zip(scored.prompt_logprobs[1:], ids[1:])]
    assert max(abs(a - b) for a, b in zip(logprobs.token_logprobs[1:len(ids)], expected)) < 1e-4
    assert abs(logprobs.token_logprobs[-1] - scored.outputs[0].logprobs[0][scored.outputs[0].token_ids[0]].logprob) < 1e-4
    assert "".join(logprobs.tokens) == answer.choices[0].text == PROMPT + scored.outputs[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    for position, token in zip(logprobs.top_logprobs[1:], logprobs.tokens[1:]):
        assert token in position and len(position) <= 2  # the token itself and the one most likely


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(client, scored, gateway):
    answer = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    assert answer.choices[0].text == PROMPT and answer.usage.completion_tokens == 0
    assert answer.choices[0].finish_reason == "length"
    assert len(answer.choices[0].logprobs.tokens) == len(scored.prompt_token_ids)
    refused = httpx.post(f"{gateway}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {GATEWAY_API_KEY}"},
                         json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400 and "only with echo" in refused.json()["error"]["message"]


def test_streamed_echo_carries_the_prompt_logprobs_first(client, scored):
    events = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True))
    first = events[0].choices[0]
    assert first.text == PROMPT and len(first.logprobs.tokens) == len(scored.prompt_token_ids)
    assert first.logprobs.token_logprobs[0] is None
    # the generated tokens' offsets go on from the echoed prompt
    offsets = [o for e in events[1:] for c in e.choices if c.logprobs for o in c.logprobs.text_offset]
    texts = [c.text for e in events[1:] for c in e.choices if c.logprobs]
    assert offsets == [len(PROMPT) + sum(len(t) for t in texts[:i]) for i in range(len(texts))] and offsets
    alone = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert "".join(c.text for e in alone for c in e.choices) == PROMPT
    assert alone[-1].usage.completion_tokens == 0
    assert [c.finish_reason for e in alone for c in e.choices if c.finish_reason] == ["length"]


def test_vllm_prompt_logprobs_extra_on_completions_and_chat(client, scored, reference_llm):
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    vllm_shape = answer.choices[0].model_extra["prompt_logprobs"]
    assert vllm_shape[0] is None and len(vllm_shape) == len(scored.prompt_token_ids)
    for entry, expected, token in zip(vllm_shape[1:], scored.prompt_logprobs[1:], scored.prompt_token_ids[1:]):
        assert next(iter(entry)) == str(token) and abs(entry[str(token)]["logprob"] - expected[token].logprob) < 1e-4
        assert {int(t) for t in entry} == set(expected)
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0})
    ids = chat_prompt_ids(reference_llm.get_tokenizer(), messages)
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) == len(ids)


def test_a_batch_of_prompts_answers_each_in_order(client, reference_llm, gateway):
    """OpenAI's list of prompts (lm-eval's tokenized requests send one as [[ids]]): prompt k's choices are
    indexed k * n + i."""
    tokenizer = reference_llm.get_tokenizer()
    prompts = ["The four seasons are", "Paris is the capital of"]
    expected = [o.outputs[0].text for o in reference_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    by_text = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=8, n=2)
    assert [c.index for c in by_text.choices] == [0, 1, 2, 3]
    assert [c.text for c in by_text.choices] == [expected[0]] * 2 + [expected[1]] * 2
    by_ids = client.completions.create(model=MODEL, prompt=[tokenizer.encode(p) for p in prompts], temperature=0,
                                       max_tokens=8)
    assert [c.text for c in by_ids.choices] == expected
    assert by_ids.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    headers = {"Authorization": f"Bearer {GATEWAY_API_KEY}"}
    streamed = httpx.post(f"{gateway}/v1/completions", timeout=60, headers=headers,
                          json={"model": MODEL, "prompt": prompts, "stream": True})
    assert streamed.status_code == 400 and "batch" in streamed.json()["error"]["message"]
    empty = httpx.post(f"{gateway}/v1/completions", timeout=60, headers=headers,
                       json={"model": MODEL, "prompt": ["fine", ""]})
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
