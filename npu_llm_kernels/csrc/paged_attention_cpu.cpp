// Paged decode attention for the CPU: one query token per sequence, K/V read in place from
// the block-table cache ([num_blocks, block_size, num_kv_heads, head_dim]), no gather copy.
// One task per sequence computes all its query heads: each K/V row is read from memory once, each
// block front to back, the next blocks prefetched. Semantics: npu_llm_kernels/torch_ref.py::decode_attention.
// On AVX-512 CPUs decode_attention_avx512.cpp takes fp32 and bf16 at head dims 64 and 128; this kernel
// everything else: with AVX2 and FMA, fp32 and bf16 at head dims that are multiples of 8 other than 64 and 128
// (DeepSeek's 576-wide latent rows) through attend_sequence_avx2 below, the rest portably. (At 64 and 128 the
// portable loop, its head dim known at compile time, measured faster: SmolLM2's heads, 1.2-1.5x.)
#include "ops.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <type_traits>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const double* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float load(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }

// Blocks ahead of the one being read whose rows are prefetched. A sequence's blocks lie anywhere in
// the cache, so the hardware prefetchers cannot guess them: without this a decode step waits on
// memory latency (measured 2.2x slower on a cache far larger than L3; 2 or 4 blocks ahead did no better).
constexpr int64_t PREFETCH_BLOCKS = 1;

// Walks one sequence's tokens through its block table: for token t and KV head h, that head's row
// of `cache` is converted into `row` and fn(t, h) runs. A token's heads sit side by side, so each
// block is read front to back.
template <int HD, typename T, typename Fn>
inline void for_each_row(const T* cache, const int32_t* table, int64_t ctx, int64_t block_size, int64_t num_kv_heads,
                         int64_t runtime_dim, float* row, Fn&& fn) {
  const int64_t head_dim = HD ? HD : runtime_dim;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  const int64_t num_blocks = (ctx + block_size - 1) / block_size;
  const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0, t = 0; t < ctx; ++b) {
    const T* r = cache + static_cast<int64_t>(table[b]) * block_stride;
    const char* ahead = b + PREFETCH_BLOCKS < num_blocks
                            ? reinterpret_cast<const char*>(cache + static_cast<int64_t>(table[b + PREFETCH_BLOCKS]) *
                                                                        block_stride)
                            : nullptr;
    const int64_t n = std::min(block_size, ctx - t);
    for (int64_t o = 0; o < n; ++o, ++t, r += token_stride) {
      if (ahead != nullptr)
        for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(ahead + o * row_bytes + line);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const T* head_row = r + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) row[d] = load(head_row, d);
        fn(t, h);
      }
    }
  }
}

// The widest row a head may have: DeepSeek's latent rows (kv_lora_rank 512 + rope 64) are 576.
constexpr int64_t kMaxHeadDim = 1024;

// One sequence, all its heads. HD is the head dim when known at compile time (0: runtime), which
// lets the compiler keep a whole K/V row in vector registers. q and acc are [num_heads, head_dim],
// scores [num_heads, ctx]; query heads h * group ... (h + 1) * group - 1 attend with KV head h.
template <typename T, int HD>
void attend_sequence(const float* q, const T* key_cache, const T* value_cache, const int32_t* table, int64_t ctx,
                     int64_t num_kv_heads, int64_t group, int64_t runtime_dim, int64_t block_size, float* scores,
                     float* acc) {
  const int64_t head_dim = HD ? HD : runtime_dim;
  const int64_t num_heads = num_kv_heads * group;
  float row[HD ? HD : kMaxHeadDim];

  for_each_row<HD>(key_cache, table, ctx, block_size, num_kv_heads, head_dim, row, [&](int64_t t, int64_t h) {
    for (int64_t g = h * group; g < (h + 1) * group; ++g) {
      const float* qg = q + g * head_dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * row[d];
      scores[g * ctx + t] = s;
    }
  });
  for (int64_t g = 0; g < num_heads; ++g) softmax_in_place(scores + g * ctx, ctx);
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for_each_row<HD>(value_cache, table, ctx, block_size, num_kv_heads, head_dim, row, [&](int64_t t, int64_t h) {
    for (int64_t g = h * group; g < (h + 1) * group; ++g) {
      const float w = scores[g * ctx + t];
      float* a = acc + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += w * row[d];
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The query heads of one KV head go through its rows together, up to kHeadsAtOnce at a time: each row's 8 values are
// loaded once for all of them, and each head has its own accumulator, so the heads' multiply-adds are independent
// chains. (The portable loop computes one head's dot product at a time, a chain of dependent adds: on DeepSeek's
// latent rows, 8 heads of 576, that made decode attention a quarter of W4's time on a Zen 3.)
constexpr int64_t kHeadsAtOnce = 8;

// scores[g * stride] = q_g . row for G heads, q [G, head_dim]
template <int G, typename T>
inline void score_heads(const float* q, const T* row, int64_t head_dim, float* scores, int64_t stride) {
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 r = load8(row + d);
    for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + d), r, acc[g]);
  }
  for (int g = 0; g < G; ++g) scores[g * stride] = hsum(acc[g]);
}

// acc_g += sum over n tokens of weights[g * stride + t] * row_t for G heads, acc [G, head_dim]: 8 columns of every
// head's sum stay in registers while the block's rows go by, so each is loaded and stored once per block.
template <int G, typename T>
inline void accumulate_heads(const float* weights, int64_t stride, const T* rows, int64_t row_stride, int64_t n,
                             int64_t head_dim, float* acc) {
  for (int64_t d = 0; d < head_dim; d += 8) {
    __m256 a[G];
    for (int g = 0; g < G; ++g) a[g] = _mm256_loadu_ps(acc + g * head_dim + d);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 r = load8(rows + t * row_stride + d);
      for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_set1_ps(weights[g * stride + t]), r, a[g]);
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc + g * head_dim + d, a[g]);
  }
}

