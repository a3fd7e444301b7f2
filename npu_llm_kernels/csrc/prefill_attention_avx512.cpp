// Causal prefill attention of one sequence in bf16, on CPUs with AVX512-BF16 (npu_llm_kernels/torch_ref.py
// prefill_attention has the semantics: the q_len queries are the last q_len of the ctx tokens in k/v).
//
// torch's CPU flash attention runs a library GEMM per (head, block of queries, block of keys): on head dims of 64
// and a few hundred tokens the calls are too small to pay for themselves, and it reached 50-140 GFLOP/s on an
// AVX512-BF16 Zen 5, a quarter of a W1 run's time. Here each KV head's keys and values are laid out once in pairs
// ("VNNI": the two values vdpbf16ps multiplies and adds together side by side), and then each block of ROWS
// queries of one query head, a task of its own:
//   1. scores, in register tiles of ROWS queries x KEYS keys: a query's pair of dims goes out as one 32-bit
//      broadcast against 16 keys' pairs, all in fp32 accumulators, up to the block's last visible key;
//   2. softmax of each row over its visible keys (a causal row sees the keys up to its own position), in fp32: the
//      exponentials rounded to bf16, as torch's kernel multiplies V by them, their sum kept in fp32;
//   3. the output, in register tiles of PV_ROWS queries x 64 columns: a row's pair of exponentials broadcast
//      against the values of two keys, divided by the row's sum and rounded to bf16 once.
// The scores of a block are held whole (ROWS x ctx fp32) rather than merged block by block as flash attention
// does: a second pass over a row that lies in L1/L2 costs less than rescaling the output at every block.
#include "ops.h"
#include "vec_math.h"

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t KEYS = 32;    // keys per score tile: two vectors of scores
constexpr int64_t ROWS = 12;    // queries per task and per score tile (12 x 2 accumulators)
constexpr int64_t PV_ROWS = 6;  // queries per output tile (6 x 4 accumulators)
constexpr int64_t COLUMNS = 64; // output columns per output tile

// One KV head's keys [ctx, D] (rows `stride` apart) as [ctx / KEYS tiles][D / 2][KEYS][2], into a zeroed `out`.
void pack_keys(const uint16_t* k, int64_t stride, int64_t ctx, int64_t dim, int32_t* out) {
  const int64_t pairs = dim / 2;
  for (int64_t t = 0; t < ctx; ++t) {
    int32_t* tile = out + (t / KEYS) * pairs * KEYS + t % KEYS;
    for (int64_t p = 0; p < pairs; ++p) tile[p * KEYS] = bf16_pair(k + t * stride + 2 * p);
  }
}

// One KV head's values [ctx, Dv] as [ctx / 2][Dv][2] (key 2i's value and key 2i + 1's side by side), into a zeroed
// `out` (the padding keys' values must be numbers: their probabilities are 0).
void pack_values(const uint16_t* v, int64_t stride, int64_t ctx, int64_t dim, uint16_t* out) {
  for (int64_t t = 0; t < ctx; ++t)
    for (int64_t c = 0; c < dim; ++c) out[((t / 2) * dim + c) * 2 + t % 2] = v[t * stride + c];
}

// scores[r][0 .. tiles * KEYS) = scale * q_r . k for the ROWS queries q[r] (D / 2 pairs each).
void score_tile(const uint16_t* const* q, const int32_t* keys, int64_t pairs, int64_t tiles, float scale,
                float* scores, int64_t scores_stride) {
  for (int64_t t = 0; t < tiles; ++t) {
    __m512 acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int32_t* tile = keys + t * pairs * KEYS;
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(tile + p * KEYS);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(tile + p * KEYS + 16);
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh qr = (__m512bh)_mm512_set1_epi32(bf16_pair(q[r] + 2 * p));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qr, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qr, k1);
      }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < ROWS; ++r) {
      _mm512_storeu_ps(scores + r * scores_stride + t * KEYS, _mm512_mul_ps(acc[r][0], s));
      _mm512_storeu_ps(scores + r * scores_stride + t * KEYS + 16, _mm512_mul_ps(acc[r][1], s));
    }
  }
}

// probs[0 .. padded) = exp(scores[0 .. n) - their max) in bf16, zero from n on (padded: a multiple of 16 >= n); returns
// 1 / their sum, by which the output is scaled in fp32 (as torch's kernel does: normalized probabilities would round
// a second time).
float softmax_row(const float* scores, int64_t n, int64_t padded, uint16_t* probs) {
  __m512 max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16)
    max = _mm512_mask_max_ps(max, first_lanes(n - j), max, _mm512_loadu_ps(scores + j));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(max));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += 16) {
    const __mmask16 visible = j < n ? first_lanes(n - j) : 0;
    const __m512 e = _mm512_maskz_mov_ps(visible, exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), top)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + j), fp32_to_bf16(e));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// out[r][c0 .. c0 + 16 NV) = inv[r] * probs[r] . values for PV_ROWS rows, over `pairs` pairs of keys, rounded to
