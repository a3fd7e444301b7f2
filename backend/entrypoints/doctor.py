"""`npu-llm doctor`: the troubleshooting chapter of an Ascend deployment guide, as one table of checks.

Each check says OK, WARN or FAIL, with what was found and, for a failure, the fix. A FAIL is
something that breaks serving here; a WARN is something absent that this machine may not need
(no NPU on a CPU box); an INFO row is a rule of the platform to know, not a check. Exit status 1
when anything FAILs.
"""
from __future__ import annotations

import ctypes.util
import glob
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

OK, WARN, FAIL, INFO = "OK", "WARN", "FAIL", "INFO"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_numpy() -> Check:
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        return Check("numpy < 2", FAIL, f"numpy {numpy.__version__}",
                     'Triton\'s python backend stub mis-decodes strings with numpy 2: pip install "numpy<2"')
    return Check("numpy < 2", OK, f"numpy {numpy.__version__}")


def check_npu_smi() -> Check:
    if not shutil.which("npu-smi"):
        return Check("npu-smi info", WARN, "npu-smi not found (no Ascend driver on this machine)",
                     "on an Ascend host: install the NPU driver and firmware")
    run = subprocess.run(["npu-smi", "info"], capture_output=True, text=True, timeout=30)
    if run.returncode != 0:
        return Check("npu-smi info", FAIL, (run.stderr or run.stdout).strip()[:120],
                     "check the driver installation and that the device is healthy (npu-smi info)")
    return Check("npu-smi info", OK, "driver answers")


def check_cann(torch_npu_installed: bool) -> Check:
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    hccl = ctypes.util.find_library("hccl")
    if home and Path(home).exists():
        return Check("CANN environment", OK, f"ASCEND_HOME_PATH={home}" + (", libhccl found" if hccl else ""))
    status = FAIL if torch_npu_installed else WARN
    return Check("CANN environment", status, "ASCEND_HOME_PATH not set (set_env.sh not sourced)",
                 "source /usr/local/Ascend/ascend-toolkit/set_env.sh (and nnal/atb/set_env.sh for the ATB ops)")


def check_torch_npu() -> tuple[list[Check], bool]:
    """(checks, torch_npu usable)."""
    import torch

    installed = importlib.util.find_spec("torch_npu") is not None
    if not installed:
        return [Check("torch_npu", WARN, "not installed (NPU serving unavailable)",
                      "on an Ascend host: pip install 'npu-llm[npu]' (torch_npu matching your torch)")], False
    checks = []
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        import torch_npu
    except Exception as e:  # without CANN, importing torch_npu fails
        return [Check("torch_npu import", FAIL, f"{type(e).__name__}: {e}"[:160],
                      "source CANN's set_env.sh; check that libhccl.so is on LD_LIBRARY_PATH")], False
    npu_version = getattr(torch_npu, "__version__", _version("torch_npu") or "?")
    if _major_minor(npu_version) != _major_minor(torch.__version__):
        checks.append(Check("torch / torch_npu versions", FAIL, f"torch {torch.__version__}, torch_npu {npu_version}",
                            f"install the torch_npu release built for torch {_major_minor(torch.__version__)}"))
    else:
        checks.append(Check("torch / torch_npu versions", OK, f"torch {torch.__version__}, torch_npu {npu_version}"))
    available = bool(torch.npu.is_available())
    checks.append(Check("torch.npu.is_available()", OK if available else FAIL,
                        f"{torch.npu.device_count()} device(s)" if available else "False",
                        "" if available else "check npu-smi, the device files and ASCEND_RT_VISIBLE_DEVICES"))
    if available:
        checks += [check_atb_ops(), check_chip(), note_rope_statics()]
    checks.append(check_npu_graphs(torch_npu))
    return checks, available


def check_atb_ops() -> Check:
    from backend.npu_host import NpuHostError, load_atb_ops

    try:
        load_atb_ops()
    except NpuHostError as e:
        return Check("ATB ops (CANN NNAL)", FAIL, e.problem[:160], e.fix)
    return Check("ATB ops (CANN NNAL)", OK, "libatb loaded (the _npu_* attention, cache and rotary ops)")


