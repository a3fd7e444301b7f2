# Triton loads this file; the implementation lives in backend/triton/model.py of the repository root.
import os
import sys
from pathlib import Path

# The python backend stub embeds Python in isolated mode, which ignores PYTHONPATH: honour it here
# (npu-llm serve points it at its virtualenv), ahead of the interpreter's own site-packages.
sys.path[:0] = [str(Path(__file__).resolve().parents[3])] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
from backend.triton.model import TritonPythonModel  # noqa: E402,F401
