"""A CPU-backed stand-in for torch_npu, for contract tests on machines without Ascend hardware.

It implements the ops kernels/npu.py calls with kernels/torch_ref.py semantics, and checks
their arguments the way the real ops document them (docs/npu.md): keyword names,
fp16/bf16 only, int32 slot indices and block tables, CPU int32 lengths, contiguous outputs,
block sizes, and the exact causal masks vllm-ascend builds. A wrong call raises, as the real
op would fail. Device tensors are on "npu:N" (fake_npu_device.py: host memory underneath, but
placed apart from host tensors, so an argument on the wrong side of the bus is refused).
Graph capture and replay (torch.npu.NPUGraph, task-group updates) live in _graphs.py; the
torch.distributed backend "hccl" (collectives between ranks, over gloo underneath) in _hccl.py.

The host it plays has CANN NNAL and FAKE_NPU_DEVICES (1) Ascend910B3 chips unless FAKE_NPU_NNAL=0 or
FAKE_NPU_SOC say otherwise.
Only tests put this package on sys.path (tests/test_npu_contract.py).
"""
from __future__ import annotations

import os
import types

import fake_npu_device
import torch

from kernels import torch_ref
from kernels.metadata import AttentionMetadata, cdiv

from . import _graphs, _hccl
from . import profiler
from .op_plugin.atb import _atb_ops

__version__ = ".".join(torch.__version__.split("+")[0].split(".")[:2]) + ".0.post1"  # built for this torch
calls: dict[str, int] = {}  # op name -> times called, for the tests
_HALF = (torch.float16, torch.bfloat16)


class NpuOpError(RuntimeError):
    pass


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise NpuOpError(message)


def _count(name: str) -> None:
    if name.startswith("_npu_"):  # the ATB ops: torch_npu loads their library on first use
        _atb_ops._register_atb_extensions()
    calls[name] = calls.get(name, 0) + 1


def _half(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        _require(t.dtype in _HALF, f"{name}: only float16/bfloat16 are supported, got {t.dtype}")
    _require(len({t.dtype for t in tensors}) == 1, f"{name}: all tensors must share one dtype")


def _cpu_int32(name: str, arg: str, t: torch.Tensor) -> None:
    # ATB reads CPU tensors as host data; a device tensor here has no hostData (docs/npu.md)
    _require(t.dtype == torch.int32 and t.device.type == "cpu", f"{name}: {arg} must be a CPU int32 tensor")


def _on_device(name: str, **tensors: torch.Tensor) -> None:
    for arg, t in tensors.items():
        _require(t.device.type == "npu", f"{name}: {arg} must be on the NPU, got a {t.device.type} tensor")


# -- cache write ------------------------------------------------------------------------------------


def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices):
    name = "_npu_reshape_and_cache"
    _count(name)
    _half(name, key, value, key_cache, value_cache)
    _on_device(name, key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_indices=slot_indices)
    _require(key.dim() == 3 and key_cache.dim() == 4, f"{name}: key [T,N,D] and caches [blocks,block_size,N,D]")
    _require(key_cache.shape[2:] == key.shape[1:], f"{name}: cache heads/dim {tuple(key_cache.shape[2:])} != key's")
    _require(key_cache.is_contiguous() and value_cache.is_contiguous(), f"{name}: caches must be contiguous")
    _require(slot_indices.dtype == torch.int32, f"{name}: slot_indices must be int32, got {slot_indices.dtype}")
    _require(slot_indices.shape == (key.shape[0],), f"{name}: one slot per token")
    _graphs.launch(_write_cache, ("key_cache", "value_cache"), key=key, value=value, key_cache=key_cache,
                   value_cache=value_cache, slots=slot_indices)


def _write_cache(key, value, key_cache, value_cache, slots):
    torch_ref.reshape_and_cache(key, value, key_cache, value_cache, slots.long())


# -- norms and rotary -------------------------------------------------------------------------------


def npu_rms_norm(x, gamma, epsilon=1e-6):
    _count("npu_rms_norm")
    y = torch_ref.rms_norm(x, gamma, epsilon)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return y, rstd


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    _count("npu_add_rms_norm")
    y, summed = torch_ref.add_rms_norm(x1, x2, gamma, epsilon)
    return y, torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + epsilon), summed


