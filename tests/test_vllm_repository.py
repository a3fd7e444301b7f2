"""A model repository written for Triton's vllm_backend (its sample: backend "vllm", no model.py, vLLM's
model.json keys), with only "model" pointed at a local folder, served by npu-llm unchanged."""
from __future__ import annotations

import json
import shutil
import urllib.request

import pytest

from backend import LLM, SamplingParams
from tests.conftest import free_port

pytestmark = pytest.mark.slow

VLLM_BACKEND_CONFIG = """backend: "vllm"

# Disabling batching in Triton, let vLLM handle the batching on its own.
max_batch_size: 0

# We need to use decoupled transaction policy for saturating
# vLLM engine for max throughtput.
model_transaction_policy {
  decoupled: True
}

instance_group [
  {
    count: 1
    kind: KIND_MODEL
  }
]
"""


def test_a_vllm_backend_repository_serves_unchanged(tmp_path, default_model_dir):
    from backend.entrypoints.serve import start_server, stop_process_group, wait_ready

    repository = tmp_path / "model_repository"
    (repository / "vllm_model" / "1").mkdir(parents=True)
    (repository / "vllm_model" / "config.pbtxt").write_text(VLLM_BACKEND_CONFIG)
    model_json = {"model": str(default_model_dir), "disable_log_requests": True, "gpu_memory_utilization": 0.5,
                  "enforce_eager": True}
    (repository / "vllm_model" / "1" / "model.json").write_text(json.dumps(model_json))
    ports = free_port(), free_port(), free_port()
    log_path = tmp_path / "tritonserver.log"
    with open(log_path, "w") as log:
        process, work_dir = start_server(repository, {"dtype": "float32", "num_kv_blocks": 128}, *ports,
                                         log_file=log, new_session=True)
    try:
        wait_ready(ports[0], process, timeout=300)
        body = {"text_input": "The capital of France is", "parameters": {"temperature": 0, "max_tokens": 8},
                "exclude_input_in_output": True}
        request = urllib.request.Request(f"http://127.0.0.1:{ports[0]}/v2/models/vllm_model/generate",
                                         data=json.dumps(body).encode(), method="POST")
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    except Exception:
        raise AssertionError(log_path.read_text()[-4000:])
    finally:
        stop_process_group(process, grace_s=15)
        shutil.rmtree(work_dir, ignore_errors=True)
    [expected] = LLM(model=str(default_model_dir), dtype="float32", num_kv_blocks=128).generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    assert answer["text_output"] == expected.outputs[0].text
