"""Mooncake's transfer engine, started the way vllm-ascend starts it: peer-to-peer handshakes (no metadata server),
over TCP for host memory (the CPU's KV cache), or over Ascend's own transport for NPU memory."""
from __future__ import annotations

import os

INSTALL_HINT = ("`make install` installs it: pip's mooncake-transfer-engine-non-cuda (mooncake-transfer-engine-npu on "
                "Ascend) and Debian's libibverbs1 librdmacm1 libnuma1 liburing2 (docs/disaggregation.md)")


def transfer_protocol(platform: str) -> str:
    """NPU memory moves over Ascend's transport (HCCS or RoCE); host memory, the CPU's KV cache, over TCP."""
    return "ascend" if platform == "npu" else "tcp"


# A read's deadline (Mooncake's MC_TRANSFER_TIMEOUT, 30 s unless set; it adds a second per GiB moved): a pull that
# outlasts it fails, and the consumer computes the prompt itself.
READ_TIMEOUT_S = 10


def start_transfer_engine(host: str, platform: str):
    """A TransferEngine listening on host (its RPC port chosen free: get_rpc_port()). Fails naming what is missing
    when Mooncake or the libraries it loads are not installed."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(f"kv_transfer_config needs Mooncake's transfer engine, which does not load ({e}); "
                           f"{INSTALL_HINT}") from None
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(READ_TIMEOUT_S))  # (read when the engine is made)
    engine = TransferEngine()
    protocol = transfer_protocol(platform)
    status = engine.initialize(host, "P2PHANDSHAKE", protocol, "")  # (the "ascend" transport finds its device: "")
    if status != 0:
        raise RuntimeError(f"Mooncake's transfer engine did not start on {host} over {protocol} (status {status})")
    return engine