// bf16.
template <int NV>
void output_tile(const uint16_t* const* probs, const float* inv, const uint16_t* values, int64_t dim, int64_t c0,
                 int64_t pairs, uint16_t* const* out) {
  __m512 acc[PV_ROWS][NV];
  for (int r = 0; r < PV_ROWS; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(values + (p * dim + c0 + 16 * v) * 2);
    for (int r = 0; r < PV_ROWS; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(bf16_pair(probs[r] + 2 * p));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pr, vv[v]);
    }
  }
  for (int r = 0; r < PV_ROWS; ++r) {
    const __m512 scale = _mm512_set1_ps(inv[r]);
    for (int v = 0; v < NV; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + c0 + 16 * v),
                          fp32_to_bf16(_mm512_mul_ps(acc[r][v], scale)));
  }
}

void prefill_attention_avx512(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                              float scale) {
  const int64_t q_len = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t ctx = k.size(0), kv_heads = k.size(1), v_dim = v.size(2);
  const int64_t group = heads / kv_heads, offset = ctx - q_len;
  const int64_t pairs = dim / 2, tiles = (ctx + KEYS - 1) / KEYS, padded = tiles * KEYS;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());

  std::vector<int32_t> keys(kv_heads * tiles * pairs * KEYS);
  std::vector<uint16_t> values(kv_heads * padded * v_dim);
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      pack_keys(kp + h * k.stride(1), k.stride(0), ctx, dim, keys.data() + h * tiles * pairs * KEYS);
      pack_values(vp + h * v.stride(1), v.stride(0), ctx, v_dim, values.data() + h * padded * v_dim);
    }
  });

  const int64_t blocks = (q_len + ROWS - 1) / ROWS;
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(ROWS * padded);
    std::vector<uint16_t> probs(ROWS * padded);
    std::vector<uint16_t> spare(v_dim);  // where the rows of a tile past q_len write (their results are dropped)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, r0 = (task % blocks) * ROWS, rows = std::min(ROWS, q_len - r0);
      const int64_t kv = h / group, visible = offset + r0 + rows;  // keys the block's last row sees
      const int64_t block_tiles = (visible + KEYS - 1) / KEYS, key_pairs = block_tiles * KEYS / 2;
      const uint16_t* query[ROWS];
      for (int64_t r = 0; r < ROWS; ++r) query[r] = qp + std::min(r0 + r, q_len - 1) * q.stride(0) + h * q.stride(1);
      score_tile(query, keys.data() + kv * tiles * pairs * KEYS, pairs, block_tiles, scale, scores.data(), padded);
      float inv[ROWS];
      for (int64_t r = 0; r < rows; ++r)
        inv[r] = softmax_row(scores.data() + r * padded, offset + r0 + r + 1, block_tiles * KEYS,
                             probs.data() + r * padded);
      const uint16_t* head_values = values.data() + kv * padded * v_dim;
      for (int64_t r = 0; r < rows; r += PV_ROWS) {
        const uint16_t* prob_rows[PV_ROWS];
        uint16_t* out_rows[PV_ROWS];
        float row_inv[PV_ROWS];
        for (int64_t i = 0; i < PV_ROWS; ++i) {
          const bool real = r + i < rows;
          prob_rows[i] = probs.data() + (real ? r + i : r) * padded;
          row_inv[i] = inv[real ? r + i : r];
          out_rows[i] = real ? op + ((r0 + r + i) * heads + h) * v_dim : spare.data();
        }
        int64_t c = 0;
        for (; c + COLUMNS <= v_dim; c += COLUMNS)
          output_tile<4>(prob_rows, row_inv, head_values, v_dim, c, key_pairs, out_rows);
        for (; c < v_dim; c += 16) output_tile<1>(prob_rows, row_inv, head_values, v_dim, c, key_pairs, out_rows);
      }
    }
  });
}

}  // namespace
#endif

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(has_prefill_attention(), "prefill_attention needs an AVX512-BF16 build");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prefill_attention takes bf16 q, k and v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q, k, v are [tokens, heads, dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prefill_attention: rows must be contiguous");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(2) % 2 == 0 && v.size(2) % 16 == 0,
              "prefill_attention: q and k share an even head dim, v's is a multiple of 16");
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1) && q.size(1) % k.size(1) == 0 &&
                  k.size(0) >= q.size(0),
              "prefill_attention: k and v [ctx >= q_len, kv_heads dividing q's heads, ..]");
  at::Tensor out = at::empty({q.size(0), q.size(1), v.size(2)}, q.options());
#if defined(__AVX512BF16__)
  if (q.size(0) > 0) prefill_attention_avx512(q, k, v, out, static_cast<float>(scale));
#endif
  return out;
}

bool has_prefill_attention() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}
