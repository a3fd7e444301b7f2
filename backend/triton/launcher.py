"""Find or assemble a runnable tritonserver, and run a model repository with it.

On a machine with Triton installed, `tritonserver` on PATH is used as is. Otherwise the
binary bundled in the `nvidia-pytriton` wheel runs with a python-backend directory assembled
for the running interpreter (docs/architecture.md: facts about the environment).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from backend.config.addresses import is_loopback
from backend.config.control_key import CONTROL_KEY_ENV
from backend.triton.instances import with_instance_count
from backend.triton.loras import with_lora_modules
from backend.triton.model_json import parse_model_json

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"


# Triton's APIs that no client of ours needs and that change the server: model control (a loaded model's code runs
# in the server: "can lead to arbitrary code execution", its docs say), shared-memory registration, and the trace and
# log settings (they name files the server writes). Restricted on HTTP and gRPC to requests with the control key in
# this header. The model's own unload when its engine dies (pb_utils.unload_model) is in-process and unaffected.
RESTRICTED_APIS = "model-repository,shared-memory,trace,logging"
CONTROL_KEY_HEADER = "npu-llm-control-key"


class LaunchError(RuntimeError):
    pass




@dataclass
class Tritonserver:
    binary: Path
    backend_dir: Path | None = None  # None: the installation's own
    env: dict[str, str] = field(default_factory=dict)  # what to add to the environment


def find_tritonserver(work_dir: Path) -> Tritonserver:
    on_path = shutil.which("tritonserver")
    if on_path:
        return Tritonserver(Path(on_path), env={"PYTHONPATH": _pythonpath()})
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError("no tritonserver on PATH and the nvidia-pytriton package is not installed")
    bundle = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    binary = bundle / "bin" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = bundle / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not binary.exists() or not stub.exists():
        raise LaunchError(f"the bundled tritonserver in {bundle} lacks the binary or a Python {version} stub")

    # The python backend expects its library, utils and stub side by side.
    python_dir = work_dir / "backends" / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for source in (bundle / "backends" / "python" / "libtriton_python.so",
                   bundle / "backends" / "python" / "triton_python_backend_utils.py", stub):
        shutil.copy2(source, python_dir / source.name)
    # npu-llm also answers to Triton's backend name "vllm" (a python-based backend: backends/vllm/model.py),
    # so model repositories written for vllm_backend (backend: "vllm", no model.py) run unchanged.
    vllm_dir = work_dir / "backends" / "vllm"
    vllm_dir.mkdir(parents=True, exist_ok=True)
    (vllm_dir / "model.py").symlink_to(DEFAULT_REPOSITORY / "llm" / "1" / "model.py")
    libs = [sysconfig.get_config_var("LIBDIR"), str(bundle.parent.parent / "nvidia_pytriton.libs")]
    if os.environ.get("LD_LIBRARY_PATH"):
        libs.append(os.environ["LD_LIBRARY_PATH"])
    env = {"LD_LIBRARY_PATH": ":".join(libs), "PYTHONPATH": _pythonpath()}
    return Tritonserver(binary, python_dir.parent, env)


def _pythonpath() -> str:
    # The stub embeds Python and does not see a virtualenv by itself.
    paths = [str(REPO_ROOT), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return ":".join(dict.fromkeys(paths))


def run_copy(repository: Path, work_dir: Path, engine_args: dict, lora_modules: dict[str, str] | None = None) -> Path:
    """A copy of the repository whose model.json files carry engine_args; the user's files stay untouched.
    A model whose model.json asks for data_parallel_size engines gets that many instances in its config.pbtxt, and
    with lora_modules (`serve --lora-modules`) each model's multi_lora.json gets those adapters (and enable_lora).

    Everything else is a symlink, so model.py still resolves to this checkout.
    """
    if not repository.is_dir():
        raise LaunchError(f"model repository {repository} does not exist")
    target = work_dir / "model_repository"
    engines = {}  # model folder -> data_parallel_size
    target.mkdir(parents=True, exist_ok=True)
    for source in sorted(repository.rglob("*")):
        dest = target / source.relative_to(repository)
        if source.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
        elif source.name == "model.json":
            values = {**json.loads(source.read_text()), **engine_args, **({"enable_lora": True} if lora_modules else {})}
            dest.write_text(json.dumps(values, indent=2))
            if "data_parallel_size" in values:
                engines[dest.parent.parent] = values["data_parallel_size"]
        elif "__pycache__" not in source.parts:
            dest.symlink_to(source.resolve())
    for model_json in target.glob("*/[0-9]*/model.json") if lora_modules else ():
        with_lora_modules(model_json.parent, lora_modules)
    for model, count in engines.items():
        config = model / "config.pbtxt"
        if config.exists() and isinstance(count, int):
            text = config.read_text()
            config.unlink()  # (a symlink to the user's file)
            config.write_text(with_instance_count(text, count))
    return target


def server_command(
    server: Tritonserver, repository: Path, http_port: int, grpc_port: int, metrics_port: int, extra: list[str] = (),
    host: str = "127.0.0.1", key: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """host: the address of all three endpoints. Loopback by default: Triton has no authentication, so an open
    port would bypass the gateway's API key. key: the control key (backend/config/control_key.py), or None to leave Triton's
    APIs unrestricted."""
    argv = [
        str(server.binary),
        f"--model-repository={repository}",
        # explicit mode, every model loaded at start: a model whose engine died can unload itself (readiness false)
        "--model-control-mode=explicit",
        "--load-model=*",
        f"--http-address={host}",
        f"--http-port={http_port}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
        f"--metrics-address={host}",
        f"--metrics-port={metrics_port}",
        "--allow-metrics=true",
        "--exit-timeout-secs=10",
        *extra,
    ]
    env = {**os.environ, **server.env}
    if key:
        argv += [f"--http-restricted-api={RESTRICTED_APIS}:{CONTROL_KEY_HEADER}={key}",
                 f"--grpc-restricted-protocol={RESTRICTED_APIS}:{CONTROL_KEY_HEADER}={key}"]
        env[CONTROL_KEY_ENV] = key  # for the model's keyed admin actions (backend/triton/contract.py)
    if server.backend_dir is not None:
        argv.append(f"--backend-directory={server.backend_dir}")
    return argv, env


def loopback_listeners(repository: Path) -> dict[str, str]:
    """The environment that keeps Mooncake's listeners on loopback (backend/engine/kv_transfer/loopback.py), when the
    run copy's models move KV and every one of them on a loopback kv_ip; else nothing."""
    transfers = [parse_model_json(json.loads(model_json.read_text())).config.kv_transfer
                 for model_json in repository.glob("*/[0-9]*/model.json")]
    kv_ips = [transfer.kv_ip for transfer in transfers if transfer is not None]
    if not kv_ips or not all(is_loopback(ip) for ip in kv_ips):
        return {}
    from backend.engine.kv_transfer.loopback import loopback_environment

    return loopback_environment()


def make_work_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="npu-llm-triton-"))