// f.template operator()<G>() for G = heads (1 <= heads <= kHeadsAtOnce)
template <int G = kHeadsAtOnce, typename F>
inline void with_heads(int64_t heads, F&& f) {
  if constexpr (G > 1) {
    if (heads < G) return with_heads<G - 1>(heads, f);
  }
  f.template operator()<G>();
}

// attend_sequence's contract, head_dim a multiple of 8, one cache block at a time.
template <typename T>
void attend_sequence_avx2(const float* q, const T* key_cache, const T* value_cache, const int32_t* table, int64_t ctx,
                          int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size, float* scores,
                          float* acc) {
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const int64_t num_blocks = (ctx + block_size - 1) / block_size, num_heads = num_kv_heads * group;
  const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t t0 = b * block_size, n = std::min(block_size, ctx - t0);
    const T* block = key_cache + static_cast<int64_t>(table[b]) * block_stride;
    const char* ahead = b + PREFETCH_BLOCKS < num_blocks
                            ? reinterpret_cast<const char*>(key_cache + static_cast<int64_t>(table[b + PREFETCH_BLOCKS]) *
                                                                            block_stride)
                            : nullptr;
    for (int64_t o = 0; o < n; ++o) {
      if (ahead != nullptr)
        for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(ahead + o * row_bytes + line);
      for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t g0 = h * group; g0 < (h + 1) * group; g0 += kHeadsAtOnce)
          with_heads(std::min(kHeadsAtOnce, (h + 1) * group - g0), [&]<int G>() {
            score_heads<G>(q + g0 * head_dim, block + o * token_stride + h * head_dim, head_dim,
                           scores + g0 * ctx + t0 + o, ctx);
          });
    }
  }
  for (int64_t g = 0; g < num_heads; ++g) softmax_in_place(scores + g * ctx, ctx);
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t t0 = b * block_size, n = std::min(block_size, ctx - t0);
    const T* block = value_cache + static_cast<int64_t>(table[b]) * block_stride;
    if (b + 1 < num_blocks) {
      const char* next = reinterpret_cast<const char*>(value_cache + static_cast<int64_t>(table[b + 1]) * block_stride);
      for (int64_t line = 0; line < block_size * row_bytes; line += 64) __builtin_prefetch(next + line);
    }
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t g0 = h * group; g0 < (h + 1) * group; g0 += kHeadsAtOnce)
        with_heads(std::min(kHeadsAtOnce, (h + 1) * group - g0), [&]<int G>() {
          accumulate_heads<G>(scores + g0 * ctx + t0, ctx, block + h * head_dim, token_stride, n, head_dim,
                              acc + g0 * head_dim);
        });
  }
}

template <typename T>
constexpr bool kAvx2Rows = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
#else
template <typename T>
constexpr bool kAvx2Rows = false;
#endif

template <typename T>
void decode_attention(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
                      const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(num_heads * head_dim), acc(num_heads * head_dim), scores;
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t ctx = context_lens[seq];
      const T* q_in = query + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = load(q_in, i) * scale;
      scores.resize(num_heads * ctx);
      const int32_t* table = block_tables + seq * max_blocks;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (kAvx2Rows<T>) {
        if (head_dim % 8 == 0 && head_dim != 64 && head_dim != 128) {  // (64 and 128: the templates below, faster there)
          attend_sequence_avx2<T>(q.data(), key_cache, value_cache, table, ctx, num_kv_heads, group, head_dim,
                                  block_size, scores.data(), acc.data());
          T* o = out + seq * num_heads * head_dim;
          for (int64_t i = 0; i < num_heads * head_dim; ++i) o[i] = static_cast<T>(acc[i]);
          continue;
        }
      }
#endif
      if (head_dim == 64)
        attend_sequence<T, 64>(q.data(), key_cache, value_cache, table, ctx, num_kv_heads, group, head_dim, block_size,
                               scores.data(), acc.data());
      else if (head_dim == 128)
        attend_sequence<T, 128>(q.data(), key_cache, value_cache, table, ctx, num_kv_heads, group, head_dim,
                                block_size, scores.data(), acc.data());
      else
        attend_sequence<T, 0>(q.data(), key_cache, value_cache, table, ctx, num_kv_heads, group, head_dim, block_size,
                              scores.data(), acc.data());
      T* o = out + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, H, D] and cache [N, BS, Hkv, D] expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  auto q = query.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = at::empty_like(q);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && key_cache.size(3) == head_dim, "head shapes do not match");
  TORCH_CHECK(head_dim <= kMaxHeadDim, "head_dim above ", kMaxHeadDim, " is not supported");
  if (paged_decode_attention_avx512(q, key_cache, value_cache, tables, lens, out, static_cast<float>(scale))) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                               tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_seqs,
                               num_heads, num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(scale));
  });
  return out;
}
