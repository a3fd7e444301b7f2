"""`npu-llm doctor` on this (CPU) machine and with the fake torch_npu installed."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import FAKE_TORCH_NPU as FAKE


def _doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.entrypoints.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=180, env={**os.environ, **(env or {})})


def _row(output: str, name: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(name))


def test_cpu_machine_passes_with_warnings():
    run = _doctor()
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("numpy < 2", "tritonserver", "model files"):
        assert " OK " in _row(run.stdout, name), name
    for name in ("npu-smi info", "torch_npu", "NPU device files"):
        assert " WARN " in _row(run.stdout, name), name
    assert "0 failed" in run.stdout
    assert " OK " in _row(run.stdout, "serving layout") and "1 engine x TP 1 = 1 rank on the cpu" in run.stdout


def test_the_cpu_level_and_its_kernels_are_shown():
    from npu_llm_kernels.cpu_features import ENV, cpu_features

    run = _doctor()
    assert f"CPU level {cpu_features().level}" in _row(run.stdout, "CPU level") and " OK " in _row(run.stdout, "CPU level")
    assert " OK " in _row(run.stdout, "CPU kernels") and "build of npu_llm_kernels/csrc loaded" in run.stdout
    off = _doctor(env={"NPU_LLM_CPU_KERNELS": "0"})
    assert " WARN " in _row(off.stdout, "CPU kernels") and "not in use: NPU_LLM_CPU_KERNELS=0" in off.stdout
    wrong = _doctor(env={ENV: "sse4"})
    assert wrong.returncode == 1 and " FAIL " in _row(wrong.stdout, "CPU level")
    assert f"fix: unset {ENV}" in wrong.stdout


def test_missing_model_fails_with_a_fix():
    run = _doctor("--model", "/no/such/model")
    assert run.returncode == 1
    assert " FAIL " in _row(run.stdout, "model files")
    assert "fix: pass --model" in run.stdout


def test_with_torch_npu_installed(tmp_path):
    pythonpath = os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")])
    cann = tmp_path / "ascend-toolkit"
    cann.mkdir()
    ready = _doctor(env={"PYTHONPATH": pythonpath, "ASCEND_HOME_PATH": str(cann), "TASK_QUEUE_ENABLE": "2",
                         "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE": "1"})
    assert " OK " in _row(ready.stdout, "torch / torch_npu versions"), ready.stdout + ready.stderr
    assert " OK " in _row(ready.stdout, "torch_npu ops") and "every op of attention" in ready.stdout
    assert "'2': honoured: torch_npu's operator queue" in _row(ready.stdout, "TASK_QUEUE_ENABLE")
    assert "'1': not applicable: gone from vllm-ascend too" in _row(ready.stdout, "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE")
    assert " OK " in _row(ready.stdout, "torch.npu.is_available()")
    assert " OK " in _row(ready.stdout, "CANN environment")
    assert " OK " in _row(ready.stdout, "NPU graph mode")
    assert " OK " in _row(ready.stdout, "ATB ops (CANN NNAL)") and "Ascend910B3" in _row(ready.stdout, "NPU chip")
    assert " INFO " in _row(ready.stdout, "one rope table per process")
    assert " OK " in _row(ready.stdout, "serving layout") and "1 npu device here from npu:0; 1 visible" in ready.stdout
    broken = _doctor("--engine-arg", "data_parallel_size=2", env={"PYTHONPATH": pythonpath, "ASCEND_HOME_PATH": str(cann), "FAKE_NPU_NNAL": "0",
                          "FAKE_NPU_SOC": "Ascend310P3"})
    assert broken.returncode == 1
    assert " FAIL " in _row(broken.stdout, "ATB ops (CANN NNAL)") and "fix: install CANN's NNAL" in broken.stdout
    assert " FAIL " in _row(broken.stdout, "NPU chip") and "fix: serve on Atlas A2/A3" in broken.stdout
    assert " FAIL " in _row(broken.stdout, "serving layout") and "2 engines x TP 1 = 2 npu devices" in broken.stdout
    assert "make more devices visible (ASCEND_RT_VISIBLE_DEVICES)" in broken.stdout
    env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")}
    no_cann = subprocess.run([sys.executable, "-m", "backend.entrypoints.cli", "doctor"], capture_output=True, text=True,
                             timeout=180, env={**env, "PYTHONPATH": pythonpath})
    assert no_cann.returncode == 1
    assert " FAIL " in _row(no_cann.stdout, "CANN environment") and "set_env.sh" in no_cann.stdout


# Each FAIL and WARN branch, in process, on a host changed to show it; every row must carry its fix.

def test_numpy_2_fails_with_the_pin_as_fix(monkeypatch):
    import numpy

    from backend.entrypoints import doctor

    monkeypatch.setattr(numpy, "__version__", "2.1.0")
    check = doctor.check_numpy()
    assert (check.status, check.detail) == (doctor.FAIL, "numpy 2.1.0") and 'pip install "numpy<2"' in check.fix


def test_torch_npu_for_another_torch_fails_naming_the_release(fake_npu, monkeypatch):
    from backend.entrypoints import doctor

    monkeypatch.setattr(fake_npu, "__version__", "2.1.0.post10")
    checks, _ = doctor.check_torch_npu()
    row = next(c for c in checks if c.name == "torch / torch_npu versions")
    assert row.status == doctor.FAIL and "torch_npu 2.1.0.post10" in row.detail
    assert "install the torch_npu release built for torch 2.13" in row.fix


def test_graph_mode_without_its_ops_warns_that_eager_works(fake_npu, monkeypatch):
    import torch

    from backend.entrypoints import doctor

    monkeypatch.delattr(torch.npu, "NPUGraph")
    check = doctor.check_npu_graphs(fake_npu)
    assert check.status == doctor.WARN and "torch.npu.NPUGraph" in check.detail and "eager mode works" in check.fix


def test_no_tritonserver_anywhere_fails_with_the_install_fix(monkeypatch):
    import importlib.util
    import shutil

    from backend.entrypoints import doctor

    find_spec, which = importlib.util.find_spec, shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "tritonserver" else which(name, *a, **k))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytriton" else find_spec(name, *a))
    check = doctor.check_tritonserver()
    assert check.status == doctor.FAIL and "nvidia-pytriton package is not installed" in check.detail
    assert "pip install nvidia-pytriton" in check.fix


def test_an_incomplete_model_folder_fails_naming_what_is_missing(tmp_path):
    from backend.entrypoints import doctor

    (tmp_path / "config.json").write_text("{}")
    check = doctor.check_model(str(tmp_path))
    assert check.status == doctor.FAIL and "missing *.safetensors, tokenizer.json" in check.detail
    assert "complete Hugging Face model folder" in check.fix


def test_a_torch_npu_without_the_models_ops_fails_naming_the_release(monkeypatch, request, tmp_path):
    """The ops the model will call (DeepSeek's latent attention: op-plugin 7.2.0's), against a torch_npu 2.5.1.post1."""
    from backend.entrypoints import doctor
    from tests.conftest import make_tiny_model

    monkeypatch.setenv("FAKE_TORCH_NPU_VERSION", "2.5.1.post1")
    request.getfixturevalue("fake_npu")
    deepseek = make_tiny_model("deepseek_v2", tmp_path / "v2", kv_lora_rank=512, qk_rope_head_dim=64,
                               qk_nope_head_dim=128, v_head_dim=128)
    repository = tmp_path / "model_repository"
    (repository / "llm" / "1").mkdir(parents=True)
    (repository / "llm" / "1" / "model.json").write_text(f'{{"model": "{deepseek}"}}')
    check = doctor.check_npu_ops(repository, {})
    assert check.status == doctor.FAIL and "lacks _npu_fused_infer_attention_score_v2_get_max_workspace" in check.detail
    assert "latent attention (MLA)" in check.detail and check.fix.startswith("install torch_npu 2.6.0.post3, 2.7.1")
    dense = doctor.check_npu_ops(repository, {"model": str(make_tiny_model("llama", tmp_path / "llama"))})
    assert dense.status == doctor.OK and "every op of attention (llama)" in dense.detail
    graphs = doctor.check_npu_ops(repository, {"model": str(tmp_path / "llama"), "enforce_eager": False})
    assert graphs.status == doctor.FAIL and "_npu_paged_attention_get_workspace" in graphs.detail
