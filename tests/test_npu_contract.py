"""The NPU path against a faithful fake torch_npu (no Ascend hardware here): ops, checks, the whole engine."""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import FAKE_TORCH_NPU as FAKE


# Imports every module of npu-llm but the NPU kernels (npu, npu_mla, npu_quant: ops_for("npu") loads them once the NPU
# is chosen), then picks the CPU, and prints whether torch autoloaded torch_npu and which of our modules imported it.
_IMPORT_EVERYTHING = """
import builtins, importlib, pkgutil, sys
ours, real_import = [], builtins.__import__
def spy(name, globals=None, locals=None, fromlist=(), level=0):
    module = (globals or {}).get("__name__") or ""
    if name.split(".")[0] == "torch_npu" and module.split(".")[0] in ("backend", "npu_llm_kernels", "ui", "loadtest"):
        ours.append(module)
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = spy
import torch
autoloaded = "torch_npu" in sys.modules
import backend, npu_llm_kernels, loadtest
for package in (backend, npu_llm_kernels, loadtest):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        # (the NPU kernels, Triton's and locust's own)
        if info.name not in ("npu_llm_kernels.npu", "npu_llm_kernels.npu_mla", "npu_llm_kernels.npu_quant",
                             "backend.triton.model",
                             "loadtest.locustfile"):
            importlib.import_module(info.name)
from backend.platform import resolve_platform
assert resolve_platform("cpu").name == "cpu"
print(autoloaded, sorted(set(ours)))
"""


