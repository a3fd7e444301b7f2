"""Structured outputs in the engine: grammars constrain sampling, and nothing else changes.

The default model (SmolLM2-135M) in fp32; outputs are checked against the spec itself (jsonschema, re,
the choice list), never against fixed strings.
"""
import gc
import json
import re
import threading
import weakref

import jsonschema
import pytest
import torch

from backend.engine.llm import LLM, RequestFailedError
from backend.engine.sampling_params import SamplingParams
from backend.engine.structured_outputs import apply_grammars, unpack_bitmask

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 120}},
    "required": ["name", "age"],
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=256, block_size=16)


def _chat_ids(llm, messages):
    from backend.engine.tokenizer import chat_prompt_ids

    return {"prompt_token_ids": chat_prompt_ids(llm.get_tokenizer(), messages)}


def json_params(**extra):
    return SamplingParams(max_tokens=80, structured_outputs={"json": PERSON}, **extra)


def test_unpack_bitmask_reads_xgrammar_bit_order():
    words = torch.tensor([[0b101, -(2**31)], [0, 1]], dtype=torch.int32)  # bit 31 set: a negative int32
    assert unpack_bitmask(words, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]
    allowed = unpack_bitmask(words, 40)  # the vocabulary ends inside the second word
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]
    assert allowed[1].nonzero().flatten().tolist() == [32]


def test_constrained_rows_leave_unconstrained_greedy_outputs_unchanged(llm):
    free = [f"Tell me about {topic}." for topic in ("the sea", "bread", "the moon")]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(free, greedy)]
    mixed = llm.generate([free[0], _chat_ids(llm, ASK), free[1], free[2]],
                         [greedy, json_params(temperature=0), greedy, greedy])
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2], mixed[3])] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), PERSON)
    assert mixed[1].outputs[0].finish_reason == "stop"


def test_n_samples_each_follow_the_schema(llm):
    [out] = llm.generate(_chat_ids(llm, ASK), json_params(n=3, temperature=1.0, seed=7))
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) > 1  # three samples, not one matcher shared
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_choice_and_regex_always_match(llm):
    choices = ["yes", "no", "it depends"]
    outs = llm.generate(
        [_chat_ids(llm, [{"role": "user", "content": q}]) for q in ("Is water wet?", "Is the sky green?")] * 2,
        SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured_outputs={"choice": choices}),
    )
    assert all(o.outputs[0].text in choices for o in outs)
    pattern = r"[A-Z][a-z]{2,8} \d{1,3}"
    outs = llm.generate(["Name and number:"] * 4,
                        SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=16, structured_outputs={"regex": pattern}))
    assert all(re.fullmatch(pattern, c.text) for o in outs for c in o.outputs)


def test_min_tokens_yields_to_a_grammar_that_must_end(llm):
    [out] = llm.generate("Answer:", SamplingParams(temperature=0, max_tokens=10, min_tokens=5,
                                                    structured_outputs={"choice": ["ok"]}))
    assert out.outputs[0].text == "ok" and out.outputs[0].finish_reason == "stop"