def check_chip() -> Check:
    import torch

    from backend.npu_host import NpuHostError, check_chip as refuse_unsupported

    name = torch.npu.get_device_name()
    try:
        refuse_unsupported(name)
    except NpuHostError as e:
        return Check("NPU chip", FAIL, e.problem, e.fix)
    return Check("NPU chip", OK, name)


def note_rope_statics() -> Check:
    """Not a check (nothing on the host decides it): how to live with the rotary op's process-wide table."""
    return Check("one rope table per process", INFO,
                 "_npu_rotary_embedding keeps its first table: one model per process (each Triton instance is one)")


def check_npu_graphs(torch_npu) -> Check:
    """Graph mode re-issues the paged-attention op into captured graphs, with a preallocated workspace."""
    import torch

    needed = [(torch_npu, "_npu_paged_attention_get_workspace"), (torch.npu, "NPUGraph"),
              (torch.npu, "graph_task_update_begin")]
    missing = [f"{module.__name__}.{name}" for module, name in needed if not hasattr(module, name)]
    if missing:
        return Check("NPU graph mode", WARN, f"missing {', '.join(missing)}",
                     "eager mode works; for --no-enforce-eager install a torch_npu whose _npu_paged_attention "
                     "takes a workspace")
    return Check("NPU graph mode", OK, "NPUGraph, task-group updates, paged-attention workspace")


# The environment switches vllm-ascend's guides set, and whether npu-llm (or what it runs on) honours them
ENV_SWITCHES = {
    "TASK_QUEUE_ENABLE": "honoured: torch_npu's operator queue reads it",
    "CPU_AFFINITY_CONF": "honoured: torch_npu binds its threads to cores by it",
    "PYTORCH_NPU_ALLOC_CONF": "honoured: torch_npu's caching allocator reads it",
    "HCCL_OP_EXPANSION_MODE": "honoured: HCCL schedules tensor-parallel collectives by it",
    "VLLM_ASCEND_ENABLE_NZ": "not applicable: W8A8 weights are FRACTAL_NZ always, W8A16's ND (docs/npu.md section 13)",
    "VLLM_ASCEND_ENABLE_FLASHCOMM": "not applicable: vllm-ascend's sequence-parallel communication, not served",
    "VLLM_ASCEND_ENABLE_FLASHCOMM1": "not applicable: vllm-ascend's sequence-parallel communication, not served",
    "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE": "not applicable: gone from vllm-ascend too (v0.13)",
    "VLLM_ASCEND_ENABLE_PREFETCH_MLP": "not applicable: gone from vllm-ascend too (v0.18)",
    "VLLM_ASCEND_ENABLE_MLAPO": "not applicable: vllm-ascend's fused MLA preprocessing kernel, not a torch_npu op",
}


def check_env_switches() -> list[Check]:
    """Each of vllm-ascend's tuning switches set in this environment, said to be honoured or not applicable."""
    return [Check(name, INFO, f"{os.environ[name]!r}: {meaning}") for name, meaning in ENV_SWITCHES.items()
            if name in os.environ]


def model_kernel_parts(model: str, graphs: bool) -> list[str]:
    """The parts of a model whose NPU ops npu_llm_kernels.npu_releases names, read from its config.json."""
    from backend.models.architectures import is_mla, language_config_of, moe_spec
    from backend.models.loader import load_config
    from backend.models.registry import resolve_model

    folder = resolve_model(model)
    config = load_config(folder)
    text = language_config_of(config)
    parts = ["attention"] + ["decode graphs"] * graphs
    parts += ["latent attention (MLA)"] * is_mla(text) + ["mixture of experts"] * (moe_spec(text) is not None)
    parts += ["vision tower"] * hasattr(text, "vision_language")
    if getattr(config, "quantization_config", None) or (folder / "quant_model_description.json").exists():
        parts += ["W8A8", "W8A16"]
    return parts


def check_npu_ops(repository: Path, engine_args: dict) -> Check:
    """Whether this torch_npu has every op the repository's model will call (the check the loader makes)."""
    import torch_npu

    from npu_llm_kernels.npu_releases import NpuReleaseError, require

    try:
        served = _served(repository, engine_args).config
        parts = model_kernel_parts(served.model, graphs=not served.enforce_eager)
    except Exception as e:  # (check_model and check_layout report what is wrong with the model or the repository)
        return Check("torch_npu ops", WARN, f"the served model's parts are unknown ({type(e).__name__})")
    try:
        require(torch_npu, parts)
    except NpuReleaseError as e:
        problem, _, fix = str(e).partition(": install")
        return Check("torch_npu ops", FAIL, problem, "install" + fix)
    return Check("torch_npu ops", OK, f"every op of {', '.join(parts)} ({Path(served.model).name})")


