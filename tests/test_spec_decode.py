"""Speculative decoding, every method (speculative_config: ngram, draft_model, eagle, eagle3, deepseek_mtp with k
tokens).

Greedy: the tokens with drafts are those without, through chunked prefill, prefix-cache hits and preemption, with
drafts both accepted and rejected and every block back in the pool; logprobs, stop strings and n > 1 as without;
EAGLE and EAGLE-3 heads in vLLM's layouts draft what their formulas give, computed apart on transformers' states.
Sampling: the joint distribution of three sampled tokens equals the target model's own (exactly, from transformers'
logits) within a chi-square test, per method; the rejection sampler with draft probabilities keeps p, and the same
sampler told the wrong q fails that test. Configs npu-llm cannot honour are refused at load, naming the key."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from backend.engine.request import Request
from backend.engine.sampler import sample
from backend.engine.spec_decode.ngram import lookup
from tests.conftest import add_mtp_layer, greedy_tokens, hf_model, make_eagle_head, make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory):
    """TINY's 512-token vocabulary (the default model's tokenizer reads its ids): its logits are decisive enough
    for the drafts of add_mtp_layer to be accepted at times."""
    return add_mtp_layer(make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("spec") / "v3"))


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory):
    """A draft model of the same vocabulary and other random weights: its drafts are mostly rejected."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("spec") / "draft", num_hidden_layers=1)


def _methods(v3, other):
    """(method name, speculative_config) for each way of drafting, on the v3 target."""
    return {"ngram": NGRAM, "mtp": MTP,
            "draft_model (the target itself)": {"method": "draft_model", "model": str(v3), "num_speculative_tokens": 3},
            "draft_model (another model)": {"model": str(other), "num_speculative_tokens": 2}}


METHODS = ["ngram", "mtp", "draft_model (the target itself)", "draft_model (another model)"]


def test_another_requests_draft_slots_are_taken_back_before_anything_is_preempted():
    """Two decoding requests in 4 blocks of 4 tokens: the second holds a block for its drafts only. When the first
    needs a new block, the second's drafts and that block are taken back, and neither request is preempted."""
    from backend.engine.kv_cache import KVCacheManager
    from backend.engine.scheduler import Scheduler

    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=16, enable_chunked_prefill=True)
    first, second = (Request(str(i), prompt, SamplingParams(temperature=0), 8, ()) for i, prompt in
                     enumerate(([1, 2, 3, 4], [5, 6, 7])))
    for request in (first, second):
        scheduler.add(request)
    scheduled = scheduler.schedule()  # both prompts: one block each
    scheduler.update_from_output(scheduled, {"0": 9, "1": 9})  # first: 5 tokens, 4 computed; second: 4, 3
    kv.allocate(second, 4)  # its next drafts' slots, as the drafter takes them: a second block
    second.draft_token_ids = [1, 2, 3]
    assert kv.num_free_blocks == 1
    kv.allocate(Request("other", [0] * 4, SamplingParams(), 1, ()), 4)  # someone else holds the last free block
    scheduled = scheduler.schedule()  # first's fifth token needs a new block: only the drafts' one can be had
    assert [(s.request.request_id, s.num_drafts) for s in scheduled] == [("0", 0), ("1", 0)]
    assert scheduler.num_preemptions == 0 and second.draft_token_ids == []


@pytest.mark.parametrize("tokens,k,min_n,max_n,drafts", [
    ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),  # vLLM's docstring: [4, 2, 3] unmatched, [2, 3] matched, 3 follow
    ([1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 2, 2, 3, [9, 1]),  # the longest match wins, at its earliest place
    ([5, 6, 7, 8, 6, 7], 2, 3, 3, []),  # nothing as long as min_n
    ([5, 6, 5], 3, 1, 3, [6, 5]),  # fewer than k tokens follow: those there are
])
def test_ngram_lookup_follows_vllms_rule(tokens, k, min_n, max_n, drafts):
    assert lookup(np.array(tokens), k, min_n, max_n) == drafts