_rope_tables: dict[str, torch.Tensor] = {}  # the op's process-global cos/sin statics (RopeAtb.cpp)


def _npu_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    name = "_npu_rotary_embedding"
    _count(name)
    _require(positions.dtype == torch.int64, f"{name}: positions must be int64")
    _on_device(name, positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    _require(query.dim() == 2 and key.dim() == 2, f"{name}: query/key must be [T, N*head_size]")
    _require(query.is_contiguous() and key.is_contiguous(), f"{name}: query/key must be contiguous (written in place)")
    _require(query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0, f"{name}: head_size mismatch")
    _require(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_size,
             f"{name}: cos_sin_cache must be [max_position, head_size={head_size}], got {tuple(cos_sin_cache.shape)}")
    _require(is_neox_style, f"{name}: only neox style is used here")
    # The real op builds its cos/sin tables from the first cos_sin_cache it is given, keeps them in
    # static variables for the life of the process and ignores every later table: so does the fake.
    if "cos_sin" not in _rope_tables:
        _rope_tables["cos_sin"] = cos_sin_cache.detach().clone()
    table = _rope_tables["cos_sin"]
    if len(positions) and not _graphs.is_capturing():  # (a capture cannot read device values back)
        _require(int(positions.max()) < table.shape[0], f"{name}: position beyond the cached table's {table.shape[0]} rows")
    _graphs.launch(_rotate, ("query", "key"), positions=positions, query=query, key=key, head_size=head_size,
                   table=table)


def _rotate(positions, query, key, head_size, table):
    q, k = torch_ref.rotary_embedding(positions, query.view(len(positions), -1, head_size),
                                      key.view(len(positions), -1, head_size), table.to(query.dtype))
    query.copy_(q.reshape(query.shape))
    key.copy_(k.reshape(key.shape))


# -- attention --------------------------------------------------------------------------------------


def _check_paged(name, query, key_cache, value_cache, num_kv_heads, num_heads, block_table, out):
    _half(name, query, key_cache, value_cache, out)
    _on_device(name, query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table, out=out)
    _require(block_table.dtype == torch.int32, f"{name}: block_table must be int32")
    block_size = key_cache.shape[1]
    _require(block_size % 16 == 0 and block_size <= 128, f"{name}: block_size must be a multiple of 16, <= 128")
    _require(key_cache.shape[2] == num_kv_heads, f"{name}: key_cache holds {key_cache.shape[2]} heads, not {num_kv_heads}")
    _check_heads(name, query, num_heads, num_kv_heads, out)


def _check_heads(name, query, num_heads, num_kv_heads, out):
    _require(query.dim() == 3 and query.shape[1] == num_heads, f"{name}: query must be [T, num_heads={num_heads}, D]")
    _require(num_kv_heads > 0 and num_heads % num_kv_heads == 0, f"{name}: num_heads must be a multiple of num_kv_heads")
    _require(0 < query.shape[2] <= 256, f"{name}: head_dim must be in (0, 256], got {query.shape[2]}")
    _require(out.is_contiguous() and out.shape == query.shape, f"{name}: out must be contiguous, shaped like query")


def _metadata(query_lens, context_lens, block_table, block_size) -> AttentionMetadata:
    return AttentionMetadata(
        query_lens=query_lens, context_lens=context_lens, num_decodes=0, block_size=block_size,
        slot_mapping=torch.empty(0, dtype=torch.long), block_tables=block_table,
        context_lens_tensor=torch.tensor(context_lens, dtype=torch.int32, device=block_table.device))


def _npu_paged_attention(*, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                         context_lens, out, workspace=None):
    # The op-plugin master schema: `*, Tensor? workspace=None` after out (7.1.0 has no workspace).
    name = "_npu_paged_attention"
    _count(name)
    _check_paged(name, query, key_cache, value_cache, num_kv_heads, num_heads, block_table, out)
    _cpu_int32(name, "context_lens", context_lens)
    _require(context_lens.shape == (query.shape[0],), f"{name}: one context length per query token")
    # Under graph capture the op cannot allocate its own workspace (vllm-ascend passes one it got from
    # _npu_paged_attention_get_workspace), and a workspace given must hold what the op needs for these lengths.
    _require(workspace is not None or not _graphs.is_capturing(), f"{name}: a graph capture needs a workspace")
    if workspace is not None:
        _on_device(name, workspace=workspace)
        needed = _workspace_bytes(num_heads, context_lens)
        _require(workspace.numel() * workspace.element_size() >= needed,
                 f"{name}: workspace of {workspace.numel() * workspace.element_size()} bytes, the op needs {needed}")
    # context_lens is host data: the op reads it when issued (a graph keeps the values it was captured with)
    _graphs.launch(_decode_attention, ("out",), query=query, key_cache=key_cache, value_cache=value_cache,
                   block_table=block_table, context_lens=context_lens.tolist(), scale=scale_value, out=out)


def _decode_attention(query, key_cache, value_cache, block_table, context_lens, scale, out):
    md = _metadata([1] * query.shape[0], context_lens, block_table, key_cache.shape[1])
    out.copy_(torch_ref.decode_attention(query, key_cache, value_cache, md, scale))


def _workspace_bytes(num_heads: int, context_lens: torch.Tensor) -> int:
    # The fake's stand-in for ATB's GetAtbWorkspaceSizeCmd: it grows with the context lengths given.
    return 4 * num_heads * sum(context_lens.tolist())


def _npu_paged_attention_get_workspace(*, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                                       block_table, context_lens, out):
    # PagedAttentionAtb.cpp: at::empty({workspace_size}, query.options().dtype(at::kByte)), sized by the
    # host context_lens it is given.
    _count("_npu_paged_attention_get_workspace")
    _cpu_int32("_npu_paged_attention_get_workspace", "context_lens", context_lens)
    return torch.empty(_workspace_bytes(num_heads, context_lens), dtype=torch.uint8, device=query.device)


def _causal_mask(q_lens, ctx_lens, columns, masked, dtype):
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, ctx_lens)])
    mask = torch.zeros(len(positions), columns, dtype=dtype)
    return mask.masked_fill_(torch.arange(columns)[None, :] > positions[:, None], masked)


