"""The adapters a Triton model serves, as vllm_backend keeps them: `enable_lora` in model.json, and
`1/multi_lora.json` beside it naming each adapter's folder (`{"name": "/path"}`; a relative path is read from
tritonserver's working directory, as vllm_backend reads it). A request names its adapter with `lora_name`; the
refusals carry vllm_backend's own texts. Adapters added at run time (the gateway's /v1/load_lora_adapter) join them
under an id never given before."""
from __future__ import annotations

import json
from pathlib import Path

from backend.config.json_object import json_object_file
from backend.engine.lora_request import LoRARequest

MULTI_LORA_FILE = "multi_lora.json"
LORA_NOT_ENABLED = "LoRA feature is not enabled."


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """`--lora-modules` as vLLM takes it: NAME=PATH, or the JSON form {"name": ..., "path": ...,
    "base_model_name": ...} (the base's name is always the served model's here); name -> absolute path."""
    adapters = {}
    for item in items:
        if "=" in item and "," not in item:
            name, _, path = item.partition("=")
        else:
            try:
                module = json.loads(item)
            except json.JSONDecodeError:
                raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH or a JSON object") from None
            if not isinstance(module, dict) or set(module) - {"name", "path", "base_model_name"}:
                raise ValueError(f"--lora-modules {item!r}: the JSON form has name, path and base_model_name")
            name, path = module.get("name"), module.get("path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules {item!r}: needs an adapter name and its folder")
        adapters[name] = str(Path(path).expanduser().resolve())
    return adapters


def with_lora_modules(version_dir: Path, adapters: dict[str, str]) -> None:
    """Write a run copy's multi_lora.json: the repository's own adapters (if any; its file may be a link to the
    user's) with `adapters` over them."""
    path = version_dir / MULTI_LORA_FILE
    own = json_object_file(path, str(path)) if path.exists() else {}
    path.unlink(missing_ok=True)
    path.write_text(json.dumps({**own, **adapters}, indent=2))


class LoRARefused(ValueError):
    """A request's lora_name this model cannot serve (vllm_backend's texts)."""


def lora_not_supported(name: str, supported: list[str]) -> str:
    return f"LoRA {name} is not supported, we currently support {supported}"


def is_lora_refusal(message: str) -> bool:
    """Whether a Triton error is one of these refusals (a client's mistake, not the server's)."""
    return message == LORA_NOT_ENABLED or (message.startswith("LoRA ") and " is not supported, we currently support "
                                           in message)


class LoRARepository:
    def __init__(self, enabled: bool, adapters: dict[str, str]):
        self.enabled = enabled
        # vllm_backend's ids: an adapter's place in multi_lora.json, from 1
        self.adapters = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(adapters.items(), start=1)}
        # ids given at run time only go up (as vLLM's counter): an id is never another adapter's, whose running
        # requests would otherwise read the new one's weights
        self._next_id = len(adapters) + 1

    @classmethod
    def for_model(cls, enabled: bool, version_dir: str | Path) -> "LoRARepository":
        """The adapters of a model whose model.json sets enable_lora (its multi_lora.json must exist then)."""
        if not enabled:
            return cls(False, {})
        path = Path(version_dir) / MULTI_LORA_FILE
        if not path.is_file():
            raise FileNotFoundError(f"Triton backend cannot find {path}.")
        adapters = json_object_file(path, str(path))
        if not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in adapters.items()):
            raise ValueError(f"{path} must map each adapter's name to its folder, e.g. {{\"sql\": \"/loras/sql\"}}")
        return cls(True, adapters)

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request names (None: the base model); LoRARefused as vllm_backend refuses."""
        if name is None:
            return None
        if not self.enabled:
            raise LoRARefused(LORA_NOT_ENABLED)
        if name not in self.adapters:
            raise LoRARefused(lora_not_supported(name, self.names))
        return self.adapters[name]

    def new(self, name: str, path: str) -> LoRARequest:
        """An adapter to add at run time (not yet served: `add` it once the engine has read it)."""
        if not self.enabled:
            raise LoRARefused(LORA_NOT_ENABLED)
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        self._next_id += 1
        return LoRARequest(name, self._next_id - 1, path)

    def add(self, lora: LoRARequest) -> None:
        self.adapters[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest:
        if not self.enabled:
            raise LoRARefused(LORA_NOT_ENABLED)
        if name not in self.adapters:
            raise LookupError(f"The lora adapter '{name}' cannot be found.")
        return self.adapters.pop(name)

    def listing(self) -> dict[str, str]:
        """Each adapter's name and folder (what /v1/models shows as `root`, as vLLM's does)."""
        return {name: lora.lora_path for name, lora in self.adapters.items()}
