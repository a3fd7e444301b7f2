"""Multi-LoRA in the engine: every adapter's greedy tokens equal PEFT's merged model in fp32, in batches that mix
adapters and the base model, through chunked prefill, prefix hits and preemption; adapters beyond max_loras and
max_cpu_loras; KV never shared across adapters; bad adapters refused at entry, with nothing lost."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from backend import LLM, LLMEngine, LoRARequest, SamplingParams
from backend.config import EngineConfig
from tests.conftest import greedy_tokens, make_peft_adapter, make_tiny_model

STEPS = 12
ATTENTION = ["q_proj", "v_proj"]
EVERYTHING = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(20, 45))] for _ in range(count)]


class Served:
    """A tiny base model, adapters of it, and each one's reference model (PEFT's merged, fp32)."""

    def __init__(self, tmp_path_factory, arch: str, specs: dict[str, tuple[int, list[str], bool]]):
        self.base = make_tiny_model(arch, tmp_path_factory.mktemp(f"lora-base-{arch}"))
        self.references = {None: None}
        self.requests: dict[str | None, LoRARequest | None] = {None: None}
        for i, (name, (rank, targets, rslora)) in enumerate(specs.items(), start=1):
            path = tmp_path_factory.mktemp(f"lora-{arch}-{name}")
            self.references[name] = make_peft_adapter(self.base, path, rank, targets, seed=i, use_rslora=rslora)
            self.requests[name] = LoRARequest(name, i, str(path))
        from tests.conftest import hf_model

        self.references[None] = hf_model(self.base)
        self._expected: dict = {}

    def expected(self, name: str | None, prompt: list[int]) -> list[int]:
        key = (name, tuple(prompt))
        if key not in self._expected:
            self._expected[key] = greedy_tokens(self.references[name], prompt, STEPS)
        return self._expected[key]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def served(request, tmp_path_factory):
    return Served(tmp_path_factory, request.param, {"small": (8, ATTENTION, False), "full": (16, EVERYTHING, True)})


def _engine(served: Served, default_model_dir, **overrides) -> LLMEngine:
    args = dict(model=str(served.base), tokenizer=str(default_model_dir), dtype="float32", enable_lora=True,
                max_loras=2, max_lora_rank=16, num_kv_blocks=64, block_size=16)
    return LLMEngine(**{**args, **overrides})


def _run(engine: LLMEngine, work: list[tuple[str | None, LoRARequest | None, list[int]]]) -> dict[str, list[int]]:
    """Requests arriving two a step while others run; each request id's tokens."""
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    results, pending = {}, list(enumerate(work))
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                i, (_, lora, prompt) = pending.pop(0)
                engine.add_request(str(i), {"prompt_token_ids": prompt}, params, lora)
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    return results


def test_adapters_change_the_output(served):
    """(Else every test below would pass on the base model alone.)"""
    prompt = _prompts(1)[0]
    outputs = {name: tuple(served.expected(name, prompt)) for name in served.references}
    assert len(set(outputs.values())) == len(outputs)


def test_a_batch_mixing_adapters_and_the_base_model_equals_peft_merged(served, default_model_dir):
    """Two adapters and the base model in every step, with 24-token chunks of prefill and preemption (12 blocks for
    18 sequences); then the last prompt again under each, from the prefix cache."""
    prompts = _prompts(3)
    work = [(name, served.requests[name], p) for p in prompts for name in served.requests] * 2
    engine = _engine(served, default_model_dir, num_kv_blocks=12, max_num_batched_tokens=24, max_num_seqs=18)
    for batch in (work, work[-3:]):
        results = _run(engine, batch)
        for i, (name, _, prompt) in enumerate(batch):
            assert results[str(i)] == served.expected(name, prompt), f"request {i} ({name or 'base'})"
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_cache_usage == 0


def test_the_same_prompt_under_two_adapters_never_shares_kv(served, default_model_dir):
    engine = _engine(served, default_model_dir)
    prompt = _prompts(1, seed=5)[0]
    hits = []
    for name in ("small", "full", None, "small"):
        before = engine.stats().prefix_cache_hits
        results = _run(engine, [(name, served.requests[name], prompt)])
        assert results["0"] == served.expected(name, prompt)
        hits.append(engine.stats().prefix_cache_hits - before)
    assert hits[:3] == [0, 0, 0]  # another adapter's blocks, or the base model's, are never hits
    assert hits[3] == len(prompt) // 16 * 16  # the same adapter's are