@pytest.fixture(scope="module")
def llama_with_heads(tmp_path_factory):
    """A tiny Llama of 4 layers, and a random EAGLE and EAGLE-3 head for it (EAGLE-3 fusing layers 1-3)."""
    root = tmp_path_factory.mktemp("eagle")
    target = make_tiny_model("llama", root / "target", num_hidden_layers=4)
    return target, make_eagle_head(target, root / "eagle", "eagle"), \
        make_eagle_head(target, root / "eagle3", "eagle3", aux_layers=[1, 2, 3])


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_tokens_with_eagle_heads_are_those_without(method, llama_with_heads, default_model_dir):
    """Random heads in vLLM's layouts draft (and are seldom right, which must not matter): the tokens are those
    without drafts, through chunked prefill, prefix-cache hits and preemption, every block back in the pool."""
    target, eagle, eagle3 = llama_with_heads
    spec = {"method": method, "model": str(eagle if method == "eagle" else eagle3), "num_speculative_tokens": 3}
    stats = _greedy_with_and_without(target, spec, 32, 16, default_model_dir)
    assert stats.spec_decode.num_draft_tokens > 3 * len(_prompts())
    assert stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens


def test_an_eagle3_head_is_a_plain_llama_layer_whatever_the_target(tmp_path, default_model_dir):
    """vLLM builds a head's layer as Llama's: on a Qwen3 target (q/k norms in every layer) the head has none and
    loads from a checkpoint without them; greedy tokens are the target's own."""
    target = make_tiny_model("qwen3", tmp_path / "qwen3", num_hidden_layers=4, layer_types=["full_attention"] * 4)
    head = make_eagle_head(target, tmp_path / "head", "eagle3", aux_layers=[1, 2, 3])
    prompts = [{"prompt_token_ids": p} for p in _prompts()[2:]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    args = dict(model=str(target), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=16)
    with LLM(**args) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    with LLM(**args, speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.engine.model.draft_head.self_attn.q_norm is None and llm.engine.stats().spec_decode.num_drafts > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_draft_what_vllms_formulas_give(method, llama_with_heads, default_model_dir):
    """The three drafts after a prompt's prefill equal those of the head's formulas computed here apart, in plain
    torch on transformers' hidden states and rotary tables (vLLM's llama_eagle.py / llama_eagle3.py): the first from
    the prompt's positions, the next two from the head's own output, one position further each."""
    from backend import LLMEngine

    target, eagle, eagle3 = llama_with_heads
    head = eagle if method == "eagle" else eagle3
    prompt = _prompts()[2][:21]
    engine = LLMEngine(model=str(target), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=8,
                       speculative_config={"method": method, "model": str(head), "num_speculative_tokens": 3})
    try:
        engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8))
        engine.step()
        [request] = engine.scheduler.running
        drafts = list(request.draft_token_ids)
    finally:
        engine.shutdown()
    assert drafts == _reference_drafts(target, head, method, prompt, 3)


