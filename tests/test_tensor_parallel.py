"""Tensor parallel over gloo (2 local processes) computes what one process computes: the same greedy tokens and
logprobs, through chunked prefill and a prefix-cache hit, on Llama with GQA and on Qwen2 with biases. A rank that
dies or hangs stops the engine with a clear error, within the collectives' timeout, and no process stays behind.
`bench throughput` runs it and profiles what its collectives cost."""
from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

from backend import LLM, LLMEngine, SamplingParams
from backend.engine.workers import RankFailedError
from backend.models.registry import DEFAULT_MODEL
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.slow
STEPS = 64


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(1, 500) for _ in range(40)]  # two full 16-token blocks and more, asked twice
    return [shared + [rng.randrange(1, 500) for _ in range(n)] for n in (5, 20)] + [
        [rng.randrange(1, 500) for _ in range(n)] for n in (3, 57)]


def _generate(model_dir, tokenizer_dir, tensor_parallel_size: int, **engine_args):
    # prompt logprobs for the first and last prompts (the second, which hits the cache, without)
    params = [SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5,
                             prompt_logprobs=2 if i in (0, 3) else None) for i in range(len(_prompts()))]
    with LLM(model=str(model_dir), tokenizer=str(tokenizer_dir), dtype="float32", num_kv_blocks=64, block_size=16,
             max_num_batched_tokens=32, max_num_seqs=8, tensor_parallel_size=tensor_parallel_size,
             **engine_args) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params)
        stats = llm.engine.stats()
    return outputs, stats


@pytest.mark.parametrize("arch", ["llama", "qwen2", "glm4"])  # (GLM-4: a fused gate_up tensor and q/k rows reordered)
def test_two_ranks_over_gloo_equal_one(arch, tmp_path, default_model_dir):
    model_dir = make_tiny_model(arch, tmp_path / arch)
    alone, _ = _generate(model_dir, default_model_dir, 1)
    sharded, stats = _generate(model_dir, default_model_dir, 2)
    assert stats.prefix_cache_hit_rate > 0  # the second prompt with the shared prefix reused its blocks
    assert max(len(p) for p in _prompts()) > 32  # longer than a step's budget: chunked prefill
    _assert_same(alone, sharded)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "deepseek_v2", "deepseek_v3"])
def test_moe_experts_sharded_or_spread_over_two_ranks_equal_one(arch, tmp_path, default_model_dir):
    """Tensor parallel splits every expert's intermediate size; expert parallel gives each rank half the experts
    whole. Both give one process's greedy tokens and top-5 logprobs (GLM-4.5 and DeepSeek: with their shared
    experts; DeepSeek's latent attention splits its heads, and each rank caches the whole latent)."""
    model_dir = make_tiny_model(arch, tmp_path / arch)
    alone, _ = _generate(model_dir, default_model_dir, 1)
    sharded, stats = _generate(model_dir, default_model_dir, 2)
    _assert_same(alone, sharded)
    spread, spread_stats = _generate(model_dir, default_model_dir, 2, enable_expert_parallel=True)
    _assert_same(alone, spread)
    # The expert load: every (token, expert) pair of the two sparse layers, counted once per rank that served it.
    pairs = stats.num_computed_tokens * 2 * 2  # top-2, two MoE layers of three
    assert stats.expert_load == [pairs]  # tensor parallel: both ranks serve every pair
    assert sum(spread_stats.expert_load) == pairs and len(spread_stats.expert_load) == 2