def check_device_files() -> Check:
    files = sorted(glob.glob("/dev/davinci[0-9]*"))
    if not files:
        return Check("NPU device files", WARN, "no /dev/davinci* (no NPU visible)",
                     "in a container: pass --device /dev/davinciN, /dev/davinci_manager, /dev/devmm_svm, /dev/hisi_hdc")
    denied = [f for f in files if not os.access(f, os.R_OK | os.W_OK)]
    if denied:
        return Check("NPU device files", FAIL, f"no read/write access to {', '.join(denied)}",
                     "run as a user in the HwHiAiUser group, or fix the device permissions")
    return Check("NPU device files", OK, ", ".join(files))


def check_cuda() -> Check:
    import torch

    if torch.cuda.is_available():
        return Check("CUDA", OK, f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    return Check("CUDA", WARN, f"not available (torch {torch.__version__})", "only needed to serve on NVIDIA GPUs")


def check_cpu() -> list[Check]:
    """The CPU level the kernels run at, and whether their C++ extension is built and loaded for it."""
    from npu_llm_kernels import cpu
    from npu_llm_kernels.cpu_features import ENV, cpu_features

    try:
        features = cpu_features()
    except ValueError as e:  # NPU_LLM_CPU_ISA names a level this CPU does not have
        return [Check("CPU level", FAIL, str(e), f"unset {ENV}, or name a level up to this CPU's")]
    level = Check("CPU level", OK, features.describe())
    reason = cpu.unavailable_reason()
    if reason is None:
        return [level, Check("CPU kernels", OK, f"the {features.build} build of npu_llm_kernels/csrc loaded")]
    if reason.startswith("NPU_LLM_CPU_KERNELS"):
        fix = "unset NPU_LLM_CPU_KERNELS"
    elif "build failed" in reason:
        fix = "install g++ and ninja (pip install ninja); the portable PyTorch kernels run meanwhile"
    else:  # a build directory holding another ISA's binary
        fix = "delete that build's directory under TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions): it is rebuilt"
    return [level, Check("CPU kernels", WARN, f"not in use: {reason}", fix)]


def check_tritonserver() -> Check:
    from backend.triton.launcher import LaunchError, find_tritonserver

    with tempfile.TemporaryDirectory() as tmp:
        try:
            server = find_tritonserver(Path(tmp))
        except LaunchError as e:
            return Check("tritonserver", FAIL, str(e), "pip install nvidia-pytriton, or put tritonserver on PATH")
    where = "PATH" if server.backend_dir is None else "bundled with nvidia-pytriton"
    return Check("tritonserver", OK, f"{server.binary} ({where})")


def check_model(model: str) -> Check:
    from backend.models.registry import resolve_model

    try:
        folder = resolve_model(model)
    except FileNotFoundError as e:
        return Check("model files", FAIL, str(e)[:160], "pass --model with a Hugging Face folder or a .gguf file")
    missing = [name for name in ("config.json",) if not (folder / name).exists()]
    if not list(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer.model")):
        missing.append("tokenizer.json")
    if missing:
        return Check("model files", FAIL, f"{folder}: missing {', '.join(missing)}",
                     "point --model at a complete Hugging Face model folder")
    return Check("model files", OK, str(folder))


def _model_json(repository: Path) -> Path:
    return repository / "llm" / "1" / "model.json"


def _served(repository: Path, engine_args: dict):
    """What the repository's llm model runs as, engine_args over its model.json (a ValueError or JSONDecodeError
    naming what is wrong)."""
    from backend.triton.model_json import parse_model_json

    model_json = _model_json(repository)
    return parse_model_json({**(json.loads(model_json.read_text()) if model_json.exists() else {}), **engine_args})


def check_layout(repository: Path, engine_args: dict, npu_usable: bool) -> Check:
    """What the repository's llm model runs as (data_parallel_size engines x tensor_parallel_size ranks), and
    whether this machine has the devices for it."""
    import torch

    from backend.platform import VISIBLE_DEVICES, device_type

    try:
        served = _served(repository, engine_args)
    except (ValueError, json.JSONDecodeError) as e:
        return Check("serving layout", FAIL, str(e)[:160], f"fix {_model_json(repository)}")
    device = device_type(served.config.device)
    # with the Ray executor only each engine's rank 0 runs here; Ray places the others on its cluster
    ray = served.config.distributed_executor_backend == "ray"
    ranks = served.data_parallel_size * (1 if ray else served.config.tensor_parallel_size)
    first = int(served.config.device.partition(":")[2] or 0)
    if device == "cpu":
        cores = os.cpu_count() or 1
        status = OK if ranks <= cores else WARN
        detail = f"{served.layout} = {ranks} rank{'s' * (ranks > 1)} on the cpu ({cores} cores)"
        return Check("serving layout", status, detail, "fewer ranks than cores, or they only wait for each other")
    visible = torch.npu.device_count() if device == "npu" and npu_usable else (
        torch.cuda.device_count() if device == "cuda" else 0)
    detail = (f"{served.layout} = {ranks} {device} device{'s' * (ranks > 1)} here from {device}:{first}"
              f"{' (the other ranks on the Ray cluster)' if ray else ''}; {visible} visible")
    if first + ranks > visible:
        return Check("serving layout", FAIL, detail, "lower data_parallel_size or tensor_parallel_size, or make "
                     f"more devices visible ({VISIBLE_DEVICES[device]})")
    return Check("serving layout", OK, detail)


def check_kv_pool(repository: Path, engine_args: dict) -> list[Check]:
    """With a KV pool over Mooncake Store configured: whether its master answers (docs/kv-pool.md)."""
    import socket

    from backend.config.kv_transfer import STORE_CONNECTORS

    try:
        transfer = _served(repository, engine_args).config.kv_transfer
    except (ValueError, json.JSONDecodeError):
        return []  # (check_layout reports it)
    if transfer is None or transfer.kv_connector not in STORE_CONNECTORS:
        return []
    from backend.engine.kv_transfer.mooncake_store import mooncake_settings

    fix = ("start mooncake_master (`npu-llm up --kv-pool` does), and name it in MOONCAKE_MASTER or "
           "MOONCAKE_CONFIG_PATH's master_server_address")
    try:
        master = mooncake_settings(transfer, "cpu")["master_server_addr"]
    except ValueError as e:
        return [Check("KV pool master", FAIL, str(e)[:160], fix)]
    try:
        host, _, port = master.rpartition(":")
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=2).close()
    except (ValueError, OSError) as e:
        return [Check("KV pool master", FAIL, f"no answer at {master}: {e}"[:160], fix)]
    return [Check("KV pool master", OK, f"{transfer.kv_connector}: mooncake_master answers at {master}")]


def run_checks(model: str, repository: Path | None = None, engine_args: dict | None = None) -> list[Check]:
    from backend.triton.launcher import DEFAULT_REPOSITORY

    npu_checks, npu_usable = check_torch_npu()
    if npu_usable:
        npu_checks.append(check_npu_ops(repository or DEFAULT_REPOSITORY, engine_args or {}))
    return [
        check_numpy(),
        check_npu_smi(),
        check_cann(importlib.util.find_spec("torch_npu") is not None),
        *npu_checks,
        *check_env_switches(),
        check_device_files(),
        check_cuda(),
        *check_cpu(),
        check_tritonserver(),
        check_model(model),
        check_layout(repository or DEFAULT_REPOSITORY, engine_args or {}, npu_usable),
        *check_kv_pool(repository or DEFAULT_REPOSITORY, engine_args or {}),
    ]


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  status  detail", f"{'-' * width}  ------  ------"]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {c.status:<6}  {c.detail}")
        if c.status == FAIL and c.fix:
            lines.append(f"{'':<{width}}          fix: {c.fix}")
    return "\n".join(lines)


def doctor(args) -> int:
    from backend.config import parse_engine_args

    checks = run_checks(args.model, Path(args.model_repository), parse_engine_args(args.engine_arg or []))
    print(render(checks), flush=True)
    failed = [c for c in checks if c.status == FAIL]
    print(f"\n{len(failed)} failed, {sum(c.status == WARN for c in checks)} warnings")
    return 1 if failed else 0