@pytest.mark.parametrize("host", ["without torch_npu", "Ascend host: torch autoloads torch_npu"])
def test_npu_llm_imports_torch_npu_only_once_the_npu_is_chosen(host, tmp_path):
    """What npu-llm guarantees: none of its modules imports torch_npu until the NPU is chosen. On an Ascend
    host torch (2.5+) imports torch_npu itself on `import torch`, through the `torch.backends` entry point
    torch_npu registers; that import is torch's, npu-llm still makes none, and everything works on the CPU."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}
    if host.startswith("Ascend"):
        dist = tmp_path / "torch_npu-2.13.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
        (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(FAKE), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _IMPORT_EVERYTHING], capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-2:] == [str(host.startswith("Ascend")), "[]"]


def test_platform_on_npu(fake_npu):
    from backend.platform import resolve_platform

    platform = resolve_platform("npu")
    assert platform.name == "npu" and platform.dist_backend == "hccl"
    assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert os.environ["TASK_QUEUE_ENABLE"] == "1"
    assert resolve_platform("auto").name == "npu"  # auto prefers the NPU


def test_a_host_without_nnal_fails_at_start_not_mid_request(fake_npu, monkeypatch):
    """torch_npu imports without CANN NNAL and raises at the first ATB op; npu-llm loads the ops up front."""
    from backend.npu_host import NpuHostError
    from backend.platform import resolve_platform

    monkeypatch.setenv("FAKE_NPU_NNAL", "0")
    with pytest.raises(OSError, match="nnal package"):  # what a request would have met
        fake_npu._npu_reshape_and_cache(key=None, value=None, key_cache=None, value_cache=None, slot_indices=None)
    with pytest.raises(NpuHostError, match="libatb.so.*source /usr/local/Ascend/nnal/atb/set_env.sh"):
        resolve_platform("npu")


@pytest.mark.parametrize("chip, why", [("Ascend310P3", "an Atlas inference chip.*float16"),
                                       ("Ascend910A", "not a chip npu-llm's ATB kernels are known to run on")])
def test_chips_other_than_atlas_a2_a3_are_refused(fake_npu, monkeypatch, chip, why):
    from backend.npu_host import NpuHostError
    from backend.platform import resolve_platform

    monkeypatch.setenv("FAKE_NPU_SOC", chip)
    with pytest.raises(NpuHostError, match=f"{chip} is {why}.*serve on Atlas A2/A3"):
        resolve_platform("npu")
    monkeypatch.setenv("FAKE_NPU_SOC", "Ascend910_9391")
    assert resolve_platform("npu").name == "npu"


@pytest.mark.slow
def test_a_second_rope_table_in_one_process_is_refused(fake_npu):
    """The rotary op keeps the first rope table it sees for the life of the process: an engine with a longer
    table must not start (its positions past the first table would be rotated with garbage), an equal or
    shorter one may."""
    from backend import LLM, SamplingParams

    args = dict(device="npu", dtype="bfloat16", num_kv_blocks=4, max_num_seqs=1)
    first = LLM(max_model_len=256, **args)
    LLM(max_model_len=200, **args)  # a prefix of the cached table: rotated correctly
    with pytest.raises(RuntimeError, match="keeps the rope table of the first model.*own process"):
        LLM(max_model_len=512, **args)
    assert first.generate(["1, 2,"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


def test_ops_reject_what_the_real_ops_reject(fake_npu):
    from npu_llm_kernels import AttentionMetadata, npu

    key = torch.randn(3, 2, 64, dtype=torch.bfloat16, device="npu")
    cache = torch.zeros(4, 128, 2, 64, dtype=torch.bfloat16, device="npu")
    md = AttentionMetadata.build([3], [3], [[1]], 128, device="npu")
    npu.reshape_and_cache(key, key, cache, cache.clone(), md.slot_mapping)  # fine
    with pytest.raises(fake_npu.NpuOpError, match="float16/bfloat16"):
        npu.reshape_and_cache(key.float(), key.float(), cache.float(), cache.float(), md.slot_mapping)
    with pytest.raises(fake_npu.NpuOpError, match="int32"):
        fake_npu._npu_reshape_and_cache(key=key, value=key, key_cache=cache, value_cache=cache.clone(),
                                        slot_indices=md.slot_mapping)  # int64 slots
    with pytest.raises(fake_npu.NpuOpError, match="slot_indices must be on the NPU"):
        npu.reshape_and_cache(key, key, cache, cache.clone(), md.slot_mapping.cpu())
    with pytest.raises(ValueError, match="block_size 128"):
        small = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device="npu")
        npu.paged_attention(key, key, key, small, small, AttentionMetadata.build([3], [3], [[1]], 16, "npu"), 0.1)
    q = torch.randn(3, 4, 64, dtype=torch.bfloat16, device="npu")
    bad_mask = torch.zeros(3, 3, dtype=torch.bfloat16, device="npu")  # not causal
    flash = dict(query=q, key=key, value=key, seq_len=torch.tensor([3], dtype=torch.int32), scale_value=0.1,
                 num_heads=4, num_kv_heads=2, out=torch.empty_like(q))
    with pytest.raises(fake_npu.NpuOpError, match="causal mask"):
        fake_npu._npu_flash_attention(mask=bad_mask, **flash)
    with pytest.raises(fake_npu.NpuOpError, match="mask must be on the NPU"):
        fake_npu._npu_flash_attention(mask=bad_mask.cpu(), **flash)
    with pytest.raises(fake_npu.NpuOpError, match="multiple of num_kv_heads"):
        fake_npu._npu_flash_attention(mask=bad_mask, **{**flash, "num_kv_heads": 3})
    with pytest.raises(fake_npu.NpuOpError, match="out must be contiguous"):
        fake_npu._npu_flash_attention(mask=bad_mask, **{**flash, "out": torch.empty(4, 3, 64, dtype=q.dtype,
                                                                                    device="npu").transpose(0, 1)})
    paged = dict(query=q, key_cache=cache, value_cache=cache, num_kv_heads=2, num_heads=4, scale_value=0.1,
                 block_table=md.block_tables, context_lens=torch.tensor([1, 2, 3], dtype=torch.int32),
                 out=torch.empty_like(q))
    fake_npu._npu_paged_attention(**paged)  # fine
    with pytest.raises(fake_npu.NpuOpError, match="context_lens must be a CPU int32"):  # "hostData is null"
        fake_npu._npu_paged_attention(**{**paged, "context_lens": paged["context_lens"].to("npu")})
    with pytest.raises(fake_npu.NpuOpError, match="CPU int32"):
        fake_npu._npu_paged_attention(**{**paged, "context_lens": torch.tensor([1, 2, 3])})
    with pytest.raises(fake_npu.NpuOpError, match="block_table must be on the NPU"):
        fake_npu._npu_paged_attention(**{**paged, "block_table": md.block_tables.cpu()})
    with pytest.raises(fake_npu.NpuOpError, match="workspace of 16 bytes"):
        fake_npu._npu_paged_attention(**paged, workspace=torch.empty(16, dtype=torch.uint8, device="npu"))
    wide = torch.zeros(4, 128, 2, 320, dtype=torch.bfloat16, device="npu")
    with pytest.raises(fake_npu.NpuOpError, match="head_dim must be in"):
        fake_npu._npu_paged_attention(**{**paged, "query": torch.zeros(3, 4, 320, dtype=torch.bfloat16, device="npu"),
                                         "key_cache": wide, "value_cache": wide,
                                         "out": torch.zeros(3, 4, 320, dtype=torch.bfloat16, device="npu")})
    positions = torch.arange(3, device="npu")
    flat_q, flat_k = q.reshape(3, -1).contiguous(), key.reshape(3, -1).contiguous()
    with pytest.raises(fake_npu.NpuOpError, match="cos_sin_cache must be"):
        fake_npu._npu_rotary_embedding(positions, flat_q, flat_k, 64, torch.zeros(16, 32, device="npu"), True)
    with pytest.raises(RuntimeError, match="same device"):  # torch itself refuses host and device in one op
        key + key.cpu()


def test_device_memory_is_accounted(fake_npu):
    """The fake's allocator counts live device storages (views share theirs); host tensors cost nothing."""
    torch.npu.empty_cache()  # (what earlier tests freed)
    start = torch.npu.memory_allocated()
    torch.npu.reset_peak_memory_stats()
    block = torch.zeros(1024, 256, dtype=torch.bfloat16, device="npu")
    view = block[:10]
    host = torch.zeros(4096, 4096)
    assert host.device.type == "cpu" and torch.npu.memory_allocated() - start == 1024 * 256 * 2
    free, total = torch.npu.mem_get_info()
    del block
    assert torch.npu.memory_allocated() - start == 1024 * 256 * 2  # the view keeps the storage alive
    del view
    assert torch.npu.memory_allocated() == start
    assert torch.npu.max_memory_allocated() - start == 1024 * 256 * 2
    assert torch.npu.mem_get_info()[0] == free  # a caching allocator keeps freed blocks reserved...
    torch.npu.empty_cache()
    assert torch.npu.mem_get_info()[0] == free + 1024 * 256 * 2  # ...until it is emptied