def test_drafts_verified_over_two_ranks_equal_one(tiny_llama, default_model_dir):
    """speculative_config under tensor parallel: each verification runs k + 1 positions on both ranks, and the tokens
    and logprobs are one process's without drafts. n-gram's drafts were both kept and rejected; a draft model (here
    the target itself, unsharded on rank 0 with its own KV under the sharded target's block tables) was always right."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    alone, _ = _generate(tiny_llama, default_model_dir, 1)
    sharded, stats = _generate(tiny_llama, default_model_dir, 2, speculative_config=ngram)
    _assert_same(alone, sharded)
    assert 0 < stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens
    drafted, stats = _generate(tiny_llama, default_model_dir, 2,
                               speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 3})
    _assert_same(alone, drafted)
    assert 0 < stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens


def test_mtp_drafts_over_two_ranks_equal_one(tmp_path, default_model_dir):
    """DeepSeek V3's MTP layer (latent attention, experts) drafting 2 tokens under tensor parallel: the head is a
    layer of the sharded model, its pass made on every rank over the hidden states each kept; tokens and logprobs
    are one process's without drafts, and drafts were kept."""
    from tests.conftest import add_mtp_layer

    model_dir = add_mtp_layer(make_tiny_model("deepseek_v3", tmp_path / "v3"))
    alone, _ = _generate(model_dir, default_model_dir, 1)
    sharded, stats = _generate(model_dir, default_model_dir, 2,
                               speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2})
    _assert_same(alone, sharded)
    assert 0 < stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_sharded_over_two_ranks_draft_as_on_one(method, tmp_path, default_model_dir):
    """An EAGLE / EAGLE-3 head under tensor parallel, its attention and MLP sharded as the target's layers (EAGLE-3's
    lm_head over its draft vocabulary whole on each rank): the same three drafts after a prompt as on one rank (the
    first from the prompt, two from the head's own output), and the same tokens and logprobs as one rank."""
    from tests.conftest import make_eagle_head

    target = make_tiny_model("llama", tmp_path / "target", num_hidden_layers=4)
    head = make_eagle_head(target, tmp_path / method, method, aux_layers=[1, 2, 3])
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3}

    def first_drafts(tensor_parallel_size: int) -> list[int]:
        engine = LLMEngine(model=str(target), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=16,
                           tensor_parallel_size=tensor_parallel_size, speculative_config=spec)
        try:
            engine.add_request("r", {"prompt_token_ids": _prompts()[3]}, SamplingParams(temperature=0, max_tokens=8))
            engine.step()
            return list(engine.scheduler.running[0].draft_token_ids)
        finally:
            engine.shutdown()

    drafts = first_drafts(1)
    assert len(drafts) == 3 and first_drafts(2) == drafts
    alone, _ = _generate(target, default_model_dir, 1, speculative_config=spec)
    sharded, stats = _generate(target, default_model_dir, 2, speculative_config=spec)
    _assert_same(alone, sharded)
    assert stats.spec_decode.num_draft_tokens > 0


def _assert_same(alone, sharded) -> None:
    """The same greedy tokens, the same top-5 at each step, logprobs within 1e-4; the same prompt logprobs (their
    top 2) within 1e-4."""
    worst = 0.0
    for whole_a, whole_b in zip(alone, sharded):
        a, b = whole_a.outputs[0], whole_b.outputs[0]
        assert a.token_ids == b.token_ids and len(a.token_ids) == STEPS
        prompt_a, prompt_b = (whole_a.prompt_logprobs or [None])[1:], (whole_b.prompt_logprobs or [None])[1:]
        assert len(prompt_a) == (len(whole_a.prompt_token_ids) - 1 if whole_a.prompt_logprobs else 0)
        for step_a, step_b in zip(a.logprobs + prompt_a, b.logprobs + prompt_b):
            assert step_a.keys() == step_b.keys()  # the same most likely tokens
            worst = max(worst, *(abs(step_a[t].logprob - step_b[t].logprob) for t in step_a))
    assert worst < 1e-4, worst


