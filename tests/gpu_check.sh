#!/usr/bin/env bash
# The CUDA checks, in one command for a GPU machine (under 8 minutes): the cuda-marked tests, `npu-llm verify`
# (the GPU against the CPU's float32 reference), then the throughput benchmark on the GPU, eager against
# HF generate and then with CUDA graphs.
# Run from the repository root after `make install`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total --format=csv
"$PY" -m pytest -m cuda -q -p no:cacheprovider
"$PY" -m backend.entrypoints.cli verify --device cuda --dtype bfloat16
"$PY" -m backend.entrypoints.cli bench throughput --device cuda --dtype bfloat16 --num-prompts 64 --input-len 64:512 \
    --output-len 128 --gpu-memory-utilization 0.5
"$PY" -m backend.entrypoints.cli bench throughput --device cuda --dtype bfloat16 --num-prompts 64 --input-len 64:512 \
    --output-len 128 --gpu-memory-utilization 0.5 --no-enforce-eager --baseline none
