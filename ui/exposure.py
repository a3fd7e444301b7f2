"""Whether the UI may listen where it is asked to. It is a client of the gateway holding the gateway's API key, so on
an address other hosts reach, a key without a login would hand the gateway to anyone there."""
from __future__ import annotations

import os

from backend.config.addresses import is_loopback

AUTH_ENV = "NPU_LLM_UI_AUTH"  # USER:PASSWORD, the UI's login (Gradio's auth); in the environment, not on argv


def checked_login(host: str, api_key: str | None) -> tuple[str, str] | None:
    """The UI's login, (user, password) from NPU_LLM_UI_AUTH, or None. ValueError, saying why, when it is malformed,
    or when it is missing where the UI, holding api_key, would listen on host off loopback."""
    value = os.environ.get(AUTH_ENV)
    auth = None
    if value:
        user, colon, password = value.partition(":")
        if not (colon and user and password):
            raise ValueError(f"{AUTH_ENV} must be USER:PASSWORD")
        auth = user, password
    if api_key and auth is None and not is_loopback(host):
        raise ValueError(f"the UI would listen on {host} holding the gateway's API key, with no login: anyone who "
                         f"reaches it could use the gateway. Set {AUTH_ENV}=USER:PASSWORD (the UI's login), or listen "
                         f"on 127.0.0.1")
    return auth