def test_ray_actors_equal_local_ranks_and_leave_no_process(tmp_path, default_model_dir):
    """distributed_executor_backend="ray" on a local Ray instance (the issue's ray.init(num_cpus=2)): rank 1 is
    a Ray actor, and the outputs are those of one process, for Llama and for GLM-4.5 with expert parallel;
    shutting down leaves no Ray process behind."""
    import ray

    model_dir = make_tiny_model("llama", tmp_path / "llama")
    moe_dir = make_tiny_model("glm4_moe", tmp_path / "glm4_moe")
    alone, _ = _generate(model_dir, default_model_dir, 1)
    moe_alone, _ = _generate(moe_dir, default_model_dir, 1)
    before = set(psutil.pids())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:  # (the tokenizer by the default model's name, as --tokenizer takes it)
        sharded, _ = _generate(model_dir, DEFAULT_MODEL, 2, distributed_executor_backend="ray")
        moe_spread, _ = _generate(moe_dir, DEFAULT_MODEL, 2, distributed_executor_backend="ray",
                                  enable_expert_parallel=True)
    finally:
        ray.shutdown()
    _assert_same(alone, sharded)
    _assert_same(moe_alone, moe_spread)
    deadline = time.monotonic() + 15
    while (left := [p for p in _processes(set(psutil.pids()) - before) if "ray" in p]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left


def test_ray_never_gives_a_rank_the_engines_own_device(fake_npu, monkeypatch):
    """A cluster started with every device may place a rank on rank 0's: the start fails, saying what to do."""
    import torch

    from backend.engine.ray_executor import _check_not_ours

    monkeypatch.setenv("FAKE_NPU_DEVICES", "4")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")  # the engine's npu:1 is the host's NPU 5
    _check_not_ours([("10.0.0.1", ["5"]), ("10.0.0.2", ["6"])], "10.0.0.2", torch.device("npu", 1))  # elsewhere
    with pytest.raises(RuntimeError, match=r"rank 2 the engine's own device \(npu:1, id 5\).*ASCEND_RT_VISIBLE"):
        _check_not_ours([("10.0.0.1", ["4"]), ("10.0.0.1", ["5"])], "10.0.0.1", torch.device("npu", 1))


def _processes(pids) -> list[str]:
    names = []
    for pid in pids:
        try:
            names.append(" ".join(psutil.Process(pid).cmdline()))
        except psutil.Error:  # gone meanwhile
            pass
    return names


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tp-llama"))


def _running_engine(model_dir, tokenizer_dir):
    """A TP=2 engine one request into a long generation, and its worker process."""
    engine = LLMEngine(model=str(model_dir), tokenizer=str(tokenizer_dir), dtype="float32", num_kv_blocks=64,
                       tensor_parallel_size=2)
    [worker] = engine.runner.workers.processes
    engine.add_request(None, {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=500, ignore_eos=True))
    for _ in range(3):
        engine.step()
    return engine, worker


def _steps_until_failure(engine) -> tuple[RankFailedError, float]:
    start = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        while time.monotonic() - start < 120:
            engine.step()
    return failure.value, time.monotonic() - start


def test_a_killed_rank_stops_the_engine_at_once_with_a_clear_error(tiny_llama, default_model_dir):
    engine, worker = _running_engine(tiny_llama, default_model_dir)
    os.kill(worker.pid, signal.SIGKILL)
    error, waited = _steps_until_failure(engine)
    assert "rank 1 exited with code -9" in str(error) and waited < 10
    engine.shutdown()
    assert not worker.is_alive()


def test_a_hung_rank_fails_the_step_after_the_timeout_and_is_stopped(tiny_llama, default_model_dir, monkeypatch):
    monkeypatch.setenv("NPU_LLM_DISTRIBUTED_TIMEOUT_S", "3")
    engine, worker = _running_engine(tiny_llama, default_model_dir)
    os.kill(worker.pid, signal.SIGSTOP)  # alive, but it never answers
    try:
        error, waited = _steps_until_failure(engine)
        assert "rank 1 running" in str(error) and 2.5 < waited < 20
        engine.shutdown()
        assert not worker.is_alive()  # killed: it could not be told to stop
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)


def test_a_model_that_does_not_shard_evenly_is_refused_before_any_worker_starts(default_model_dir):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide num_attention_heads \(9\)"):
        LLMEngine(model=str(default_model_dir), tensor_parallel_size=2)  # SmolLM2-135M: 9 heads, 3 KV heads
    assert set(multiprocessing.active_children()) == before


def test_a_start_that_fails_after_the_workers_started_leaves_none_behind(tiny_llama, default_model_dir):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        LLMEngine(model=str(tiny_llama), tokenizer=str(default_model_dir), dtype="float32", kv_cache_memory_gb=1e-9,
                  tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == before


def test_bench_throughput_runs_tensor_parallel_and_profiles_its_collectives(tiny_llama, default_model_dir, tmp_path):
    """`npu-llm bench throughput --engine-arg tensor_parallel_size=2 --profile DIR`, as docs/parallelism.md measures TP's
    overhead: it runs, and the profile's "TP all-reduce, all-gather" row holds time, within the step total."""
    run = subprocess.run(
        [sys.executable, "-m", "backend.entrypoints.cli", "bench", "throughput", "--model", str(tiny_llama), "--tokenizer",
         str(default_model_dir), "--dtype", "float32", "--num-kv-blocks", "64", "--engine-arg",
         "tensor_parallel_size=2", "--baseline", "none", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
         "--profile", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["output_tokens"] == 8
    [written] = tmp_path.glob("breakdown-*.json")
    steps = json.loads(written.read_text())["breakdown"]["all"]
    collectives, total = steps["TP all-reduce, all-gather"]["ms_per_step"], steps["step total"]["ms_per_step"]
    assert 0 < collectives < total
    assert "TP all-reduce, all-gather" in run.stderr  # the table it prints
