"""Profile captures (LLM.start_profile / stop_profile): the trace file, and a breakdown that accounts for the steps."""
from __future__ import annotations

import json
import time

import pytest

from backend import LLM, SamplingParams
from backend.engine.profiler import ROWS


def _run_timed(engine, until_done) -> list[float]:
    """Step the engine until until_done(); each step's wall time, measured here."""
    times = []
    while not until_done():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def test_capture_writes_a_trace_and_a_breakdown_that_sums_to_the_steps(tiny_llama_dir, default_model_dir, tmp_path):
    llm = LLM(model=str(tiny_llama_dir), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=64,
              profile_dir=str(tmp_path), max_num_batched_tokens=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.start_profile()
    engine.add_request("a", list(range(1, 150)), params)  # 149 tokens: prefill-only chunks under a 64 budget
    times = _run_timed(engine, lambda: engine.outputs.states["a"].request.num_output_tokens >= 3)
    engine.add_request("b", list(range(5, 100)), params)  # arrives while "a" decodes: mixed steps
    times += _run_timed(engine, lambda: not engine.has_unfinished_requests())
    result = llm.stop_profile()

    trace = json.loads(open(result.trace_path).read())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"step", "schedule", "matmul", "attention.prefill", "attention.decode", "sample"} <= names

    breakdown = result.breakdown()
    counts = {kind: v["steps"]["count"] for kind, v in breakdown.items()}
    # 149 tokens in chunks of 64, 64, 21; then "b"'s 95 tokens beside "a"'s decodes in chunks of 63 and 32
    assert counts["prefill-only"] == 3 and counts["mixed"] == 2 and counts["decode-only"] >= 10
    assert counts["all"] == len(times) == counts["prefill-only"] + counts["mixed"] + counts["decode-only"]
    everything = breakdown["all"]
    rows = sum(everything[row]["ms_per_step"] for row in ROWS)
    assert rows == pytest.approx(everything["step total"]["ms_per_step"], rel=1e-9)
    measured_ms = 1e3 * sum(times) / len(times)
    assert everything["step total"]["ms_per_step"] == pytest.approx(measured_ms, rel=0.10)
    # Where each kind of step spends its time: no decode attention in prefill-only steps, no prefill in decode-only.
    assert breakdown["prefill-only"]["decode attention"]["ms_per_step"] == 0
    assert breakdown["prefill-only"]["decode matmuls"]["ms_per_step"] == 0
    assert breakdown["decode-only"]["prefill attention"]["ms_per_step"] == 0
    assert breakdown["decode-only"]["prefill matmuls"]["ms_per_step"] == 0
    for kind in ("prefill-only", "decode-only", "mixed"):
        assert breakdown[kind]["sampler"]["ms_per_step"] > 0
    assert breakdown["mixed"]["prefill matmuls"]["ms_per_step"] > 0 < breakdown["mixed"]["decode matmuls"]["ms_per_step"]
    assert 0 < everything["step total"]["pct_wall"] <= 100

    table = result.table()
    for row in ROWS:  # (a dense model's table leaves out the MoE rows)
        assert (row in table) != row.startswith("MoE")
    written = sorted(tmp_path.glob("breakdown-*.txt"))
    assert len(written) == 1 and written[0].read_text().strip() == table


def test_profiling_needs_a_profile_dir_and_one_capture_at_a_time(tiny_llama_dir, default_model_dir, tmp_path):
    args = dict(model=str(tiny_llama_dir), tokenizer=str(default_model_dir), dtype="float32", num_kv_blocks=64)
    llm = LLM(**args)
    with pytest.raises(ValueError, match="profile_dir"):
        llm.start_profile()
    llm = LLM(profile_dir=str(tmp_path), **args)
    with pytest.raises(RuntimeError, match="no profile capture"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    assert llm.stop_profile().steps  # and the engine goes on working after it
    [out] = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    assert len(out.outputs[0].token_ids) == 2