@pytest.mark.slow
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_kv_cache_gets_what_weights_activations_and_graphs_leave(fake_npu, monkeypatch, caplog, enforce_eager):
    """The KV cache is sized as vLLM sizes it: gpu_memory_utilization of the device, less the weights, the
    peak of the largest step (max_num_batched_tokens), the decode graphs and the runtime's own memory."""
    from backend import LLM

    monkeypatch.setenv("FAKE_NPU_MEMORY_GB", "3")
    caplog.set_level("INFO", logger="backend.engine.startup")
    gc.collect()
    leftover = torch.npu.memory_allocated()  # (device tensors earlier tests still hold count as "other")
    args = dict(device="npu", dtype="bfloat16", max_model_len=512, max_num_seqs=4, gpu_memory_utilization=0.7,
                max_seq_len_to_capture=256, enforce_eager=enforce_eager)
    small = LLM(max_num_batched_tokens=256, **args).engine
    split = small.memory_split
    assert split.total == 3 * 2**30 and split.budget == int(0.7 * 3 * 2**30)
    # the runtime's context and the rotary op's cached tables; the profile's freed blocks are not mistaken for used memory
    assert 0 <= split.other - fake_npu.CONTEXT_BYTES - leftover < 2**20
    assert "weights 0.25, activations 0.0" in caplog.text and f"({small.kv.num_blocks} blocks)" in caplog.text
    tensors = [*small.model.parameters(), *small.model.buffers()]
    weights = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    assert weights <= split.weights < weights * 1.1
    assert split.activations > 0 and (split.graphs > 0) == (not enforce_eager)
    per_block = small.runner.bytes_per_block(small.model, 128)
    assert small.kv.num_blocks == split.kv_cache // per_block
    # the whole budget is used, and nothing beyond it: serving never needs more than was set aside
    in_use = torch.npu.memory_allocated() - leftover + split.other + split.activations
    assert split.budget - per_block <= in_use <= split.budget
    del small
    large = LLM(max_num_batched_tokens=1024, **args).engine  # (the small engine's memory counts as "other" if alive)
    assert large.memory_split.activations > 2 * split.activations  # a 1024-token step needs more
    assert large.kv.num_blocks < split.kv_cache // per_block


@pytest.mark.parametrize("case", ["decode", "fresh-prefill", "mixed"])
def test_npu_attention_matches_torch_ref(fake_npu, case):
    from npu_llm_kernels import AttentionMetadata, npu, torch_ref
    from npu_llm_kernels.metadata import cdiv

    seqs = {"decode": [(5, 1), (130, 1), (256, 1)], "fresh-prefill": [(40, 40), (129, 129)],
            "mixed": [(7, 1), (300, 1), (200, 72), (64, 64)]}[case]
    torch.manual_seed(0)
    cache_k = torch.randn(16, 128, 2, 64, dtype=torch.bfloat16)
    cache_v = torch.randn_like(cache_k)
    tables, nxt = [], 0
    for ctx, _ in seqs:
        n = cdiv(ctx, 128)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    query_lens, context_lens = [q for _, q in seqs], [c for c, _ in seqs]
    md = AttentionMetadata.build(query_lens, context_lens, tables, 128)
    tokens = sum(q for _, q in seqs)
    q = torch.randn(tokens, 4, 64, dtype=torch.bfloat16)
    k, v = torch.randn(tokens, 2, 64, dtype=torch.bfloat16), torch.randn(tokens, 2, 64, dtype=torch.bfloat16)
    torch_ref.reshape_and_cache(k, v, cache_k, cache_v, md.slot_mapping)
    expected = torch_ref.paged_attention(q, k, v, cache_k, cache_v, md, 0.125)
    on_npu = [t.to("npu") for t in (q, k, v, cache_k, cache_v)]
    ours = npu.paged_attention(*on_npu, AttentionMetadata.build(query_lens, context_lens, tables, 128, "npu"), 0.125)
    assert ours.device.type == "npu"
    torch.testing.assert_close(ours.cpu(), expected, atol=2e-2, rtol=2e-2)
    op = {"decode": "_npu_paged_attention", "fresh-prefill": "_npu_flash_attention",
          "mixed": "_npu_paged_attention_splitfuse"}[case]
    assert fake_npu.calls.get(op) == 1


# -- mixture of experts ------------------------------------------------------------------------------------------


def _router_logits(tokens: int, experts: int) -> torch.Tensor:
    """bf16 logits with no two alike in a row (multiples of 1/8, exact in bf16): no ties for the choice to break."""
    return (torch.stack([torch.randperm(experts) for _ in range(tokens)]).float() / 8 - experts / 16).bfloat16()


def _expert_weights(experts: int, hidden: int, inter: int):
    w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).bfloat16()
    return w13, (torch.randn(experts, hidden, inter) / inter**0.5).bfloat16()


def _by_expert(weights: torch.Tensor, ids: torch.Tensor):
    """Each token's choices ordered by expert id (the op returns them best first, torch_ref in any order)."""
    ids, order = ids.cpu().long().sort(dim=1)
    return weights.cpu().gather(1, order), ids


# name: (experts, top_k, select_experts arguments, the experts this rank holds: (first, how many))
MOE_CASES = {
    "softmax-renormalize": (16, 4, dict(renormalize=True), (0, 16)),
    "sigmoid-groups-bias-scaling": (64, 6, dict(renormalize=True, scoring_func="sigmoid", num_expert_group=8,
                                                topk_group=4, routed_scaling_factor=2.5), (0, 64)),
    "expert-parallel-slice": (16, 4, dict(renormalize=True), (6, 5)),
    # one expert a rank: a group_list of one count, which group_list_type 1 refuses (docs/npu.md 11.3)
    "one-expert-a-rank": (16, 4, dict(renormalize=True), (3, 1)),
}