def test_more_adapters_than_slots_and_host_copies_all_finish_correct(tmp_path_factory, default_model_dir):
    """Four adapters through one slot and two host copies: requests wait for a slot, adapters are read again."""
    served = Served(tmp_path_factory, "llama", {f"a{i}": (8, EVERYTHING, False) for i in range(4)})
    prompts = _prompts(4, seed=1)
    work = [(name, served.requests[name], prompts[i % 4]) for i, name in enumerate(["a0", "a1", "a2", "a3"] * 2)]
    work += [(None, None, prompts[0])]
    engine = _engine(served, default_model_dir, max_loras=1, max_cpu_loras=2)
    results = _run(engine, work)
    for i, (name, _, prompt) in enumerate(work):
        assert results[str(i)] == served.expected(name, prompt), f"request {i} ({name})"
    assert len(engine.list_loras()) <= 2


def test_llm_generate_takes_one_adapter_or_one_per_prompt(served, default_model_dir):
    llm = LLM(model=str(served.base), tokenizer=str(default_model_dir), dtype="float32", enable_lora=True,
              max_loras=2, num_kv_blocks=64)
    prompts = _prompts(2, seed=2)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    one = llm.generate(inputs, params, served.requests["full"])
    assert [o.outputs[0].token_ids for o in one] == [served.expected("full", p) for p in prompts]
    each = llm.generate(inputs, params, [served.requests["small"], None])
    assert [o.outputs[0].token_ids for o in each] == [served.expected("small", prompts[0]),
                                                      served.expected(None, prompts[1])]
    with pytest.raises(ValueError, match="1 lora_requests for 2 prompts"):
        llm.generate(inputs, params, [None])
    llm.shutdown()


def test_a_mixture_of_experts_base_takes_attention_adapters(tmp_path_factory, default_model_dir):
    served = Served(tmp_path_factory, "qwen3_moe", {"attn": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], False)})
    prompts = _prompts(2, seed=3)
    work = [(name, served.requests[name], p) for p in prompts for name in served.requests]
    results = _run(_engine(served, default_model_dir), work)
    for i, (name, _, prompt) in enumerate(work):
        assert results[str(i)] == served.expected(name, prompt)
    # an adapter on the experts is refused, named
    experts = tmp_path_factory.mktemp("lora-experts")
    _write_adapter(experts, {"model.layers.0.mlp.experts.0.gate_proj": (torch.zeros(8, 64), torch.zeros(32, 8))})
    engine = _engine(served, default_model_dir)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj is not a layer this model serves adapters on"):
        engine.add_lora(LoRARequest("experts", 9, str(experts)))


def _write_adapter(path, modules: dict, **config):
    """A PEFT-format adapter written by hand: module -> (A, B)."""
    tensors = {}
    for module, (a, b) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    save_file(tensors, str(path / "adapter_model.safetensors"))
    rank = next(iter(modules.values()))[0].shape[0]
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                          **config}))


def test_bad_adapters_are_refused_at_entry_and_nothing_is_lost(served, default_model_dir, tmp_path):
    engine = _engine(served, default_model_dir)
    good = served.requests["full"]
    prompt = _prompts(1, seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    engine.add_request("running", {"prompt_token_ids": prompt}, params, good)
    engine.step()

    def refused(path, match, **request):
        lora = LoRARequest(request.get("name", "bad"), request.get("id", 7), str(path))
        with pytest.raises(ValueError, match=match):
            engine.add_request(None, {"prompt_token_ids": prompt}, params, lora)

    refused(tmp_path / "nowhere", "no adapter_config.json")
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8}))
    (tmp_path / "pickle" / "adapter_model.bin").write_bytes(b"\x80")
    refused(tmp_path / "pickle", "adapter_model.bin is a pickle, which is never loaded")
    q = "model.layers.0.self_attn.q_proj"
    for name, modules, config, match in [
        ("big", {q: (torch.zeros(32, 64), torch.zeros(64, 32))}, {}, "rank 32 is above max_lora_rank=16"),
        ("shape", {q: (torch.zeros(8, 96), torch.zeros(64, 8))}, {}, r"lora_A has shape \(8, 96\), this model needs "
                                                                     r"\(8, 64\)"),
        ("dora", {q: (torch.zeros(8, 64), torch.zeros(64, 8))}, {"use_dora": True}, "DoRA adapters are not served"),
        ("bias", {q: (torch.zeros(8, 64), torch.zeros(64, 8))}, {"bias": "all"}, "adapters with biases"),
        ("embed", {"model.embed_tokens": (torch.zeros(8, 512), torch.zeros(64, 8))}, {}, "embed_tokens is not a "
                                                                                          "layer this model serves"),
    ]:
        (tmp_path / name).mkdir()
        _write_adapter(tmp_path / name, modules, **config)
        refused(tmp_path / name, match)
    (tmp_path / "torn").mkdir()
    _write_adapter(tmp_path / "torn", {q: (torch.zeros(8, 64), torch.zeros(64, 8))})
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(b"{\"truncated")
    refused(tmp_path / "torn", "adapter_model.safetensors cannot be read")

    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            results[output.request_id] = output.outputs[0].token_ids
    assert results["running"] == served.expected("full", prompt)
    assert engine.stats().kv_cache_usage == 0


