"""Mooncake's transfer engine, started the way vllm-ascend starts it: peer-to-peer handshakes (no metadata server),
over TCP for host memory (the CPU's KV cache), or over Ascend's own transport for NPU memory."""
from __future__ import annotations

import os

import torch

INSTALL_HINT = ("`make install` installs it: pip's mooncake-transfer-engine-non-cuda (mooncake-transfer-engine-npu on "
                "Ascend) and Debian's libibverbs1 librdmacm1 libnuma1 liburing2 (docs/disaggregation.md)")


# HCCL registers at most this many memory regions a process (vllm-ascend's MAX_HCCL_REGISTER_REGIONS)
MAX_ASCEND_REGIONS = 256


def memory_regions(tensors: list[torch.Tensor], protocol: str) -> dict[int, int]:
    """(address -> bytes) to register for these KV tensors: each storage once, however many views of it there are,
    as vllm-ascend registers them; over Ascend's transport, at most MAX_ASCEND_REGIONS."""
    regions = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    if protocol == "ascend" and len(regions) > MAX_ASCEND_REGIONS:
        raise RuntimeError(f"the KV cache is {len(regions)} separate device allocations, and HCCL registers at most "
                           f"{MAX_ASCEND_REGIONS} memory regions a process: serve this model without a Mooncake transfer "
                           "(docs/npu.md section 16)")
    return regions


def bind_to(device: torch.device) -> None:
    """This thread's current device: the KV cache's (torch.npu.set_device on an NPU, which is per thread: a thread
    that never sets it opens a context on device 0, whatever the KV cache's device)."""
    if device.type in ("npu", "cuda"):
        getattr(torch, device.type).set_device(device)


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
        # (whether a Mooncake build carries the ascend transport, USE_ASCEND_DIRECT, shows only here: vllm-ascend
        # does not check it either)
        built = "; its build must carry Ascend's transport (mooncake-transfer-engine-npu, or USE_ASCEND_DIRECT=ON)" \
            if protocol == "ascend" else ""
        raise RuntimeError(f"Mooncake's transfer engine did not start on {host} over {protocol} (status {status})"
                           f"{built}")
    return engine
