"""Which listening addresses stay on this host."""
from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether host is a loopback address (or localhost); a host name may resolve to anything, so it is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