def test_grammars_stay_valid_under_preemption():
    small = LLM(dtype="float32", num_kv_blocks=14, block_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    prompts = [_chat_ids(small, [{"role": "user", "content": f"Person number {i} as JSON."}]) for i in range(8)]
    outs = small.generate(prompts, json_params(temperature=0.7, seed=11))
    assert small.engine.stats().num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert small.engine.stats().kv_cache_usage == 0


@pytest.mark.parametrize("spec, message", [
    ({"regex": "(ab"}, "structured_outputs.regex: Regex parsing error"),
    ({"json": {"type": "nonsense"}}, 'structured_outputs.json: Unsupported type "nonsense"'),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar: EBNF parser error"),
])
def test_a_spec_that_does_not_compile_fails_its_request_alone(llm, spec, message):
    engine = llm.engine
    engine.add_request("fine", "Count: one, two,", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add_request("bad", "Anything", SamplingParams(max_tokens=20, structured_outputs=spec))
    finished, failures = {}, {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        failures.update(engine.take_failures())
    assert set(failures) == {"bad"} and message in str(failures["bad"])
    assert isinstance(failures["bad"], ValueError)  # a client error: HTTP 400 at the gateway
    assert len(finished["fine"].outputs[0].token_ids) == 20
    assert engine.stats().kv_cache_usage == 0


def test_ignore_eos_is_refused_with_a_grammar():
    with pytest.raises(ValueError, match="ignore_eos cannot be used with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs={"json_object": True})


def test_a_failed_request_reports_the_grammar_error(llm):
    with pytest.raises(RequestFailedError, match="structured_outputs.regex: .*lower bound is larger"):
        llm.generate("x", SamplingParams(structured_outputs={"regex": "[z-a]"}))


def test_the_mask_is_the_same_on_the_npu(fake_npu, llm):
    """apply_grammars is plain torch: on a (fake) NPU tensor it masks exactly as on the CPU."""
    spec = SamplingParams(structured_outputs={"regex": r"[0-9]+"}).structured_outputs
    grammar = llm.engine.structured_outputs.grammar_for(spec)
    grammar.compiled.result(timeout=30)
    logits = torch.randn(3, llm.engine.model_config.vocab_size)
    on_cpu, on_npu = logits.clone(), logits.to("npu:0")
    apply_grammars(on_cpu, [None, grammar, None])
    apply_grammars(on_npu, [None, grammar, None])
    assert on_npu.device.type == "npu"
    assert torch.equal(on_npu.cpu(), on_cpu)
    assert torch.equal(on_cpu[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched
    allowed = on_cpu[1].isfinite().nonzero().flatten().tolist()
    tokenizer = llm.get_tokenizer()
    assert allowed and all(tokenizer.decode([t]).isdigit() for t in allowed)


def test_sampled_json_cannot_loop_on_whitespace(llm):
    """At temperature a small model may emit newline after newline between JSON tokens until max_tokens; capped
    whitespace runs (MAX_WHITESPACE) make every sample close its object. (Uncapped, seed 2 loses one of 16.)"""
    pet = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 30}},
           "required": ["name", "age"]}
    [out] = llm.generate(_chat_ids(llm, [{"role": "user", "content": "Describe my pet."}]),
                         SamplingParams(n=16, temperature=0.7, top_p=0.95, max_tokens=160, seed=2,
                                        structured_outputs={"json": pet}))
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), pet)


def test_a_compiling_grammar_holds_back_only_its_own_request(llm, monkeypatch):
    """While a spec compiles (off the step loop), its request waits and the others decode; a second request with the
    same spec reuses the compilation."""
    engine, structured = llm.engine, llm.engine.structured_outputs
    gate, compiled = threading.Event(), []
    real_compile = structured._compile

    def gated_compile(spec):  # the real compilation, once the test lets it start
        assert gate.wait(30)
        compiled.append(spec.key)
        return real_compile(spec)

    monkeypatch.setattr(structured, "_compile", gated_compile)
    params = SamplingParams(temperature=0, max_tokens=80,
                            structured_outputs={"json": {**PERSON, "title": "a spec no other test compiled"}})
    engine.add_request("free", "Count: one, two,", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("json-1", _chat_ids(llm, ASK), params)
    outputs = {}
    for _ in range(8):
        for o in engine.step():
            outputs[o.request_id] = o
    assert outputs["free"].finished and len(outputs["free"].outputs[0].token_ids) == 8
    assert "json-1" not in outputs and engine.stats().num_waiting == 1  # held until its grammar is ready
    engine.add_request("json-2", _chat_ids(llm, ASK), params)
    gate.set()
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    for request_id in ("json-1", "json-2"):
        jsonschema.validate(json.loads(outputs[request_id].outputs[0].text), PERSON)
    assert compiled == [params.structured_outputs.key]  # one compilation for both


def test_stop_strings_and_abort_end_a_constrained_request_and_release_its_matcher(llm):
    [out] = llm.generate("Dessert:", SamplingParams(temperature=0, max_tokens=12, stop=["pie"],
                                                     structured_outputs={"choice": ["apple pie today"]}))
    assert out.outputs[0].text == "apple " and out.outputs[0].finish_reason == "stop"
    engine = llm.engine
    engine.add_request("cut", _chat_ids(llm, ASK), json_params(temperature=0))
    while not any(o.outputs[0].token_ids for o in engine.step() if o.request_id == "cut"):
        pass
    [request] = engine.scheduler.running
    matcher = weakref.ref(request.grammar.matcher)
    engine.abort_request("cut")
    engine.step()
    del request
    gc.collect()
    assert matcher() is None  # nothing holds the aborted request's matcher
    assert engine.stats().kv_cache_usage == 0 and not engine.has_unfinished_requests()
