"""kv_transfer_params: what a request carries between the two sides of a disaggregated prefill, in vLLM's keys.

The proxy sends a prefill engine {"do_remote_decode": true}; that engine's final output returns the params a decode
engine needs to pull the prompt's KV ({"do_remote_prefill": true, "remote_...": ...}), which the proxy passes on.
Checked for shape here; that a producer of this deployment issued them, by the consumer before it pulls (their
signature, backend/engine/input_processor.py); whether the named engine holds those blocks for that prompt is the
producer's answer when the consumer claims them (backend/engine/kv_transfer/mooncake.py)."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from backend.config.control_key import signature, signed_by

# A prompt of max_model_len tokens at block size 1 still fits; anything longer is not a block table.
MAX_REMOTE_BLOCKS = 1 << 20
BlockId = Annotated[int, Field(ge=0, le=2**31 - 1)]
SIGNED_FIELDS = ("do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
                 "remote_port", "remote_tp_size")


class KVTransferParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    do_remote_decode: bool = False  # (to a producer) keep the prompt's KV for a decode engine to pull
    do_remote_prefill: bool = False  # (to a consumer) the prompt's KV was computed remotely: pull it
    remote_engine_id: str | None = Field(None, min_length=1, max_length=256)
    remote_request_id: str | None = Field(None, min_length=1, max_length=256)
    remote_block_ids: list[BlockId] | None = Field(None, max_length=MAX_REMOTE_BLOCKS)
    remote_host: str | None = Field(None, min_length=1, max_length=256)
    remote_port: int | None = Field(None, ge=1, le=65535)
    remote_tp_size: int = Field(1, ge=1, le=1024)
    # (from a producer) its HMAC of the fields above under the deployment's control key (backend/config/control_key.py): a
    # consumer that has the key pulls only from params a producer holding it signed
    remote_signature: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")

    def signed_fields(self) -> dict:
        """What the signature covers: where to pull from and what (named, so that a field added later with a default
        does not change what older servers sign)."""
        return {name: getattr(self, name) for name in SIGNED_FIELDS}

    def signed_with(self, key: str) -> "KVTransferParams":
        """These params as a producer holding key issues them."""
        return self.model_copy(update={"remote_signature": signature(self.signed_fields(), key)})

    def issued_with(self, key: str | None) -> bool:
        """Whether a producer holding key signed these (any params pass where there is no key to check against)."""
        return key is None or signed_by(self.signed_fields(), self.remote_signature, key)

    @model_validator(mode="after")
    def _one_side(self):
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other")
        if self.do_remote_prefill:
            missing = [name for name in ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
                                         "remote_port") if getattr(self, name) is None]
            if missing:
                raise ValueError(f"kv_transfer_params with do_remote_prefill need {', '.join(missing)}")
            if not self.remote_block_ids:
                raise ValueError("kv_transfer_params: remote_block_ids must not be empty")
        return self
