"""torch_ref kernels against dense, textbook computations on random block tables."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from npu_llm_kernels import AttentionMetadata, cpu, torch_ref
from npu_llm_kernels.cpu_features import cpu_features
from npu_llm_kernels.metadata import cdiv
from tests.conftest import CPU_LEVELS, at_cpu_level

# every kernel module must agree with the dense reference: the CPU one at each level this machine can run
OPS = [pytest.param("torch_ref", id="torch_ref")] + [pytest.param(level, id=f"cpu-{level}") for level in CPU_LEVELS]


@pytest.fixture
def ops(request):
    if request.param == "torch_ref":
        yield torch_ref
        return
    with at_cpu_level(request.param):
        yield cpu

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 32  # GQA: 4 query heads per KV head


def _dense_attention(q, k, v, scale):
    """q [q_len, H, D] at the end of a context k/v [ctx, Hkv, D]; causal; explicit softmax."""
    q_len, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    future = torch.arange(ctx)[None, :] > torch.arange(q_len)[:, None] + (ctx - q_len)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _run_batch(seqs, block_size, ops=torch_ref, num_blocks=96, dtype=torch.float32,
               num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM):
    """seqs: (context_len, query_len) pairs, decodes first. Returns (ours, reference) outputs."""
    rng = random.Random(block_size * 1000 + len(seqs))
    torch.manual_seed(len(seqs))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, ks, vs, qs = [], [], [], []
    for ctx, q_len in seqs:
        tables.append([free.pop() for _ in range(cdiv(ctx, block_size))])
        ks.append(torch.randn(ctx, num_kv_heads, head_dim, dtype=dtype))
        vs.append(torch.randn(ctx, num_kv_heads, head_dim, dtype=dtype))
        qs.append(torch.randn(q_len, num_heads, head_dim, dtype=dtype))
        # earlier tokens are already cached
        cached = ctx - q_len
        if cached:
            md = AttentionMetadata.build([cached], [cached], [tables[-1]], block_size)
            torch_ref.reshape_and_cache(ks[-1][:cached], vs[-1][:cached], key_cache, value_cache, md.slot_mapping)
    ctxs, q_lens = [c for c, _ in seqs], [q for _, q in seqs]
    md = AttentionMetadata.build(q_lens, ctxs, tables, block_size)
    new_k = torch.cat([k[c - q :] for k, (c, q) in zip(ks, seqs)])
    new_v = torch.cat([v[c - q :] for v, (c, q) in zip(vs, seqs)])
    torch_ref.reshape_and_cache(new_k, new_v, key_cache, value_cache, md.slot_mapping)
    scale = head_dim**-0.5
    ours = ops.paged_attention(torch.cat(qs), new_k, new_v, key_cache, value_cache, md, scale)
    reference = torch.cat([_dense_attention(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    return ours, reference


@pytest.mark.parametrize("ops", OPS, indirect=True)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize(
    "seqs",
    [
        pytest.param([(1, 1), (17, 1), (128, 1), (129, 1), (300, 1)], id="decodes"),
        pytest.param([(16, 16), (33, 33), (128, 128), (129, 129)], id="fresh-prefills"),
        pytest.param([(48, 16), (129, 1), (256, 128), (130, 2)], id="chunks-after-cached-prefix"),
        pytest.param([(5, 1), (16, 1), (257, 1), (40, 40), (200, 72), (129, 128)], id="mixed"),
    ],
)
def test_paged_attention_matches_dense(seqs, block_size, ops):
    ours, reference = _run_batch(seqs, block_size, ops)
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("ops", OPS, indirect=True)
def test_paged_attention_bf16_within_tolerance(ops):
    ours, reference = _run_batch([(3, 1), (70, 1), (64, 64), (90, 30)], 16, ops, dtype=torch.bfloat16)
    torch.testing.assert_close(ours.float(), reference.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim, num_kv_heads, group", [(64, 3, 3), (64, 2, 7), (128, 2, 4), (128, 1, 1),
                                                            (576, 1, 8), (72, 1, 11), (40, 2, 2), (36, 1, 2)])
def test_cpu_decode_kernel_at_the_head_dims_it_vectorizes(dtype, head_dim, num_kv_heads, group, cpu_level):
    # csrc/decode_attention_avx512.cpp: tiles of 16 tokens (partial ones too), query heads in registers
    # four (D 64) or two (D 128) at a time, blocks crossed mid-tile. csrc/paged_attention_cpu.cpp with AVX2: head dims
    # that are multiples of 8 but 64 and 128 (576: DeepSeek's latent rows), up to 8 query heads of a KV head at once
    # (72 x 11: 8, then 3); 36 takes its portable loop.
    decodes = [(ctx, 1) for ctx in (1, 15, 16, 17, 40, 300)]
    ours, reference = _run_batch(decodes, 16, cpu, dtype=dtype, num_heads=num_kv_heads * group,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim)
    tolerance = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ours.float(), reference.float(), **tolerance)


@pytest.mark.parametrize("head_dim, v_head_dim, num_kv_heads, group", [(64, 64, 3, 3), (128, 128, 2, 4),
                                                                      (192, 128, 4, 1), (576, 512, 1, 4), (34, 48, 1, 2)])
@pytest.mark.parametrize("q_len, ctx", [(1, 1), (13, 13), (300, 300), (7, 77), (30, 61), (1, 40)])
def test_cpu_prefill_kernel_at_the_shapes_it_tiles(head_dim, v_head_dim, num_kv_heads, group, q_len, ctx, cpu_level):
    # csrc/prefill_attention_avx512.cpp (AVX512-BF16 builds; the others take torch's kernel): blocks of 12 queries and
    # tiles of 32 keys, both cut short; output columns 64 at a time, then 16 (48); a cached prefix before the queries
    # (ctx > q_len), odd contexts; MLA's shapes (q/k 192 against v 128, and the absorbed form's latent rows, 576 and
    # 512). q, k and v are views with strided rows, as the model's fused projections give them.
    torch.manual_seed(q_len * 1000 + ctx)
    heads = num_kv_heads * group
    q = torch.randn(q_len, heads, head_dim + 6, dtype=torch.bfloat16)[..., 3:head_dim + 3]
    k = torch.randn(ctx, num_kv_heads, head_dim, dtype=torch.bfloat16)
    v = torch.randn(ctx, 2 * num_kv_heads, v_head_dim, dtype=torch.bfloat16)[:, ::2]
    scale = head_dim**-0.5
    ours = cpu.prefill_attention(q, k, v, scale)
    torch_kernel = torch_ref.prefill_attention(q, k, v, scale)
    reference = _dense_attention(q.float(), k.float(), v.float(), scale)
    assert ours.shape == reference.shape and ours.dtype == torch.bfloat16
    # within bf16's rounding of the output, as torch's own kernel is
    tolerance = dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ours.float(), reference, **tolerance)
    torch.testing.assert_close(torch_kernel.float(), reference, **tolerance)


def test_cpu_prefill_kernel_is_the_avx512_bf16_builds(cpu_level):
    # the test above runs the kernel wherever the build has it, and torch's elsewhere
    assert cpu.compiled().has_prefill_attention() == (cpu_features().build == "avx512_bf16")


def test_cpu_decode_kernel_builds_here(cpu_level):
    # without it the "cpu" cases above would silently test torch_ref twice
    assert cpu.compiled() is not None
    assert cpu.compiled().compiled_isa() == cpu_features().build  # each level's own build, for its own ISA


def test_cpu_kernels_run_without_the_gil(cpu_level):
    # Served, Triton's response sender and the request loop share the engine's process: a kernel holding the GIL
    # would stall them for its whole length. A Python thread notes the time over and over while one long
    # decode-attention call runs (many sequences reading the same few blocks: long, but small): holding the GIL, the
    # call would leave a gap in its notes as long as the kernel (measured: 22-23 ms of a 24 ms call, at half this
    # length; 0.05-0.5 ms without the GIL).
    ext = cpu.compiled()
    num_seqs, ctx, block_size, num_blocks = 256, 8192, 16, 8
    key_cache = torch.randn(num_blocks, block_size, 2, 64)
    tables = (torch.arange(ctx // block_size) % num_blocks).int().repeat(num_seqs, 1)
    query, lens = torch.randn(num_seqs, 8, 64), torch.full((num_seqs,), ctx, dtype=torch.int32)
    seen, done = [], threading.Event()

    def note_the_time():
        while not done.is_set():
            seen.append(time.perf_counter())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the noting thread gets the other core)
    noting = threading.Thread(target=note_the_time)
    noting.start()
    try:
        started = time.perf_counter()
        ext.paged_decode_attention(query, key_cache, key_cache, tables, lens, 0.125)
        ended = time.perf_counter()
    finally:
        done.set()
        noting.join()
        torch.set_num_threads(threads)
    assert ended - started > 0.02  # (far longer than a switch interval: a gap the GIL left could not hide)
    notes = [started, *(t for t in seen if started < t < ended), ended]
    assert max(later - earlier for earlier, later in zip(notes, notes[1:])) < (ended - started) / 2


@pytest.mark.parametrize("ops", OPS, indirect=True)
def test_reshape_and_cache_writes_each_slot(ops):
    cache_k, cache_v = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    # value as the model has it: a view into the fused QKV output, its rows strided by the QKV width
    key, value = torch.randn(3, 2, 8), torch.randn(3, 5, 8)[:, 1:3]
    ops.reshape_and_cache(key, value, cache_k, cache_v, torch.tensor([0, 17, 63]))
    assert torch.equal(cache_k[0, 0], key[0]) and torch.equal(cache_k[1, 1], key[1]) and torch.equal(cache_k[3, 15], key[2])
    assert torch.equal(cache_v[1, 1], value[1])
    assert int((cache_k != 0).any(-1).any(-1).sum()) == 3  # nothing else written
    with pytest.raises((RuntimeError, IndexError)):  # a slot past the cache's end
        ops.reshape_and_cache(key, value, cache_k, cache_v, torch.tensor([0, 17, 64]))


def test_slot_mapping_follows_block_table():
    md = AttentionMetadata.build([1, 3], [18, 3], [[7, 2], [5]], 16)
    # seq 0: position 17 -> block 2 offset 1; seq 1: positions 0..2 of block 5
    assert md.slot_mapping.tolist() == [2 * 16 + 1, 80, 81, 82]


def test_rms_norm_and_fused_add_match_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    hf = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_()
        torch.testing.assert_close(torch_ref.rms_norm(x, hf.weight, 1e-5), hf(x))
        y, summed = torch_ref.add_rms_norm(x, residual, hf.weight, 1e-5)
        torch.testing.assert_close(summed, x + residual)
        torch.testing.assert_close(y, hf(x + residual))


def test_rotary_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from backend.models.llama import build_cos_sin_cache

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, rope_theta=10000.0)
    positions = torch.tensor([0, 1, 5, 200, 7])
    q, k = torch.randn(5, 2, 32), torch.randn(5, 1, 32)
    ours_q, ours_k = torch_ref.rotary_embedding(positions, q, k, build_cos_sin_cache(config, 256))
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(ours_k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("rows", [1, 3, 5, 300])
def test_cpu_linear_from_packed_bf16_weights_equals_f_linear(rows, cpu_level):
    weight, bias = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    packed = cpu.pack_linear_weight(weight)
    features = cpu_features()
    stripes = features.level == "avx512_bf16"  # csrc/linear_bf16_avx512.cpp's layout, not oneDNN's
    assert (hasattr(packed, "unpacked_shape") if stripes else packed.is_mkldnn)  # bf16 weights do get packed here
    ours = cpu.linear(x, packed, bias)
    assert ours.dtype == torch.bfloat16
    if stripes:  # fp32 sums rounded to bf16 once, in their own order: the exact result to one bf16 rounding
        exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        torch.testing.assert_close(ours.double(), exact, rtol=2**-8, atol=1e-5)
    elif features.native_bf16:  # oneDNN's bf16 GEMM from its packed weights (AMX): bit-identical
        assert packed.dtype == torch.bfloat16
        torch.testing.assert_close(ours, torch.nn.functional.linear(x, weight, bias), rtol=0, atol=0)
    elif rows < packed.few_rows_below and packed.few_rows.is_mkldnn:  # oneDNN's bf16 twin: bit-identical
        assert packed.dtype == torch.float32 and packed.few_rows.dtype == torch.bfloat16
        torch.testing.assert_close(ours, torch.nn.functional.linear(x, weight, bias), rtol=0, atol=0)
    else:  # fp32 math (fp32-packed weights, or the AVX2 kernel on the bf16 twin), rounded to bf16 once: fp32's
        # result to within one bf16 rounding
        assert packed.dtype == torch.float32
        exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        torch.testing.assert_close(ours.double(), exact, rtol=2**-8, atol=1e-5)
    if not features.native_bf16 and not stripes:
        # below AVX-512 oneDNN refuses bf16 (its reorder raises there): no oneDNN bf16 twin may be made
        assert features.onednn_bf16 or not packed.few_rows.is_mkldnn
    assert cpu.pack_linear_weight(weight.float()) is not None and not cpu.pack_linear_weight(weight.float()).is_mkldnn


@pytest.mark.parametrize("rows, k, n", [(1, 64, 96), (3, 70, 7), (5, 63, 963), (7, 64, 100), (13, 576, 576),
                                        (32, 1536, 130), (300, 64, 64), (40, 8193, 70), (9, 4100, 300)])
def test_bf16_stripes_linear_at_the_shapes_it_tiles(rows, k, n, cpu_level):
    """csrc/linear_bf16_avx512.cpp (AVX512-BF16 builds): tiles of 6 rows cut short, a last stripe of fewer than 64
    columns (its store masked, in its first vector or a later one: 7, 963, 100), an odd K (the packing's zero beside
    the last value), rows split in two where two threads would get unequal stripes (13, 32), more than 192 rows in
    blocks (300: two of 150), K in blocks of 4096 (8193, 4100; with 5 stripes a thread's next stripe is prefetched
    across them); biases in bf16 and fp32; a 3-d input and one whose rows are strided."""
    ext = cpu.compiled()
    if not ext.has_linear_bf16_stripes():
        assert cpu_features().build != "avx512_bf16"  # the avx512_bf16 build (also amx's) has it
        return
    torch.manual_seed(rows * k + n)
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    packed = cpu._in_linear_stripes(weight)
    assert torch.equal(cpu._unstriped(packed), weight)
    wide = torch.randn(rows, k + 9).bfloat16()
    x = wide[:, 4:k + 4]  # rows strided by k + 9
    for b in (None, bias, bias.float()):
        ours = ext.linear_bf16_stripes(x, packed, b, n, k)
        exact = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
        assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
        # one bf16 rounding of fp32 sums (whose own error grows with k)
        torch.testing.assert_close(ours.double(), exact, rtol=2**-8, atol=k * 2e-8)
    # each row's sums run in one order, whatever rows share the call: a row alone gives the same bits
    alone = torch.cat([ext.linear_bf16_stripes(x[i:i + 1], packed, bias, n, k) for i in range(rows)])
    assert torch.equal(alone, ext.linear_bf16_stripes(x, packed, bias, n, k))
    assert torch.equal(ext.linear_bf16_stripes(x.reshape(1, rows, k), packed, bias, n, k)[0], alone)
    # an input one column short or long (which the even width of the packing would hold) is refused
    for width in (k - 1, k + 1):
        with pytest.raises(RuntimeError, match="do not match"):
            ext.linear_bf16_stripes(torch.randn(rows, width).bfloat16(), packed, bias, n, k)


@pytest.mark.parametrize("rows, k, half", [(1, 64, 64), (7, 576, 192), (13, 576, 192), (300, 63, 64), (9, 4100, 128)])
def test_gated_bf16_stripes_linear_is_silu_and_mul_of_the_matmul_bit_for_bit(rows, k, half, cpu_level):
    """The MLP's [gate | up] matmul with silu(gate) * up in its store (csrc/linear_bf16_avx512.cpp, gated): the same
    bits as silu_and_mul of the plain matmul, through tile tails, an odd K, rows split in two (13 rows on 3 stripes,
    with two threads), row blocks (300: two of 150) and K blocks (4100), with and without a bias;
    cpu.linear_silu_and_mul takes it for bf16 stripes and silu_and_mul(linear(..)) for everything else, halves not
    whole stripes too."""
    torch.manual_seed(rows * k + half)
    weight, bias = torch.randn(2 * half, k).bfloat16() / k**0.5, torch.randn(2 * half).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    packed = cpu.pack_linear_weight(weight)
    for b in (None, bias):
        plain = cpu.silu_and_mul(cpu.linear(x, packed, b))
        assert torch.equal(cpu.linear_silu_and_mul(x, packed, b), plain)
        assert torch.equal(cpu.linear_silu_and_mul(x.float(), weight.float(), None if b is None else b.float()),
                           cpu.silu_and_mul(cpu.linear(x.float(), weight.float(), None if b is None else b.float())))
    ragged = torch.randn(2 * half - 2, k).bfloat16()  # halves of half - 1 columns: plain matmul, then activation
    assert torch.equal(cpu.linear_silu_and_mul(x, cpu.pack_linear_weight(ragged)),
                       cpu.silu_and_mul(cpu.linear(x, cpu.pack_linear_weight(ragged))))
    ext = cpu.compiled()
    if not ext.has_linear_bf16_stripes():
        assert cpu_features().build != "avx512_bf16"
        return
    assert hasattr(packed, "unpacked_shape") or cpu_features().level != "avx512_bf16"
    striped = cpu._in_linear_stripes(weight)
    gated = ext.linear_bf16_stripes(x, striped, bias, half, k, gated=True)
    assert gated.shape == (rows, half)
    assert torch.equal(gated, cpu.silu_and_mul(ext.linear_bf16_stripes(x, striped, bias, 2 * half, k)))
    # a row alone gives the same bits; halves that are not whole stripes are refused
    assert torch.equal(torch.cat([ext.linear_bf16_stripes(x[i:i + 1], striped, bias, half, k, gated=True)
                                  for i in range(rows)]), gated)
    with pytest.raises(RuntimeError, match="whole stripes"):
        ext.linear_bf16_stripes(x, cpu._in_linear_stripes(ragged), None, half - 1, k, gated=True)


@pytest.mark.parametrize("rows, k, n", [(1, 64, 96), (2, 70, 7), (3, 576, 963), (4, 8, 1), (5, 64, 9), (8, 70, 96),
                                        (11, 576, 7)])
def test_avx2_linear_on_bf16_weights_is_fp32_math_rounded_once(rows, k, n, cpu_level):
    """csrc/linear_bf16_avx2.cpp, the few-rows matmul of CPUs without oneDNN bf16: K not a multiple of 8 and N not
    of the tile height too, a 3-d input, a bias; more than 4 rows (a speculative verification's) 4 at a time and
    the rest."""
    ext = cpu.compiled()
    if not ext.has_linear_bf16_weights():
        assert cpu_level not in ("avx2", "avx512", "avx512_bf16", "amx")  # every build from avx2 up has it
        return
    torch.manual_seed(rows * k)
    x, weight, bias = torch.randn(1, rows, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    ours = ext.linear_bf16_weights(x, weight, bias)
    assert ours.shape == (1, rows, n) and ours.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(ours.double(), exact, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(ext.linear_bf16_weights(x[0], weight).double(), exact[0] - bias.double(),
                               rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fused_elementwise_ops_match_torch_ref(dtype, cpu_level):
    """csrc/fused_ops_cpu.cpp against torch_ref: fp32 to rounding, bf16 to a bf16 rounding or two (the fused
    ops round once where torch_ref rounds after each op)."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
    torch.manual_seed(0)
    x, residual, weight = torch.randn(37, 96, dtype=dtype), torch.randn(37, 96, dtype=dtype), torch.randn(96, dtype=dtype)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-5), torch_ref.rms_norm(x, weight, 1e-5), **tol)
    for ours, ref in zip(cpu.add_rms_norm(x, residual, weight, 1e-6), torch_ref.add_rms_norm(x, residual, weight, 1e-6)):
        torch.testing.assert_close(ours, ref, **tol)

    # q and k as the model has them: views into one fused QKV row per token
    qkv = torch.randn(11, (4 + 2 + 2) * 32, dtype=dtype)
    q, k, _ = qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)
    q, k = q.view(11, 4, 32), k.view(11, 2, 32)
    cache = torch.randn(300, 32).to(dtype)
    positions = torch.tensor([0, 1, 2, 299, 5, 6, 7, 100, 9, 10, 11])
    for ours, ref in zip(cpu.rotary_embedding(positions, q, k, cache), torch_ref.rotary_embedding(positions, q, k, cache)):
        torch.testing.assert_close(ours, ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_silu_and_mul_matches_torch_ref(dtype, cpu_level):
    """csrc/silu_and_mul_cpu.cpp: fp32 is torch_ref's own two ops; bf16 is fused, within a bf16 rounding or two
    (silu's rounding may land one ulp from torch's, and the product's rounding adds one)."""
    torch.manual_seed(0)
    # a width that leaves a partial vector at the end of each half, and gates far into both tails of silu
    x = torch.cat([torch.randn(9, 2 * 100) * 4, torch.full((1, 200), 100.0), torch.full((1, 200), -100.0)]).to(dtype)
    ours, ref = cpu.silu_and_mul(x), torch_ref.silu_and_mul(x)
    assert ours.shape == (11, 100) and ours.dtype == dtype
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2**-6, atol=1e-6)
    torch.testing.assert_close(ours, ref, **tol)



