"""What an Ascend host must have before npu-llm can serve on it, checked at start-up (and by `doctor`).

Both checks turn a failure that would otherwise surface mid-request into a start-up error that
names the fix (docs/npu.md, "First day on an Ascend host").
"""
from __future__ import annotations

import re

# Atlas A2 and A3 training-series chips, as torch.npu.get_device_name() names them (Ascend910B1..B4,
# Ascend910_9391...): their ATB paged-attention ops take ND caches in fp16 and bf16.
SUPPORTED_CHIP = re.compile(r"Ascend910(B\d|_93)")
SUPPORTED_CHIPS = "Atlas A2/A3 (Ascend910B*, Ascend910_93*)"
NNAL_FIX = "install CANN's NNAL package (matching torch_npu) and source /usr/local/Ascend/nnal/atb/set_env.sh"


class NpuHostError(RuntimeError):
    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}: {fix}")
        self.problem, self.fix = problem, fix


def load_atb_ops() -> None:
    """Load torch_npu's ATB op library now, as vllm-ascend's worker does at start.

    `import torch_npu` swallows a failure to load libatb.so (the NNAL package) and keeps it for the
    first `_npu_*` call, which would then raise in the middle of a request.
    """
    try:
        from torch_npu.op_plugin.atb._atb_ops import _register_atb_extensions
    except ImportError as e:
        raise NpuHostError(f"this torch_npu has no ATB op set ({e})", "install torch_npu 2.5.1 or later") from e
    try:
        _register_atb_extensions()
    except OSError as e:
        cause = e.__cause__ or e
        raise NpuHostError(f"torch_npu's ATB ops did not load ({cause})", NNAL_FIX) from e


def check_chip(name: str) -> None:
    """Serve only on the chips whose ATB paged-attention ops take ND caches in fp16 and bf16 (Atlas A2/A3).

    The Atlas inference cards (310P, 310B) take float16 only and FRACTAL_NZ-format caches (vllm-ascend's
    310P worker); the first Ascend 910 generation has no bf16; newer chips have not been looked at."""
    if not SUPPORTED_CHIP.match(name):
        kind = "an Atlas inference chip, whose paged-attention ops need float16 and NZ-format KV caches" \
            if name.lower().startswith("ascend310") else "not a chip npu-llm's ATB kernels are known to run on"
        raise NpuHostError(f"{name or 'this NPU'} is {kind}", f"serve on {SUPPORTED_CHIPS}")