def _npu_flash_attention(*, query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out):
    name = "_npu_flash_attention"
    _count(name)
    _half(name, query, key, value, mask, out)
    _on_device(name, query=query, key=key, value=value, mask=mask, out=out)
    _check_heads(name, query, num_heads, num_kv_heads, out)
    _require(key.shape[1] == num_kv_heads, f"{name}: key holds {key.shape[1]} heads, not {num_kv_heads}")
    _cpu_int32(name, "seq_len", seq_len)
    lens = seq_len.tolist()
    _require(sum(lens) == query.shape[0] == key.shape[0], f"{name}: sum(seq_len) must equal the token count")
    longest = max(lens)
    masked = float("-inf") if query.dtype == torch.float16 else 1.0  # vllm-ascend generate_attn_mask
    expected = _causal_mask([longest], [longest], longest, masked, query.dtype)
    _require(mask.shape == (longest, longest) and torch.equal(mask.cpu(), expected),
             f"{name}: mask must be the [S,S] causal mask (masked = {masked} for {query.dtype})")
    _graphs.launch(_prefill_attention, ("out",), query=query, key=key, value=value, lens=lens, scale=scale_value,
                   out=out)


def _prefill_attention(query, key, value, lens, scale, out):
    start = 0
    for n in lens:
        out[start : start + n] = torch_ref.prefill_attention(query[start : start + n], key[start : start + n],
                                                             value[start : start + n], scale)
        start += n


