"""Every CPU a user has (npu_llm_kernels/cpu_features.py): the level knob, builds keyed by ISA, the default model at
each level this machine can run, and the extension compiled for aarch64."""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npu_llm_kernels import cpu
from npu_llm_kernels.cpu_features import ENV, X86_LEVELS, choose, cpu_features, host_level


def test_the_knob_lowers_the_level_and_never_raises_it():
    assert choose("amx", "") == choose("amx", "amx")
    avx2 = choose("amx", " AVX2 ")
    assert (avx2.level, avx2.host, avx2.build) == ("avx2", "amx", "avx2")
    assert not avx2.onednn_bf16 and not avx2.native_bf16 and "lowered from amx" in avx2.describe()
    assert choose("amx", "amx").build == "avx512_bf16"  # AMX is oneDNN's: the C++ build is avx512_bf16's
    assert not choose("avx512", "").native_bf16
    with pytest.raises(ValueError, match="this CPU's level is avx2"):
        choose("avx2", "avx512")
    with pytest.raises(ValueError, match="expected one of x86_64, avx2"):
        choose("avx2", "sse4")
    with pytest.raises(ValueError, match="expected one of aarch64"):
        choose("aarch64", "avx2")


def test_a_level_this_cpu_lacks_fails_the_load_naming_the_levels(tiny_llama_dir):
    lacking = "aarch64" if host_level() in X86_LEVELS else "avx2"
    run = subprocess.run([sys.executable, "-c", f"from backend import LLM; LLM(model={str(tiny_llama_dir)!r})"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, ENV: lacking})
    assert run.returncode != 0 and f"{ENV}={lacking!r}: expected one of" in run.stderr, run.stderr[-2000:]


@pytest.mark.slow
def test_default_model_in_bf16_answers_in_full_at_every_level(cpu_level):
    """At each level (AVX2's fp32-packed matmuls and portable kernels included) the default model gives its
    whole greedy answer, and a right one."""
    from backend import LLM, SamplingParams

    llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4)
    assert cpu.compiled().compiled_isa() == cpu_features().build
    # a prompt the model is sure of: its chat answer's first word is a near-tie in bf16 ("The" or "L'")
    full = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert full[0].outputs[0].text.startswith(" Paris"), full[0].outputs[0].text
    assert len(full[0].outputs[0].token_ids) == 32


# An AVX2-only CPU as torch and oneDNN see it, on any x86 CPU: their own kernels held to AVX2 too.
AS_AN_AVX2_CPU = {ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
AVX2_SERVING = """
import torch
from backend import LLM, SamplingParams
weight = torch.randn(64, 64, dtype=torch.bfloat16)
try:
    torch.ops.mkldnn._reorder_linear_weight(weight, None)
    print("REORDER RAN")
except RuntimeError as e:
    print("REORDER REFUSED:", e)
llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4)
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
print("ANSWER:", repr(out.text))
"""


@pytest.mark.slow
def test_the_default_model_serves_where_onednn_refuses_bf16():
    """What a user met on an AVX2-only CPU: oneDNN refuses bf16 weights (the RuntimeError that kept `make up`
    from ever getting ready). Held to AVX2 here, oneDNN refuses just the same, and the bf16 model still loads and
    answers."""
    if host_level() not in X86_LEVELS[1:]:
        pytest.skip(f"no AVX2 on a {host_level()} CPU")
    run = subprocess.run([sys.executable, "-c", AVX2_SERVING], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **AS_AN_AVX2_CPU})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "REORDER REFUSED: mkldnn_reorder_linear_weight: bf16 path needs" in run.stdout, run.stdout
    assert "ANSWER: ' Paris" in run.stdout, run.stdout


def _load_in_a_process(level: str) -> dict:
    """Which module a process at `level` loads from the extension cache it shares with the test process."""
    code = ("import json; from npu_llm_kernels import cpu; m = cpu.compiled(); "
            "print(json.dumps({'file': m.__file__, 'isa': m.compiled_isa()}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, ENV: level})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _disassembly(path: str) -> str:
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                          check=True).stdout


