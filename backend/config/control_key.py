"""The deployment's shared secret, the control key (docs/reliability.md, threat model): `npu-llm serve` and `up` put it
in NPU_LLM_CONTROL_KEY for Triton, its python stub and the gateway they start (one random key per run unless the
variable is set; a deployment over several machines sets the same one on each). Triton's model control and the
profile actions answer only to it, and a kv_consumer engine pulls only KV whose kv_transfer_params a producer holding
it signed."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets

CONTROL_KEY_ENV = "NPU_LLM_CONTROL_KEY"
KEY_FORMAT = re.compile(r"[A-Za-z0-9_-]{16,}")


def control_key() -> str | None:
    return os.environ.get(CONTROL_KEY_ENV) or None


def ensure_control_key() -> str:
    """The control key of this process and what it starts: NPU_LLM_CONTROL_KEY when set, else a new random key, put
    into this process's environment so that every Triton and gateway started from here shares it."""
    if not control_key():
        os.environ[CONTROL_KEY_ENV] = secrets.token_urlsafe(32)
    key = os.environ[CONTROL_KEY_ENV]
    if not KEY_FORMAT.fullmatch(key):  # (it goes into Triton's "<apis>:<header>=<value>" options)
        raise ValueError(f"{CONTROL_KEY_ENV} must be 16 or more of A-Z, a-z, 0-9, '-' and '_'")
    return key


def signature(fields: dict, key: str) -> str:
    """HMAC-SHA256 of fields (as canonical JSON) under key."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


def signed_by(fields: dict, given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), signature(fields, key).encode())