def _reference_drafts(target_dir, head_dir, method: str, prompt: list[int], k: int) -> list[int]:
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    target = hf_model(target_dir)
    config = target.config
    w = {key.replace("midlayer.", "").replace("layers.0.", ""): t for key, t in
         load_file(str(head_dir / "model.safetensors")).items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim, eps = config.hidden_size // heads, config.rms_norm_eps
    rotary = LlamaRotaryEmbedding(config)

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def attention(x):
        n = len(x)
        q = (x @ w["self_attn.q_proj.weight"].T).view(1, n, heads, head_dim).transpose(1, 2)
        k_ = (x @ w["self_attn.k_proj.weight"].T).view(1, n, kv_heads, head_dim).transpose(1, 2)
        v = (x @ w["self_attn.v_proj.weight"].T).view(1, n, kv_heads, head_dim).transpose(1, 2)
        cos, sin = rotary(v, torch.arange(n)[None])
        q, k_ = apply_rotary_pos_emb(q, k_, cos, sin)
        repeat = heads // kv_heads
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k_.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), is_causal=True)
        return out.transpose(1, 2).reshape(n, heads * head_dim) @ w["self_attn.o_proj.weight"].T

    def mlp(x):
        gate, up = x @ w["mlp.gate_proj.weight"].T, x @ w["mlp.up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T

    def head_pass(embeds, hidden):  # the hidden state each position hands on (before any final norm)
        if method == "eagle":  # fc, then a decoder layer without its input norm
            x = torch.cat((embeds, hidden), -1) @ w["fc.weight"].T
            x = x + attention(x)
        else:  # attention over the normed embedding and hidden state side by side
            x = hidden + attention(torch.cat((norm(embeds, w["input_layernorm.weight"]),
                                              norm(hidden, w["hidden_norm.weight"])), -1))
        return x + mlp(norm(x, w["post_attention_layernorm.weight"]))

    def greedy(x):
        if method == "eagle":
            return target.lm_head(x).argmax().item()
        draft = (norm(x, w["norm.weight"]) @ w["lm_head.weight"].T).argmax().item()
        return draft + w["d2t"][draft].item()

    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
        states = out.hidden_states  # [i]: the input of layer i (its residual stream); [-1]: after the final norm
        rows = states[-1][0] if method == "eagle" else torch.cat([states[i][0] for i in (1, 2, 3)], -1) @ w["fc.weight"].T
        tokens, hidden, drafts = prompt + [out.logits[0, -1].argmax().item()], list(rows), []
        for _ in range(k):
            n = len(hidden)
            x = head_pass(target.model.embed_tokens(torch.tensor(tokens[1 : n + 1])), torch.stack(hidden))
            drafts.append(greedy(x[-1]))
            tokens.append(drafts[-1])
            hidden.append(x[-1])
    return drafts


def _greedy_with_and_without(model, spec: dict, max_tokens: int, num_kv_blocks: int, tokenizer):
    """_prompts() greedy with and without drafting, through chunked prefill (a 32-token budget), prefix-cache hits
    and preemption (few blocks): the same tokens, every block back after. The drafting engine's stats."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    assert max(len(p) for p in _prompts()) > 32
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    args = dict(model=str(model), tokenizer=str(tokenizer), dtype="float32", block_size=16,
                num_kv_blocks=num_kv_blocks, max_num_batched_tokens=32, max_num_seqs=4)
    with LLM(**args) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    with LLM(**args, speculative_config=spec) as drafting:
        outputs = drafting.generate(prompts, params)
        stats = drafting.engine.stats()
        assert drafting.engine.kv.num_free_blocks == num_kv_blocks
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.prefix_cache_hit_rate > 0 and stats.num_preemptions > 0
    return stats


def _prompts():
    rng = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 500, (40,), generator=rng).tolist()
    looping = (torch.randint(3, 500, (6,), generator=rng).tolist() * 5)[:27]  # n-gram drafts from the prompt
    return [shared, shared + [7, 8], torch.randint(3, 500, (70,), generator=rng).tolist(), looping]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_with_drafts_are_those_without(method, v3_with_mtp, other_llama, default_model_dir):
    # (48 tokens: the tiny model falls into a loop of 13 after about 26, which n-gram then drafts)
    stats = _greedy_with_and_without(v3_with_mtp, _methods(v3_with_mtp, other_llama)[method], 48, 18, default_model_dir)
    spec_stats = stats.spec_decode
    if method == "draft_model (the target itself)":  # its drafts are the target's argmax: its KV must be right
        assert 0 < spec_stats.num_accepted_tokens == spec_stats.num_draft_tokens
    elif method == "draft_model (another model)":  # random weights: they seldom agree, and it must not matter
        assert spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens
    else:
        assert 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens
    per_position = spec_stats.num_accepted_tokens_per_pos
    assert sum(per_position) == spec_stats.num_accepted_tokens and per_position == sorted(per_position, reverse=True)
    assert stats.num_generation_tokens == len(_prompts()) * 48  # (a step yields several tokens: all counted once)


def test_blocks_a_finished_request_leaves_in_the_prefix_cache_hold_the_draft_models_kv(tiny_llama_dir, default_model_dir):
    """A request that ends on its first token leaves its prompt's blocks in the prefix cache; the draft model's KV
    there is written too (its last step's positions are run after it finished), so a later request that hits them
    drafts as well as one that computed them: a model drafting for itself is then always right."""
    spec = {"model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    prompt = {"prompt_token_ids": _prompts()[2][:64]}
    with LLM(model=str(tiny_llama_dir), tokenizer=str(default_model_dir), dtype="float32", block_size=16,
             num_kv_blocks=16, speculative_config=spec) as llm:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        stats = llm.engine.stats()
    assert stats.prefix_cache_hit_rate > 0.3
    assert 0 < stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens


def test_glm45s_mtp_layer_drafts_k_tokens_too(tmp_path, default_model_dir):
    """GLM-4.5's checkpoints carry the same kind of MTP layer (num_nextn_predict_layers): two tokens a step, and
    the greedy tokens are those without."""
    model = add_mtp_layer(make_tiny_model("glm4_moe", tmp_path / "glm", num_nextn_predict_layers=1))
    stats = _greedy_with_and_without(model, {"method": "mtp", "num_speculative_tokens": 2}, 32, 18, default_model_dir)
    assert 0 < stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "mtp", "draft_model (the target itself)"])
def test_sampled_tokens_keep_the_target_distribution(method, v3_with_mtp, other_llama, default_model_dir):
    """3000 seeded requests sample three tokens each (top-3, temperature 0.8) while drafting; the counts of the 27
    outcomes against the exact probabilities from transformers: the chi-square test's p-value is above 0.01
    (seeded, so the figure is the same each run; a sampler that kept drafts at 1.5 p(draft) gives p ~ 1e-29)."""
    top_k, temperature, n = 3, 0.8, 3000
    reference = hf_model(v3_with_mtp)
    # n-gram: the end of a greedy run, where the tiny model loops (every 13 tokens), so it drafts the loop; the
    # MTP layer of add_mtp_layer drafts what the embeddings predict, which follows a short random prompt more often
    prompt = [5, 17, 99, 4, 250, 31] if method == "mtp" else greedy_tokens(reference, _prompts()[3], 48)[-20:]

    def top(prefix):  # the target's next-token distribution after prefix, as the sampler filters it
        with torch.no_grad():
            logits = reference(torch.tensor([prefix])).logits[0, -1] / temperature
        values, ids = logits.topk(top_k)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist()))

    exact = {}
    for a, pa in top(prompt).items():
        for b, pb in top(prompt + [a]).items():
            for c, pc in top(prompt + [a, b]).items():
                exact[a, b, c] = pa * pb * pc

    with LLM(model=str(v3_with_mtp), tokenizer=str(default_model_dir), dtype="float32", max_num_seqs=256,
             speculative_config=_methods(v3_with_mtp, other_llama)[method]) as llm:
        params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True, seed=i)
                  for i in range(n)]
        outputs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
        spec = llm.engine.stats().spec_decode
    sampled = [tuple(o.outputs[0].token_ids) for o in outputs]
    assert all(triple in exact for triple in sampled)  # every draw within the top-3 paths
    assert chi_square_pvalue(sampled, exact) > 0.01
    assert 0.05 * n < spec.num_accepted_tokens < spec.num_draft_tokens  # drafts kept and rejected, often


def chi_square_pvalue(samples: list, exact: dict) -> float:
    """P(X >= statistic) for the counts of samples against the exact probabilities, the rarest outcomes pooled until
    each cell expects at least 5 (the test's validity condition)."""
    counts = {outcome: 0 for outcome in exact}
    for outcome in samples:
        counts[outcome] += 1
    outcomes = sorted(exact, key=exact.get)
    expected = [exact[o] * len(samples) for o in outcomes]
    observed = [counts[o] for o in outcomes]
    while expected[0] < 5:
        expected[1] += expected.pop(0)
        observed[1] += observed.pop(0)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    # chi-square with len - 1 degrees of freedom: the regularised upper incomplete gamma
    return torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2), torch.tensor(statistic / 2)).item()


def test_the_rejection_sampler_keeps_p_for_drafts_drawn_from_q():
    """Drafts drawn from a distribution q, verified with q: min(1, p/q) keeps, the residual max(p - q, 0) resamples;
    the sampled tokens follow p. Told the wrong q (uniform), the same sampler does not: the test catches it."""
    vocab, n = 6, 6000
    generator = torch.Generator().manual_seed(0)
    p_logits = torch.randn(vocab, generator=generator) * 1.5
    q = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, -1)
    p = torch.softmax(p_logits, -1)
    exact = {(token,): prob for token, prob in enumerate(p.tolist())}
    requests = [Request(str(i), [0], SamplingParams(temperature=1.0, seed=i), 8, {vocab}) for i in range(n)]
    drafts = torch.multinomial(q, n, replacement=True, generator=generator).tolist()
    logits = p_logits.expand(n, vocab)

    def verified(told_q):
        return [(t.token_id,) for t in sample(logits, requests, drafts, draft_probs=told_q.expand(n, vocab))]

    assert chi_square_pvalue(verified(q), exact) > 0.01
    assert chi_square_pvalue(verified(torch.full((vocab,), 1 / vocab)), exact) < 1e-6