@pytest.mark.parametrize("case", MOE_CASES)
def test_npu_moe_matches_torch_ref(fake_npu, case):
    from npu_llm_kernels import npu, torch_ref

    experts, top_k, select, (first, local) = MOE_CASES[case]
    torch.manual_seed(0)
    tokens, hidden, inter = 24, 64, 32
    logits = _router_logits(tokens, experts)
    if case.startswith("sigmoid"):
        select["e_score_correction_bias"] = (torch.randn(experts) * 0.1).bfloat16()
    weights, ids = torch_ref.select_experts(logits, top_k, **select)
    on_npu = {k: v.to("npu") if isinstance(v, torch.Tensor) else v for k, v in select.items()}
    npu_weights, npu_ids = npu.select_experts(logits.to("npu"), top_k, **on_npu)
    assert npu_weights.dtype == torch.float32 and npu_ids.dtype == torch.int32 and npu_ids.device.type == "npu"
    ref_w, ref_ids = _by_expert(weights, ids)
    got_w, got_ids = _by_expert(npu_weights, npu_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, atol=1e-2, rtol=1e-2)  # the op's weights are bf16

    x = torch.randn(tokens, hidden).bfloat16()
    w13, w2 = _expert_weights(local, hidden, inter)
    expected = torch_ref.fused_experts(x, w13, w2, weights, ids, first_expert=first)
    packed = npu.pack_expert_weights(w13.to("npu"), w2.to("npu"))
    assert packed[0].shape == (local, hidden, 2 * inter) and packed[1].shape == (local, inter, hidden)
    ours = npu.fused_experts(x.to("npu"), *packed, weights.to("npu"), ids.to("npu"), first_expert=first)
    assert ours.device.type == "npu" and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.cpu(), expected, atol=2e-2, rtol=2e-2)
    assert fake_npu.calls == {"npu_moe_gating_top_k": 1, "npu_moe_init_routing_v2": 1, "npu_grouped_matmul": 2,
                              "npu_swiglu": 1, "npu_moe_token_unpermute": 1}


def test_npu_moe_ranks_sum_to_the_whole_layer(fake_npu):
    """Expert parallel: each rank's share of the layer, summed, is the whole; a rank whose experts no token chose
    adds exact zeros (the rows the ops leave unwritten, NaN in the fake, are never read)."""
    from npu_llm_kernels import npu, torch_ref

    torch.manual_seed(1)
    tokens, experts, hidden, inter = 16, 16, 64, 32
    logits = _router_logits(tokens, experts)
    logits[:, 12:] -= 8  # experts 12-15 are never chosen
    weights, ids = npu.select_experts(logits.to("npu"), 3, True)
    x = torch.randn(tokens, hidden).bfloat16().to("npu")
    w13, w2 = _expert_weights(experts, hidden, inter)
    whole = npu.fused_experts(x, *npu.pack_expert_weights(w13.to("npu"), w2.to("npu")), weights, ids)
    shares = [npu.fused_experts(x, *npu.pack_expert_weights(w13[a:b].to("npu"), w2[a:b].to("npu")), weights, ids,
                                first_expert=a) for a, b in [(0, 5), (5, 12), (12, 16)]]
    assert torch.equal(shares[2].cpu(), torch.zeros(tokens, hidden, dtype=torch.bfloat16))
    torch.testing.assert_close(sum(s.cpu().float() for s in shares), whole.cpu().float(), atol=2e-2, rtol=2e-2)
    expected = torch_ref.fused_experts(x.cpu(), w13, w2, weights.cpu(), ids.cpu())
    torch.testing.assert_close(whole.cpu(), expected, atol=2e-2, rtol=2e-2)


def test_npu_moe_layer_replays_in_a_graph(fake_npu):
    """Routing and experts capture in a decode graph: no value is read back to the host, and a replay computes on
    whatever the input buffers hold (ids above the range and the unwritten rows included)."""
    from npu_llm_kernels import npu, torch_ref

    torch.manual_seed(2)
    tokens, experts, hidden, inter = 8, 16, 64, 32
    w13, w2 = _expert_weights(6, hidden, inter)
    packed = npu.pack_expert_weights(w13.to("npu"), w2.to("npu"))
    logits, x = _router_logits(tokens, experts).to("npu"), torch.randn(tokens, hidden).bfloat16().to("npu")
    graph = torch.npu.NPUGraph()
    with torch.inference_mode():
        with torch.npu.graph(graph):
            out = npu.fused_experts(x, *packed, *npu.select_experts(logits, 4, True), first_expert=4)
        new_logits, new_x = _router_logits(tokens, experts), torch.randn(tokens, hidden).bfloat16()
        logits.copy_(new_logits.to("npu"))
        x.copy_(new_x.to("npu"))
        graph.replay()
    expected = torch_ref.fused_experts(new_x, w13, w2, *torch_ref.select_experts(new_logits, 4, True), first_expert=4)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-2, rtol=2e-2)