def test_an_adapter_needs_an_engine_with_enable_lora(served, default_model_dir):
    engine = _engine(served, default_model_dir, enable_lora=False)
    with pytest.raises(ValueError, match="need an engine started with enable_lora"):
        engine.add_request(None, {"prompt_token_ids": [1, 2, 3]}, SamplingParams(), served.requests["small"])


def test_lora_settings_are_checked_by_name():
    with pytest.raises(ValueError, match=r"max_lora_rank=17: must be one of 1, 8, 16, 32"):
        EngineConfig(max_lora_rank=17)
    with pytest.raises(ValueError, match=r"max_cpu_loras=1: must be at least max_loras \(2\)"):
        EngineConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("a", 0, "/x")


def test_tensor_parallel_adapters_equal_peft_merged(tmp_path_factory, default_model_dir):
    """TP=2 shards B of the column-parallel layers and A of the row-parallel ones, as vLLM does; each rank reads its
    own shards. The tokens equal TP=1's, which equal PEFT's merged model."""
    served = Served(tmp_path_factory, "llama", {"full": (16, EVERYTHING, True), "small": (8, ATTENTION, False)})
    prompts = _prompts(2, seed=6)
    work = [(name, served.requests[name], p) for p in prompts for name in served.requests]
    engine = _engine(served, default_model_dir, tensor_parallel_size=2)
    try:
        results = _run(engine, work)
        engine.remove_lora(served.requests["full"].lora_int_id)  # (every rank forgets it, and reads it again)
        again = _run(engine, work[:2])
    finally:
        engine.shutdown()
    for i, (name, _, prompt) in enumerate(work):
        assert results[str(i)] == served.expected(name, prompt), f"request {i} ({name or 'base'})"
    assert [again[str(i)] for i in range(2)] == [served.expected(name, p) for name, _, p in work[:2]]


def test_adapters_on_the_npu_follow_the_cpu(fake_npu, monkeypatch, tmp_path_factory, default_model_dir):
    """The NPU runs the adapters' shrink and expand as torch matmuls on its tensors (vllm-ascend's punica kernels
    are its own AscendC ops, not torch_npu's): greedy in bf16 on the fake NPU against the CPU's portable path, each
    first token among the CPU's five most likely; the adapter's tokens differ from the base model's; no block is held."""
    served = Served(tmp_path_factory, "llama", {"full": (16, EVERYTHING, True)})
    first, second = ({"prompt_token_ids": p} for p in _prompts(2, seed=7))
    prompts, loras = [first, first, second, second], [served.requests["full"], None] * 2
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    args = dict(model=str(served.base), tokenizer=str(default_model_dir), dtype="bfloat16", num_kv_blocks=8,
                enable_lora=True)
    with LLM(device="npu", **args) as llm:
        on_npu = [o.outputs[0] for o in llm.generate(prompts, params, loras)]
        assert llm.engine.kv.num_free_blocks == 8
        assert llm.engine.model.model.layers[0].self_attn.qkv_proj.lora.weights[0][0].device.type == "npu"
    monkeypatch.setenv("NPU_LLM_CPU_KERNELS", "0")
    with LLM(device="cpu", block_size=128, **args) as llm:
        on_cpu = [o.outputs[0] for o in llm.generate(prompts, params, loras)]
    for npu_out, cpu_out in zip(on_npu, on_cpu):
        assert len(npu_out.token_ids) == 6 and npu_out.token_ids[0] in cpu_out.logprobs[0]
    assert on_npu[0].token_ids != on_npu[1].token_ids and on_npu[2].token_ids != on_npu[3].token_ids


def test_max_loras_counts_adapters_by_id(served, default_model_dir):
    """A name given again with a new id (an adapter reloaded) is another adapter: with one slot, its requests wait for
    the first's to finish, and each runs with its own weights."""
    prompt = _prompts(1, seed=8)[0]
    again = LoRARequest("small", 9, served.requests["full"].lora_path)  # the name of one, the weights of the other
    engine = _engine(served, default_model_dir, max_loras=1)
    results = _run(engine, [("small", served.requests["small"], prompt), ("full", again, prompt)])
    assert results["0"] == served.expected("small", prompt) and results["1"] == served.expected("full", prompt)


def test_an_adapter_config_that_is_not_a_json_object_is_refused_by_name(served, default_model_dir, tmp_path):
    (tmp_path / "adapter_config.json").write_text("[8, 16]")
    with pytest.raises(ValueError, match="adapter_config.json must be a JSON object, got list"):
        _engine(served, default_model_dir).add_lora(LoRARequest("list", 3, str(tmp_path)))
