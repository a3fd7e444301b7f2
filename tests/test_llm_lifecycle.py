"""An LLM's life ends with shutdown(), a `with` block, garbage collection or interpreter exit, and each frees what
it held: the tensor-parallel workers, their process group (so that the next engine of the process can start its
own), the KV cache. Engines can follow one another in one process, and give the same tokens."""
from __future__ import annotations

import gc
import multiprocessing
import subprocess
import sys
import textwrap
import time
import weakref

import psutil
import pytest
import torch
import torch.distributed as dist

from backend import LLM, LLMEngine, SamplingParams
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.slow  # (tensor-parallel engines start, as in test_tensor_parallel.py)
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": list(range(7, 30))}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _gone(pid: int, wait_s: float = 15) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("lifecycle-llama"))


def test_with_llm_shuts_it_down(tiny_llama, default_model_dir):
    with LLM(model=str(tiny_llama), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=16) as llm:
        assert _tokens(llm.generate(PROMPTS, GREEDY))[0]
    assert llm.engine.runner.kv_caches == []  # freed, though `llm` is still referenced
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, GREEDY)
    llm.shutdown()  # again: nothing happens


def test_a_collected_engine_frees_its_kv_cache(fake_npu, tiny_llama, default_model_dir):
    """On a (fake) device: shutdown() gives the KV cache back at once; collection gives back everything, and a
    second engine after the first leaves the device as the first did."""
    args = dict(model=str(tiny_llama), tokenizer=str(default_model_dir), device="npu", dtype="bfloat16",
                block_size=128, num_kv_blocks=8)
    gc.collect()
    after = []
    for _ in range(2):
        llm = LLM(**args)
        kv_bytes = sum(k.nbytes + v.nbytes for k, v in llm.engine.runner.kv_caches)
        held = torch.npu.memory_allocated()
        llm.shutdown()
        assert held - torch.npu.memory_allocated() >= kv_bytes > 0
        engine = weakref.ref(llm.engine)
        del llm
        gc.collect()
        assert engine() is None  # (nothing, the finalizer included, keeps the engine alive)
        after.append(torch.npu.memory_allocated())
    assert after[0] == after[1]


def test_tensor_parallel_engines_one_after_another(tiny_llama, default_model_dir):
    """TP=2 engines in turn in one process: one in a `with` block, one collected without shutdown(), one used
    through LLMEngine and left in a reference cycle (the next engine's start collects it). Each leaves no worker
    and no process group behind, and all give the same greedy tokens."""
    args = dict(model=str(tiny_llama), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=64,
                tensor_parallel_size=2)
    before = set(multiprocessing.active_children())
    threads = torch.get_num_threads()

    def assert_released(worker) -> None:
        assert _gone(worker.pid) and set(multiprocessing.active_children()) == before
        assert not dist.is_initialized() and torch.get_num_threads() == threads

    with LLM(**args) as llm:
        first = _tokens(llm.generate(PROMPTS, GREEDY))
        [worker] = llm.engine.runner.workers.processes
    assert_released(worker)
    del llm

    llm = LLM(**args)
    second = _tokens(llm.generate(PROMPTS, GREEDY))
    [worker] = llm.engine.runner.workers.processes
    with pytest.raises(RuntimeError, match="shut that engine down first"):
        LLM(**args)  # a second TP engine while this one runs: refused before any worker starts
    assert set(multiprocessing.active_children()) == before | {worker}
    del llm  # no shutdown()
    gc.collect()
    assert_released(worker)

    engine = LLMEngine(**args)
    [worker] = engine.runner.workers.processes
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    third = {}
    while engine.has_unfinished_requests():
        third.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    engine.cycle = engine  # garbage once deleted, but only a collection frees it
    del engine
    with LLM(**args) as llm:
        assert not worker.is_alive()
        fourth = _tokens(llm.generate(PROMPTS, GREEDY))
        [worker] = llm.engine.runner.workers.processes
    assert_released(worker)
    assert first == second == [third[str(i)] for i in range(len(PROMPTS))] == fourth


def test_an_engine_still_running_at_exit_does_not_hang_it(tiny_llama, default_model_dir):
    script = textwrap.dedent(f"""
        from backend import LLM, SamplingParams
        llm = LLM(model={str(tiny_llama)!r}, tokenizer={str(default_model_dir)!r}, dtype="float32",
                  num_kv_blocks=64, tensor_parallel_size=2)
        [worker] = llm.engine.runner.workers.processes
        print(worker.pid, flush=True)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        # the interpreter exits with the engine and its worker running
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "could not stop" not in run.stderr, run.stderr[-3000:]
    assert _gone(int(run.stdout.split()[0]))
