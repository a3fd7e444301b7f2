"""Whether the UI may listen where it is asked to. It is a client of the gateway holding the gateway's API key, so on
an address other hosts reach, a key without a login would hand the gateway to anyone there."""
from __future__ import annotations

from backend.config.addresses import is_loopback

AUTH_ENV = "NPU_LLM_UI_AUTH"  # USER:PASSWORD, the UI's login (Gradio's auth); in the environment, not on argv


def login(value: str | None) -> tuple[str, str] | None:
    """The (user, password) that NPU_LLM_UI_AUTH gives, or None when it is not set."""
    if not value:
        return None
    user, colon, password = value.partition(":")
    if not (colon and user and password):
        raise ValueError(f"{AUTH_ENV} must be USER:PASSWORD")
    return user, password


def exposure_error(host: str, api_key: str | None, auth: tuple[str, str] | None) -> str | None:
    """Why the UI must not listen on host, or None when it may."""
    if api_key and auth is None and not is_loopback(host):
        return (f"the UI would listen on {host} holding the gateway's API key, with no login: anyone who reaches it "
                f"could use the gateway. Set {AUTH_ENV}=USER:PASSWORD (the UI's login), or listen on 127.0.0.1")
    return None