@pytest.mark.parametrize("positions", [[0, 300], [-1, 5]])
def test_cpu_rotary_refuses_positions_outside_its_table(cpu_level, positions):
    q, k = torch.randn(2, 4, 32), torch.randn(2, 2, 32)
    with pytest.raises(RuntimeError, match="outside cos_sin_cache"):
        cpu.rotary_embedding(torch.tensor(positions), q, k, torch.randn(300, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_lora_add_matches_torch_ref(dtype, cpu_level):
    """csrc/lora_cpu.cpp against torch_ref.lora_add (in fp32: the kernel's math), segments of 1 to 9 rows (whole and
    partial blocks of four), adapters of different widths, rows no segment names left alone; widths and lengths that
    leave partial vectors."""
    torch.manual_seed(0)
    k, n, rows = 100, 75, 30
    x, y = torch.randn(rows, k).to(dtype), torch.randn(rows, n).to(dtype)
    adapters = [(torch.randn(w, k) / 10, torch.randn(n, w) / 10) for w in (3, 16, 48)]
    bounds = [(0, 1, 0), (1, 10, 2), (12, 19, 1), (19, 23, 0), (23, 30, 2)]  # rows 10-11: the base model's
    ours, reference = y.clone(), y.float()
    cpu.lora_add(ours, x, [(s, e, *cpu.pack_lora_weights(*adapters[a])) for s, e, a in bounds])
    torch_ref.lora_add(reference, x.float(), [(s, e, *torch_ref.pack_lora_weights(*adapters[a])) for s, e, a in bounds])
    assert torch.equal(ours[10:12], y[10:12])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
    torch.testing.assert_close(ours, reference.to(dtype), **tol)
    if cpu.compiled() is not None:  # (the extension's own checks: a bad call is an error, not a crash)
        with pytest.raises(RuntimeError, match="segment rows out of range"):
            cpu.lora_add(ours, x, [(20, 31, *cpu.pack_lora_weights(*adapters[0]))])