def test_sigmoid_routing_without_renormalization_stays_in_torch(fake_npu):
    """The gating op always renormalises sigmoid weights; as vllm-ascend does, that case is left to plain torch."""
    from npu_llm_kernels import npu, torch_ref

    logits = _router_logits(8, 16)
    ours = npu.select_experts(logits.to("npu"), 2, False, scoring_func="sigmoid")
    expected = torch_ref.select_experts(logits, 2, False, scoring_func="sigmoid")
    assert "npu_moe_gating_top_k" not in fake_npu.calls
    assert torch.equal(_by_expert(*ours)[1], _by_expert(*expected)[1])


def test_moe_ops_reject_what_the_real_ops_reject(fake_npu):
    refused = fake_npu.NpuOpError
    logits = _router_logits(4, 64).to("npu")
    gating = dict(k=4, k_group=2, group_count=8, group_select_mode=1, norm_type=1)
    fake_npu.npu_moe_gating_top_k(logits, **gating)  # fine
    with pytest.raises(refused, match="at most 2048 experts"):
        fake_npu.npu_moe_gating_top_k(torch.zeros(4, 4096, dtype=torch.bfloat16, device="npu"), k=4)
    with pytest.raises(refused, match="64 experts must divide into group_count=6"):
        fake_npu.npu_moe_gating_top_k(logits, **{**gating, "group_count": 6})
    for k in (0, 17):  # k_group * experts per group = 2 * 8
        with pytest.raises(refused, match=r"k must be in \[1, k_group \* experts per group = 16\]"):
            fake_npu.npu_moe_gating_top_k(logits, **{**gating, "k": k})
    for k_group in (0, 9):
        with pytest.raises(refused, match=r"k_group must be in \[1, group_count=8\]"):
            fake_npu.npu_moe_gating_top_k(logits, **{**gating, "k_group": k_group})
    with pytest.raises(refused, match="more than 2 experts"):
        fake_npu.npu_moe_gating_top_k(logits, **{**gating, "group_count": 32})
    with pytest.raises(refused, match="x must be 2-D float16/bfloat16/float32"):
        fake_npu.npu_moe_gating_top_k(logits.double(), **gating)
    with pytest.raises(refused, match="bias must be 1-D \\[64\\] in x's dtype"):
        fake_npu.npu_moe_gating_top_k(logits, bias=torch.zeros(64, device="npu"), **gating)  # float32 bias
    with pytest.raises(refused, match="only renorm=0"):
        fake_npu.npu_moe_gating_top_k(logits, renorm=1, **gating)

    x = torch.randn(4, 64, dtype=torch.bfloat16, device="npu")
    ids = torch.tensor([[0, 3], [1, 2], [3, 3], [2, 0]], dtype=torch.int32, device="npu")
    routing = dict(active_num=8, expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True,
                   active_expert_range=[1, 3], quant_mode=-1)
    expanded_x, row_idx, counts, _ = fake_npu.npu_moe_init_routing_v2(x, ids, **routing)  # fine
    assert counts.tolist() == [1, 2] and row_idx.tolist() == [-1, -1, 0, 1, -1, -1, 2, -1]
    assert torch.equal(expanded_x[:3].cpu(), x.cpu()[[1, 1, 3]]) and expanded_x[3:].isnan().all()
    with pytest.raises(refused, match="expert_idx must be int32"):
        fake_npu.npu_moe_init_routing_v2(x, ids.long(), **routing)
    with pytest.raises(refused, match=r"expert ids must be in \[0, expert_num=3\)"):
        fake_npu.npu_moe_init_routing_v2(x, ids, **{**routing, "expert_num": 3})
    with pytest.raises(refused, match="active_expert_range must be"):
        fake_npu.npu_moe_init_routing_v2(x, ids, **{**routing, "active_expert_range": [2, 5]})
    with pytest.raises(refused, match=r"expert_num must be in \[1, 10240\]"):
        fake_npu.npu_moe_init_routing_v2(x, ids, **{**routing, "expert_num": 10241, "active_expert_range": [0, 4]})

    weight = torch.randn(2, 64, 16, dtype=torch.bfloat16, device="npu")
    group_list = torch.tensor([1, 2], device="npu")
    gmm = dict(split_item=2, group_list_type=1, group_type=0, group_list=group_list)
    y = fake_npu.npu_grouped_matmul([expanded_x], [weight], **gmm)[0]  # fine: rows past the groups are left alone
    torch.testing.assert_close(y[:3].cpu(), torch.cat([expanded_x[:1].cpu() @ weight[0].cpu(),
                                                       expanded_x[1:3].cpu() @ weight[1].cpu()]), atol=0.1, rtol=0.02)
    with pytest.raises(refused, match="must be float16 or bfloat16"):
        fake_npu.npu_grouped_matmul([expanded_x.float()], [weight.float()], **gmm)
    with pytest.raises(refused, match="group_list must be 1-D int64"):
        fake_npu.npu_grouped_matmul([expanded_x], [weight], **{**gmm, "group_list": group_list.int()})
    with pytest.raises(refused, match="the groups hold 9 rows, x has 8"):
        fake_npu.npu_grouped_matmul([expanded_x], [weight], **{**gmm, "group_list": torch.tensor([4, 5], device="npu")})
    with pytest.raises(refused, match="inner dim 64 != the weight's K 16"):
        fake_npu.npu_grouped_matmul([expanded_x], [weight.transpose(1, 2)], **gmm)
    with pytest.raises(refused, match="group_list_type must be 0 .cumsum. or 1"):
        fake_npu.npu_grouped_matmul([expanded_x], [weight], **{**gmm, "group_list_type": 2})
    with pytest.raises(refused, match="split_item 2 or 3"):
        fake_npu.npu_grouped_matmul([expanded_x], [weight], **{**gmm, "split_item": 0})
    with pytest.raises(refused, match="at most 1024"):
        fake_npu.npu_grouped_matmul([expanded_x[:, :1]], [torch.zeros(1025, 1, 1, dtype=torch.bfloat16, device="npu")],
                                    **{**gmm, "group_list": torch.zeros(1025, dtype=torch.int64, device="npu")})

    with pytest.raises(refused, match="must have an even size"):
        fake_npu.npu_swiglu(torch.zeros(3, 5, dtype=torch.bfloat16, device="npu"))
    with pytest.raises(refused, match="contiguous"):
        fake_npu.npu_swiglu(torch.zeros(4, 6, dtype=torch.bfloat16, device="npu").t())

    probs = torch.full((4, 2), 0.5, dtype=torch.bfloat16, device="npu")
    permutation = torch.tensor([0, 4, 5, 1, 2, 6, 7, 3], dtype=torch.int32, device="npu")
    fake_npu.npu_moe_token_unpermute(y, permutation, probs=probs)  # fine
    with pytest.raises(refused, match="must not repeat an index"):  # vllm-ascend's abs(expanded_row_idx) on A2/A3
        fake_npu.npu_moe_token_unpermute(y, row_idx.abs(), probs=probs)
    with pytest.raises(refused, match=r"sorted_indices must be in \[0, 7\]"):  # the raw -1s (its A5 path)
        fake_npu.npu_moe_token_unpermute(y, row_idx, probs=probs)
    with pytest.raises(refused, match="sorted_indices must be 1-D int32"):
        fake_npu.npu_moe_token_unpermute(y, permutation.long(), probs=probs)
    with pytest.raises(refused, match="topK must be <= 512"):
        fake_npu.npu_moe_token_unpermute(torch.zeros(513, 4, dtype=torch.bfloat16, device="npu"),
                                         torch.arange(513, dtype=torch.int32, device="npu"),
                                         probs=torch.ones(1, 513, dtype=torch.bfloat16, device="npu"))