def _npu_paged_attention_splitfuse(*, query, key_cache, value_cache, block_table, context_lens, mask, seq_len,
                                   num_kv_heads, num_heads, scale_value, out):
    name = "_npu_paged_attention_splitfuse"
    _count(name)
    _check_paged(name, query, key_cache, value_cache, num_kv_heads, num_heads, block_table, out)
    _cpu_int32(name, "seq_len", seq_len)
    _cpu_int32(name, "context_lens", context_lens)
    _on_device(name, mask=mask)
    q_lens, ctx_lens = seq_len.tolist(), context_lens.tolist()
    _require(sum(q_lens) == query.shape[0], f"{name}: sum(seq_len) must equal the token count")
    masked = float("-inf") if query.dtype == torch.float16 else -10000.0  # vllm-ascend get_splitfuse_attn_mask
    expected = _causal_mask(q_lens, ctx_lens, max(ctx_lens), masked, query.dtype)
    _require(mask.shape == expected.shape and torch.equal(mask.cpu(), expected),
             f"{name}: mask must be [T, max context] with token at position p seeing KV <= p")
    _graphs.launch(_chunked_attention, ("out",), query=query, key_cache=key_cache, value_cache=value_cache,
                   block_table=block_table, q_lens=q_lens, ctx_lens=ctx_lens, scale=scale_value, out=out)


def _chunked_attention(query, key_cache, value_cache, block_table, q_lens, ctx_lens, scale, out):
    block_size, start = key_cache.shape[1], 0
    for i, (q, c) in enumerate(zip(q_lens, ctx_lens)):
        blocks = block_table[i, : cdiv(c, block_size)].long()
        k = torch_ref.gather_kv(key_cache, blocks)[:c]
        v = torch_ref.gather_kv(value_cache, blocks)[:c]
        out[start : start + q] = torch_ref.prefill_attention(query[start : start + q], k, v, scale)
        start += q


def npu_fusion_attention(*args, **kwargs):
    # transformers imports this name whenever torch_npu is importable; npu-llm never calls it.
    raise NpuOpError("npu_fusion_attention is not part of the fake (npu-llm does not use it)")


# -- the torch.npu surface npu-llm uses -------------------------------------------------------------

npu = types.ModuleType("torch.npu")
npu.is_available = lambda: True
npu.device_count = lambda: int(os.environ.get("FAKE_NPU_DEVICES", "1"))


def _set_device(device) -> None:
    index = torch.device(device).index if not isinstance(device, int) else device
    _require(index is not None and 0 <= index < npu.device_count(),
             f"Invalid device ID {index}: this host has {npu.device_count()} NPU(s)")  # (aclrtSetDevice's refusal)
    fake_npu_device.set_current(index)


npu.set_device = _set_device
npu.current_device = lambda: fake_npu_device._NPU.index if fake_npu_device._NPU is not None else 0
npu.synchronize = lambda device=None: None
npu.empty_cache = fake_npu_device.memory.empty_cache
# The chip's name, as aclrtGetSocName reports it (FAKE_NPU_SOC to play another chip).
npu.get_device_name = lambda device=None: os.environ.get("FAKE_NPU_SOC", "Ascend910B3")


def _mem_get_info(device=None):
    # (free, total) of a card of FAKE_NPU_MEMORY_GB (32) with a runtime context of CONTEXT_BYTES in use
    total = int(float(os.environ.get("FAKE_NPU_MEMORY_GB", "32")) * 2**30)
    return total - CONTEXT_BYTES - fake_npu_device.memory.reserved, total


CONTEXT_BYTES = 2**30


npu.mem_get_info = _mem_get_info
npu.memory_allocated = lambda device=None: fake_npu_device.memory.allocated
npu.memory_reserved = lambda device=None: fake_npu_device.memory.reserved
npu.max_memory_allocated = lambda device=None: fake_npu_device.memory.peak
npu.reset_peak_memory_stats = lambda device=None: setattr(fake_npu_device.memory, "peak",
                                                          fake_npu_device.memory.allocated)
for _name in ("NPUGraph", "graph", "graph_pool_handle", "current_stream", "graph_task_group_begin",
              "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end"):
    setattr(npu, _name, getattr(_graphs, _name))
npu.is_initialized = lambda: True
npu._is_in_bad_fork = lambda: False
npu.manual_seed = npu.manual_seed_all = lambda seed: None
fake_npu_device.install(npu)
torch.npu = npu
_hccl.register()


def _autoload() -> None:
    """The `torch.backends` entry point torch_npu registers: `import torch` has imported this package by now."""