def test_the_extension_cache_is_keyed_by_isa():
    """A cache shared by machines of two levels (a home directory on NFS): a build under one level, then a load
    under another, gets each level its own binary, and the lower one holds no instruction above its ISA."""
    high = host_level()
    if high not in X86_LEVELS[1:]:
        pytest.skip(f"one level on a {high} CPU: nothing to share a cache with")
    low = "avx2" if high != "avx2" else "x86_64"  # x86_64 builds the portable kernels with SSE only
    lower, higher = _load_in_a_process(low), _load_in_a_process(high)
    assert lower["isa"] == low and higher["isa"] == choose(high, "").build
    assert Path(lower["file"]).parent != Path(higher["file"]).parent
    wide = "%zmm" if low == "avx2" else "%ymm"  # AVX-512's registers in an AVX2 build, AVX's in an SSE one
    assert wide not in _disassembly(lower["file"])
    if high != "avx2":  # the AVX-512 decode kernel really is in the higher build
        assert "%zmm" in _disassembly(higher["file"])


AARCH64_GXX = "aarch64-linux-gnu-g++"


def _cross_compile(source: Path, out: Path) -> subprocess.CompletedProcess:
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    from npu_llm_kernels.cpu_features import BUILDS

    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"], str(cpu.CSRC)]]
    return subprocess.run(
        [AARCH64_GXX, "-std=c++20", "-fPIC", *cpu.COMMON_CFLAGS, *BUILDS["aarch64"], *includes,
         "-DTORCH_EXTENSION_NAME=npu_llm_cpu_kernels_aarch64", "-c", str(source), "-o", str(out)],
        capture_output=True, text=True, timeout=600)


def test_the_extension_compiles_for_aarch64(tmp_path):
    """Kunpeng 920 hosts (Atlas servers) are aarch64: every source compiles there with the aarch64 build's flags,
    so x86-only code outside an ISA guard fails here, not on a user's Ascend host."""
    assert shutil.which(AARCH64_GXX), f"{AARCH64_GXX} not found: apt-get install g++-aarch64-linux-gnu (make test does)"
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        runs = {s: pool.submit(_cross_compile, s, tmp_path / f"{s.stem}.o") for s in cpu.SOURCES}
    for source, run in runs.items():
        assert run.result().returncode == 0, f"{source.name}:\n{run.result().stderr[-3000:]}"
        header = (tmp_path / f"{source.stem}.o").read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64


def test_logits_that_tie_rank_the_greedy_token_first_at_every_level(tiny_llama_dir, default_model_dir, tmp_path,
                                                                    cpu_level):
    """A head whose second half repeats its first ties every logit with a twin, in bf16 as in fp32: at each level
    greedy takes the lower id, which alone has rank 1 and comes first among the alternatives (vLLM's rule, which
    vllm_backend's additional-outputs tests hold)."""
    from backend import LLM, SamplingParams
    from tests.conftest import rewrite_checkpoint

    def twin_rows(tensors):
        head = tensors["lm_head.weight"]
        head[head.shape[0] // 2:] = head[: head.shape[0] // 2]

    twins = rewrite_checkpoint(tiny_llama_dir, tmp_path, change_tensors=twin_rows)
    half = json.loads((twins / "config.json").read_text())["vocab_size"] // 2
    llm = LLM(model=str(twins), tokenizer=str(default_model_dir), dtype="bfloat16", num_kv_blocks=32, max_num_seqs=2)
    [out] = llm.generate({"prompt_token_ids": [5, 17, 42, 99]},
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    for token, position in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert token < half
        assert [(tid, lp.rank) for tid, lp in position.items()] == [(token, 1), (token + half, 2)]
        assert position[token].logprob == position[token + half].logprob