def test_logprobs_stop_strings_and_n_are_as_without_drafts(default_model_dir):
    """On the default model, copying a passage (n-gram's best case): the same text, token ids, logprobs (of every
    accepted token too) and finish reasons with drafts as without; n = 2; a stop string inside a step's tokens."""
    passage = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
               "members agreed to increase funding for the library by ten percent.")
    messages = [[{"role": "user", "content": f"Copy this passage word for word:\n\n{passage}"}]]
    params = [SamplingParams(temperature=0, max_tokens=40, logprobs=3, n=2),
              SamplingParams(temperature=0, max_tokens=40, stop=["ten percent"])]
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    outputs = {}
    for drafting in (None, spec):
        with LLM(dtype="float32", num_kv_blocks=64, speculative_config=drafting) as llm:
            outputs[drafting is None] = [llm.chat(messages, p)[0] for p in params]
            if drafting:
                assert llm.engine.stats().spec_decode.acceptance_rate > 0.5
                assert llm.engine.kv.num_free_blocks == 64
    for plain, drafted in zip(outputs[True], outputs[False]):
        assert len(plain.outputs) == len(drafted.outputs)
        for a, b in zip(plain.outputs, drafted.outputs):
            assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason,
                                                                             b.stop_reason)
            for x, y in zip(a.logprobs or [], b.logprobs or []):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank for t in x)
    assert outputs[False][1].outputs[0].finish_reason == "stop" and "ten percent" not in outputs[False][1].outputs[0].text