@pytest.mark.slow
def test_tensor_parallel_on_the_npu_talks_hccl_and_equals_the_cpu_path(fake_npu, monkeypatch, tmp_path,
                                                                      default_model_dir):
    """TP=2 on two (fake) NPUs: rank 1 on npu:1 in its own process, the model's collectives on the hccl backend
    (which refuses host tensors), every op's contract checked on both ranks; the tokens are the CPU path's."""
    from backend import LLM, SamplingParams
    from tests.conftest import make_tiny_model

    monkeypatch.setenv("FAKE_NPU_DEVICES", "2")
    monkeypatch.setenv("NPU_LLM_CPU_KERNELS", "0")  # the CPU path: the portable kernels, the same math
    args = dict(model=str(make_tiny_model("llama", tmp_path / "llama")), tokenizer=str(default_model_dir),
                dtype="bfloat16", block_size=128, num_kv_blocks=8, max_num_batched_tokens=6, max_num_seqs=1,
                tensor_parallel_size=2)
    prompts = [{"prompt_token_ids": list(range(1 + i, 12 + 3 * i))} for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for device in ("npu", "cpu"):
        with LLM(device=device, **args) as llm:
            outputs[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if device == "npu":
            assert llm.engine.platform.device == torch.device("npu", 0)
            assert fake_npu.calls.get("hccl.allreduce", 0) > 0 and fake_npu.calls.get("hccl.allgather", 0) > 0
    assert outputs["npu"] == outputs["cpu"] and all(len(t) == 8 for t in outputs["npu"])


@pytest.mark.slow
def test_drafts_are_verified_through_splitfuse_on_the_npu(fake_npu):
    """n-gram drafts on the NPU: each verification is k + 1 query tokens after a cached context, which only
    _npu_paged_attention_splitfuse takes (the decode op takes one token a sequence); greedy tokens equal the NPU's
    own without drafts, and drafts were kept."""
    from backend import LLM, SamplingParams

    passage = "The committee met on Tuesday to review the budget for the coming year and the library's new roof."
    messages = [[{"role": "user", "content": f"Copy this passage word for word:\n\n{passage}"}]]
    params = SamplingParams(temperature=0, max_tokens=24)
    args = dict(device="npu", dtype="bfloat16", num_kv_blocks=8, max_num_seqs=1)
    with LLM(**args) as plain:
        [expected] = plain.chat(messages, params)
    fake_npu.calls.clear()
    with LLM(**args, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                         "prompt_lookup_max": 4}) as llm:
        [drafted] = llm.chat(messages, params)
        spec = llm.engine.stats().spec_decode
        assert llm.engine.kv.num_free_blocks == 8
    assert drafted.outputs[0].token_ids == expected.outputs[0].token_ids
    assert spec.num_accepted_tokens > 0
    assert fake_npu.calls.get("_npu_paged_attention_splitfuse", 0) >= spec.num_drafts  # (a verification each)


def test_engine_on_npu_equals_cpu_path(fake_npu, monkeypatch):
    from backend import LLM, SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2,"]
    params = SamplingParams(temperature=0, max_tokens=12)
    # One sequence per step, so both paths do the same arithmetic: in a mixed batch the NPU path sends
    # decode tokens through splitfuse while the CPU path batches them apart, and bf16 rounds the two
    # differently (mixed batches are compared with a tolerance in test_npu_attention_matches_torch_ref).
    # A 6-token budget chunks all but the shortest prompt (which takes the flash-attention path); the second
    # long prompt reuses the first one's cached 128-token block.
    args = dict(dtype="bfloat16", num_kv_blocks=24, max_num_batched_tokens=6, enable_prefix_caching=True,
                max_num_seqs=1)
    on_npu = LLM(device="npu", **args)
    assert on_npu.engine.config.block_size == 128 and on_npu.engine.platform.name == "npu"
    npu_outputs = on_npu.generate(prompts, params)
    long_prompt = "Once upon a time " * 33
    first, second = on_npu.generate([long_prompt, long_prompt + "there was"], params)
    assert on_npu.engine.stats().prefix_cache_hit_rate > 0
    for op in ("_npu_reshape_and_cache", "_npu_paged_attention", "_npu_paged_attention_splitfuse", "_npu_flash_attention",
               "_npu_rotary_embedding", "npu_rms_norm", "npu_add_rms_norm"):
        assert fake_npu.calls.get(op, 0) > 0, op

    monkeypatch.setenv("NPU_LLM_CPU_KERNELS", "0")  # the portable CPU kernels: the same math in the same dtype
    on_cpu = LLM(device="cpu", block_size=128, **args)
    cpu_outputs = on_cpu.generate(prompts, params)
    for a, b in zip(npu_outputs, cpu_outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    cpu_first, cpu_second = on_cpu.generate([long_prompt, long_prompt + "there was"], params)
    assert first.outputs[0].token_ids == cpu_first.outputs[0].token_ids
    assert second.outputs[0].token_ids == cpu_second.outputs[0].token_ids

    with pytest.raises(ValueError, match="block_size"):
        LLM(device="npu", dtype="bfloat16", block_size=16, num_kv_blocks=8)


def test_fake_graph_replays_recorded_ops_and_task_group_updates(fake_npu):
    """The fake NPUGraph behaves as a captured graph: replay recomputes on whatever the captured
    buffers hold, host values stay as captured, and only a task-group update, issued on another
    stream than the capture's, changes them. Device memory it read but did not allocate is only addressed, and
    nothing computed in the graph (by an aten op or a fused op) can be read back to the host during the capture."""
    graph, x, host = torch.npu.NPUGraph(), torch.ones(3, device="npu"), torch.tensor([2], dtype=torch.int32)
    out = torch.empty(3, device="npu")
    with torch.inference_mode():
        with torch.npu.graph(graph):
            doubled = x * 2
            capture_stream = torch.npu.current_stream()
            torch.npu.graph_task_group_begin(capture_stream)
            torch.add(doubled, int(host), out=out)  # the host value is baked in
            handle = torch.npu.graph_task_group_end(capture_stream)
        x.copy_(torch.tensor([1.0, 2.0, 3.0]))
        host.fill_(100)  # not seen by the replay
        graph.replay()
        assert out.tolist() == [4.0, 6.0, 8.0]
        with pytest.raises(fake_npu._graphs.NpuGraphError, match="another stream"):
            torch.npu.graph_task_update_begin(capture_stream, handle)
        stream = torch.npu.current_stream()
        torch.npu.graph_task_update_begin(stream, handle)
        torch.add(doubled, int(host), out=out)
        torch.npu.graph_task_update_end(stream)
        x.zero_()
        graph.replay()
        assert out.tolist() == [100.0, 100.0, 100.0]
        del x  # the graph still reads it: a real replay would read freed memory
        with pytest.raises(fake_npu._graphs.NpuGraphError, match="freed after the capture"):
            graph.replay()
    with pytest.raises(fake_npu._graphs.NpuGraphError, match="only valid while capturing"):
        torch.npu.graph_task_group_begin(stream)
    with pytest.raises(fake_npu._graphs.NpuGraphError, match="syncs the device"):
        with torch.inference_mode(), torch.npu.graph(torch.npu.NPUGraph()):
            int((out + 1).max())
    key, slot = torch.ones(1, 1, 1, dtype=torch.float16, device="npu"), torch.zeros(1, dtype=torch.int32, device="npu")
    key_cache, value_cache = (torch.zeros(1, 1, 1, 1, dtype=torch.float16, device="npu") for _ in range(2))
    with pytest.raises(fake_npu._graphs.NpuGraphError, match="syncs the device"):  # nor what a fused op wrote
        with torch.inference_mode(), torch.npu.graph(torch.npu.NPUGraph()):
            fake_npu._npu_reshape_and_cache(key=key, value=key, key_cache=key_cache, value_cache=value_cache,
                                            slot_indices=slot)
            key_cache.item()


@pytest.mark.slow
def test_graph_mode_on_npu_equals_eager(fake_npu):
    """enforce_eager=False: decode steps replay captured NPU graphs, the paged-attention op re-issued with each
    step's lengths; greedy tokens equal the eager engine's, padded batches and the eager fallback included."""
    from backend import LLM, SamplingParams

    # Step 1 prefills all four prompts (eagerly). Steps 2-4 decode all four: the long prompt (~280 tokens) passes
    # the 256-token capture limit, so they run eagerly too. The long one stops after 4 tokens, and steps 5-12
    # replay the 4-row graph for the three short ones, with one padding row.
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2,", "Once upon a time " * 70]
    params = [SamplingParams(temperature=0, max_tokens=12)] * 3 + [SamplingParams(temperature=0, max_tokens=4)]
    args = dict(device="npu", dtype="bfloat16", num_kv_blocks=24, max_num_seqs=4, max_model_len=512,
                max_seq_len_to_capture=256)
    graphed = LLM(enforce_eager=False, **args)
    graphs = graphed.engine.runner.decode_graphs
    assert graphs.batch_sizes == [1, 2, 4] and graphs.widths == [256]
    # One workspace per batch size, shared by every layer, sized for 6144 tokens of context (vllm-ascend):
    # the op is asked twice per graph (at 6144 and at the capture width), not once per layer.
    assert fake_npu.calls["_npu_paged_attention_get_workspace"] == 2 * len(graphs.batch_sizes)
    heads = graphed.engine.model_config.num_attention_heads
    for (size, _), captured in graphs.graphs.items():
        assert captured.capture.workspace.numel() == 4 * heads * 6144 * size
    graphed_outputs = graphed.generate(prompts, params)
    assert graphs.num_replays == 8

    eager = LLM(**args)
    assert eager.engine.runner.decode_graphs is None  # eager is the default
    for a, b in zip(graphed_outputs, eager.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_one_workspace_serves_every_graph_of_a_batch_size(fake_npu, monkeypatch):
    from backend import LLM
    from npu_llm_kernels import npu

    monkeypatch.setattr(npu, "decode_graph_widths", lambda max_len, block_size: [128, max_len])
    llm = LLM(device="npu", dtype="bfloat16", num_kv_blocks=4, max_num_seqs=2, max_model_len=256,
              enforce_eager=False)
    graphs = llm.engine.runner.decode_graphs
    assert sorted(graphs.graphs) == [(1, 128), (1, 256), (2, 128), (2, 256)]
    for size in (1, 2):
        assert graphs.graphs[size, 128].capture.workspace is graphs.graphs[size, 256].capture.workspace
    assert graphs.graphs[1, 256].capture.workspace is not graphs.graphs[2, 256].capture.workspace
    assert fake_npu.calls["_npu_paged_attention_get_workspace"] == 2 * 2


def test_graph_mode_needs_the_paged_attention_workspace_api(fake_npu, monkeypatch):
    from backend import LLM

    monkeypatch.delattr(fake_npu, "_npu_paged_attention_get_workspace")  # torch_npu 2.5.1's op set
    with pytest.raises(RuntimeError, match="workspace.*enforce_eager=True"):
        LLM(device="npu", dtype="bfloat16", num_kv_blocks=8, max_num_seqs=1, max_model_len=256, enforce_eager=False)


@pytest.mark.slow
def test_profile_capture_on_npu_uses_torch_npu_profiler(fake_npu, tmp_path):
    import json

    from backend import LLM, SamplingParams

    llm = LLM(device="npu", dtype="bfloat16", num_kv_blocks=8, max_num_seqs=2, profile_dir=str(tmp_path))
    llm.start_profile()
    llm.generate(["The capital of France is", "1, 2,"], SamplingParams(temperature=0, max_tokens=4))
    result = llm.stop_profile()
    # torch_npu's tensorboard_trace_handler layout: DIR/<worker>_<time>_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json
    traces = list(tmp_path.glob("*_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json"))
    assert [str(p) for p in traces] == [result.trace_path]
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"step", "matmul", "attention.prefill", "attention.decode"} <= names
    breakdown = result.breakdown()
    assert breakdown["decode-only"]["decode attention"]["ms_per_step"] > 0
    assert breakdown["prefill-only"]["prefill attention"]["ms_per_step"] > 0


def test_vllm_ascends_additional_config_is_read_as_it_means_here(fake_npu, caplog):
    """torchair_graph_config.enabled: ACL graphs of decode steps (torchair is gone upstream); chunked_prefill_for_mla:
    chunked prefill; keys vllm-ascend never had are refused by name, as is a layout npu-llm does not serve."""
    from backend import LLM
    from backend.config import EngineConfig

    tuning_guide = {"torchair_graph_config": {"enabled": True, "use_cached_graph": True, "enable_super_kernel": True},
                    "chunked_prefill_for_mla": True, "enable_weight_nz_layout": True}
    with caplog.at_level("INFO", logger="backend.config.ascend"):
        config = EngineConfig(device="npu", enable_chunked_prefill=False, additional_config=tuning_guide)
    assert config.enforce_eager is False and config.enable_chunked_prefill is True
    assert EngineConfig(additional_config={"chunked_prefill_for_mla": False}).enable_chunked_prefill is True
    assert "torchair is gone from vllm-ascend" in caplog.text and "use_cached_graph" in caplog.text
    with LLM(device="npu", dtype="bfloat16", num_kv_blocks=8, max_num_seqs=2, max_model_len=256,
             additional_config={"torchair_graph_config": {"enabled": True}}) as llm:
        assert llm.engine.runner.decode_graphs is not None
    with pytest.raises(ValueError, match="enable_lora: .*leave additional_config's torchair_graph_config.enabled out"):
        EngineConfig(device="npu", enable_lora=True, additional_config=tuning_guide).finalize("npu", 4096)
    for wrong, message in [({"torchair_graph_config": {"enable": True}}, "torchair_graph_config.enable: not a key"),
                           ({"enable_flashcomm": 1}, "enable_flashcomm: not a key npu-llm serves"),
                           ({"enable_weight_nz_layout": False}, "casts W8A8 weights to FRACTAL_NZ always"),
                           ({"chunked_prefill_for_mla": "yes please"}, "chunked_prefill_for_mla: Input should be")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(additional_config=wrong)
