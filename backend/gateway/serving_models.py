"""The served models, as vLLM's OpenAI server lists and switches them: the base model under its served name, and each
LoRA adapter of the Triton model (multi_lora.json, and those loaded at run time) under its own name, with the base
as its `parent`. A request's `model` picks one; an unknown name is OpenAI's 404 model_not_found.

With NPU_LLM_ALLOW_RUNTIME_LORA_UPDATING (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) set, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter change the adapters: behind the API key, and sent to Triton with the control key (they are
admin actions that change the engine, backend/triton/contract.py)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, PlainTextResponse, Response

from backend.gateway.errors import ApiError, triton_errors
from backend.gateway.responses import ModelCard, ModelList

if TYPE_CHECKING:  # (serving.py reads request bodies through request_body.py, which imports this module)
    from backend.gateway.serving import Serving

RUNTIME_LORA_ENV = "NPU_LLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # (vLLM's field; the name alone picks the adapter)


async def adapters(serving: Serving) -> dict[str, str]:
    """The Triton model's adapters now (name -> folder), remembered for the requests that name one."""
    with triton_errors():
        info = await serving.triton.admin("engine_info")
    serving.adapters = dict(info.get("lora_adapters") or {})
    return serving.adapters


async def check_model(serving: Serving, model: str | None) -> None:
    """A request's `model`: the served model or one of its adapters (asked of Triton when not known yet)."""
    if model is None or model == serving.served_model_name or model in serving.adapters:
        return
    if model not in await adapters(serving):
        raise ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                       code="model_not_found")


async def list_models(serving: Serving) -> Response:
    """The base model and its adapters (those last known while Triton is out of reach: the list always answers)."""
    base = serving.served_model_name
    try:
        known = await adapters(serving)
    except ApiError as e:
        if e.status != 503:
            raise
        known = serving.adapters
    modalities = ["text", "image"] if serving.media.takes_images else ["text"]
    cards = [ModelCard(id=base, input_modalities=modalities)] + [
        ModelCard(id=name, root=path, parent=base, input_modalities=modalities) for name, path in known.items()]
    return JSONResponse(ModelList(data=cards).model_dump(exclude_none=True))


async def load_adapter(serving: Serving, req: LoadLoRAAdapterRequest) -> Response:
    if not req.lora_name or not req.lora_path:
        raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
    if req.lora_name == serving.served_model_name:
        raise ApiError(400, f"The lora adapter '{req.lora_name}' conflicts with a served base model.")
    with triton_errors():
        await serving.triton.admin("load_lora_adapter", lora_name=req.lora_name, lora_path=req.lora_path)
    await adapters(serving)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_adapter(serving: Serving, req: UnloadLoRAAdapterRequest) -> Response:
    if req.lora_name not in await adapters(serving):
        raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "not_found_error", "lora_name")
    with triton_errors():
        await serving.triton.admin("unload_lora_adapter", lora_name=req.lora_name)
    await adapters(serving)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
