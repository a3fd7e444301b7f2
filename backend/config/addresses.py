"""Which listening addresses stay on this host."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether host is a loopback address (or localhost); a host name may resolve to anything, so it is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