def test_an_abort_while_drafting_returns_every_block_and_leaves_the_others_alone(default_model_dir):
    """Two requests copying passages with n-gram drafts; one is aborted once drafts were kept: its blocks (those its
    drafts took too) go back, and the other's tokens are those it has alone without drafts."""
    from backend.engine.tokenizer import chat_prompt_ids

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    params = SamplingParams(temperature=0, max_tokens=48)
    with LLM(dtype="float32", num_kv_blocks=64) as plain:
        tokenizer = plain.engine.tokenizer
        prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": f"Copy this exactly:\n\n{text}"}])
                   for text in ("The river rises in the northern hills and flows south to the sea.",
                                "Our return policy allows customers to return most items within thirty days.")]
        [expected] = plain.generate([{"prompt_token_ids": prompts[1]}], params)
    with LLM(dtype="float32", num_kv_blocks=64, speculative_config=spec) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        outputs = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs[output.request_id] = output
            if "0" in outputs and not outputs["0"].finished and engine.stats().spec_decode.num_accepted_tokens:
                engine.abort_request("0")
        assert outputs["0"].finished and outputs["0"].outputs[0].finish_reason == "abort"
        assert outputs["1"].outputs[0].token_ids == expected.outputs[0].token_ids
        assert engine.kv.num_free_blocks == 64


def test_structured_outputs_draft_within_the_grammar(default_model_dir):
    """Requests with a grammar are drafted for too: drafts the matcher refuses are cut, the rows after kept drafts are
    masked as the grammar will be there, and each kept token is the matcher's. A JSON list of repeated records (where
    n-gram drafts the keys): the same output as without drafts, valid against its schema, drafts kept."""
    import json

    import jsonschema

    schema = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "city": {"type": "string", "maxLength": 12}},
        "required": ["name", "city"], "additionalProperties": False}}
    messages = [[{"role": "user", "content": "List three people with their city, as JSON."}]]
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs={"json": schema})
    outputs = {}
    for drafting in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}):
        with LLM(dtype="float32", num_kv_blocks=64, speculative_config=drafting) as llm:
            [outputs[drafting is None]] = llm.chat(messages, params)
            if drafting:
                spec = llm.engine.stats().spec_decode
                assert llm.engine.kv.num_free_blocks == 64
    plain, drafted = outputs[True].outputs[0], outputs[False].outputs[0]
    assert drafted.token_ids == plain.token_ids and drafted.finish_reason == plain.finish_reason == "stop"
    jsonschema.validate(json.loads(drafted.text), schema)
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


@pytest.mark.parametrize("spec,why", [
    ({"method": "eagle4", "num_speculative_tokens": 1}, "method 'eagle4': must be one of ngram, draft_model, eagle, eagle3"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "model: method 'eagle3' needs the drafting model's"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens: Input should be less than or equal to 16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size: unknown key"),
    ({"method": "ngram"}, "num_speculative_tokens: method 'ngram' needs it"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model: method 'draft_model' needs"),
    ({"method": "mtp", "model": "x"}, "model: method 'mtp' takes no model"),
    ({"method": "mtp", "prompt_lookup_max": 3}, "only method 'ngram' takes them"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min=4 is above prompt_lookup_max=3"),
])
def test_speculative_configs_npu_llm_cannot_honour_are_refused(spec, why):
    with pytest.raises(ValueError, match=why):
        EngineConfig(speculative_config=spec)


def test_vllms_defaults_fill_what_is_left_out():
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative_config == \
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5, "prompt_lookup_min": 5}
    assert EngineConfig(speculative_config={"model": "m", "num_speculative_tokens": 2}).speculative.method == "draft_model"
    assert EngineConfig(speculative_config={"method": "mtp"}).speculative.num_speculative_tokens == 1


def test_heads_that_do_not_fit_the_target_are_refused(llama_with_heads, tmp_path, default_model_dir):
    """An EAGLE-3 head whose layers the target lacks, a head for another width, a head missing a tensor, and a
    folder that holds no head: each refused at load, naming the folder and what is wrong."""
    import json

    from safetensors.torch import load_file, save_file

    target, eagle, eagle3 = llama_with_heads

    def head_like(source, name, config_change=None, drop=None):
        folder = tmp_path / name
        folder.mkdir()
        config = json.loads((source / "config.json").read_text())
        config.update(config_change or {})
        (folder / "config.json").write_text(json.dumps(config))
        tensors = {k: v for k, v in load_file(str(source / "model.safetensors")).items() if k != drop}
        save_file(tensors, str(folder / "model.safetensors"))
        return folder

    cases = [("eagle3", head_like(eagle3, "layers", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}),
              "EAGLE-3 reads three distinct target layers of 1..3; these are \\[0, 1, 2\\]"),
             ("eagle", head_like(eagle, "wide", {"hidden_size": 128}), "hidden_size 128 is not the target's 64"),
             ("eagle", head_like(eagle, "torn", drop="fc.weight"), "the eagle head lacks tensors for model.layers.4.fc"),
             ("eagle", tmp_path, "no config.json there")]
    for method, folder, why in cases:
        with pytest.raises((ValueError, RuntimeError), match=why):
            LLM(model=str(target), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=8,
                speculative_config={"method": method, "model": str(folder), "num_speculative_tokens": 2})


def test_a_draft_model_of_another_vocabulary_is_refused(v3_with_mtp, tmp_path, default_model_dir):
    other = make_tiny_model("llama", tmp_path / "other", vocab_size=600)
    with pytest.raises(ValueError, match="its vocabulary has 600 tokens, the target's 512"):
        LLM(model=str(v3_with_mtp), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=8,
            speculative_config={"model": str(other), "num_speculative_tokens": 2})


@pytest.mark.slow
def test_triton_reports_the_spec_decode_metrics_and_the_ui_the_acceptance(tmp_path):
    """A real tritonserver with speculative_config (n-gram, 3 tokens) in its engine arguments, the default model
    continuing a repetitive text: vLLM's spec-decode counters are on /metrics and add up (the accepted tokens are
    those of the positions, fewer at each later one), and the UI's server panel shows the share kept."""
    import re
    import urllib.request

    from tests.conftest import generate_through_triton, served_by_triton
    from ui.server_metrics import ServerMetrics

    engine_args = {"dtype": "float32", "num_kv_blocks": 64,
                   "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}}
    with served_by_triton(engine_args, tmp_path / "tritonserver.log") as server:
        try:
            generate_through_triton(server, {"text_input": "the cat sat on the mat. " * 6, "exclude_input_in_output": True,
                                             "parameters": {"temperature": 0, "max_tokens": 32, "ignore_eos": True}})
            server.settled()
            counts = {name: server.metric(f"vllm:spec_decode_{name}_total")
                      for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
            text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
            per_position = {int(m[1]): float(m[2]) for m in re.finditer(
                r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{.*position="(\d+)".*\} (\S+)$', text, re.M)}
            generated = server.metric("vllm:generation_tokens_total")
            panel, _, _ = ServerMetrics([server.metrics_url]).refresh()
        except Exception:
            raise AssertionError(server.log()[-4000:])
    assert generated == 32
    assert 0 < counts["num_drafts"] < counts["num_draft_tokens"] <= 3 * counts["num_drafts"], counts
    assert sorted(per_position) == [0, 1, 2] and sum(per_position.values()) == counts["num_accepted_tokens"] > 0
    assert per_position[0] >= per_position[1] >= per_position[2]
    kept = round(counts["num_accepted_tokens"] / counts["num_draft_tokens"] * 100)
    assert f"**Drafts kept** {kept}%" in panel, panel
