// Paged decode attention with AVX-512, for head dims 64 and 128 in fp32 and bf16 (the portable kernel in
// paged_attention_cpu.cpp takes everything else, with the same semantics and cache layout).
//
// One task per (sequence, KV head): its `group` query heads share every K/V row it reads, and a batch
// of a few long sequences still keeps both cores busy. Scores come 16 tokens at a time, as 16 vector dot
// products whose horizontal sums one transpose-and-add tree produces (about three instructions per token
// instead of a full reduction each); bf16 keys are multiplied as they lie in the cache where the CPU has
// AVX512-BF16. The output accumulates in registers, each V row converted to fp32 once for all the query
// heads of its group. Each row's place in the cache is looked up once per sequence (row_offsets), and rows are
// prefetched ahead (PrefetchedRows): a sequence's blocks lie anywhere in the cache, so the hardware prefetchers cannot
// guess them. Measured against the portable kernel: 1.3x faster on a cache far larger than L3, 1.5x on one that
// fits; prefetching whole rows rather than their first cache line made 1.4x of that, and the offsets looked up
// once rather than walked row by row through the block table 1.05-1.1x more (W1's and W2's batches, Zen 5).
// (V rows in token pairs through vdpbf16ps, probabilities rounded to bf16, measured no faster: not kept.)
#include "ops.h"
#include "vec_math.h"

#if defined(__AVX512F__)
namespace {

constexpr int TILE = 16;  // tokens per score tile: one vector of scores

// One row of D elements as D / 16 fp32 vectors.
template <int D>
inline void load_row(const float* p, __m512* out) {
  for (int c = 0; c < D / 16; ++c) out[c] = _mm512_loadu_ps(p + 16 * c);
}
template <int D>
inline void load_row(const at::BFloat16* p, __m512* out) {
  const auto* bits = reinterpret_cast<const __m256i*>(p);
  for (int c = 0; c < D / 16; ++c) out[c] = bf16_to_fp32(_mm256_loadu_si256(bits + c));
}

// r[i] = sum of the lanes of v[i]: pairs of vectors add their interleaved halves, then quarters, then
// 128-bit lanes, so that each level halves the number of vectors.
inline __m512 sum_lanes_of_16(__m512 v[TILE]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // each 128-bit lane of quads[i] now holds partial sums of v[4i .. 4i+3]; add the four lanes
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Where each token's row of a sequence lies in a cache [num_blocks, block_size, num_kv_heads, D], counted from
// its KV head's first element: found once per sequence through its block table, for K and V and every KV head.
// (Walking the table row by row, a branch and a pointer update per row in both passes, cost more than the
// arithmetic those rows fed.)
void row_offsets(const int32_t* table, int64_t block_size, int64_t token_stride, int64_t ctx,
                 std::vector<int64_t>& offsets) {
  offsets.resize(ctx);
  for (int64_t b = 0, t = 0; t < ctx; ++b) {
    const int64_t first = static_cast<int64_t>(table[b]) * block_size * token_stride;
    for (int64_t i = 0; i < block_size && t < ctx; ++i, ++t) offsets[t] = first + i * token_stride;
  }
}

// The rows of one KV head in token order, each prefetched twice before it is read: into L2 FAR_AHEAD tokens before,
// into L1 NEAR_AHEAD tokens before. A sequence's blocks lie anywhere in the cache, so the hardware prefetchers cannot
// guess them. With prefetches into L1 alone (two tiles ahead) one core read the cache at about 14 GB/s, two at 27,
// against 43-63 for a streaming read (our reading: each such prefetch holds one of the core's few L1 misses in flight
// until its line comes); adding the far ones into L2 made the kernel 1.06-1.09x faster in bf16, level in fp32 (Zen 5,
// docs/performance.md).
constexpr int64_t NEAR_AHEAD = TILE, FAR_AHEAD = 4 * TILE;

template <int D, typename T>
class PrefetchedRows {
 public:
  PrefetchedRows(const T* head, const std::vector<int64_t>& offsets)
      : head_(head), offsets_(offsets.data()), ctx_(static_cast<int64_t>(offsets.size())) {
    // rows 0 ... AHEAD here, and next() goes on from AHEAD + 1
    for (int64_t t = 0; t <= std::min(FAR_AHEAD, ctx_ - 1); ++t) prefetch<IN_L2>(t);
    for (int64_t t = 0; t <= std::min(NEAR_AHEAD, ctx_ - 1); ++t) prefetch<IN_L1>(t);
  }
  const T* get() const { return head_ + offsets_[t_]; }
  void next() {
    ++t_;
    if (t_ + FAR_AHEAD < ctx_) prefetch<IN_L2>(t_ + FAR_AHEAD);
    if (t_ + NEAR_AHEAD < ctx_) prefetch<IN_L1>(t_ + NEAR_AHEAD);
  }

 private:
  // __builtin_prefetch's locality: 3 is prefetcht0 (into L1), 2 prefetcht1 (into L2)
  static constexpr int IN_L1 = 3, IN_L2 = 2;
  template <int LOCALITY>
  void prefetch(int64_t t) const {
    const char* row = reinterpret_cast<const char*>(head_ + offsets_[t]);
    for (int64_t line = 0; line < D * static_cast<int64_t>(sizeof(T)); line += 64)
      __builtin_prefetch(row + line, 0, LOCALITY);
  }
  const T* head_;
  const int64_t* offsets_;
  int64_t ctx_, t_ = 0;
};

// Query heads processed together in the V pass, their accumulators in registers beside one V row:
// 4 x 4 + 4 vectors for D = 64, 2 x 8 + 8 for D = 128 (of the 32 vector registers).
template <int D>
constexpr int heads_at_once() {
  return D == 64 ? 4 : 2;
}

// One tile of key rows, and the dot products of each with a query head: 16 partial sums per row, whose
// total is the row's score. The rows are converted to fp32 once for all the query heads of the group.
template <int D, typename T>
class KeyTile {
 public:
  void load(PrefetchedRows<D, T>& keys, int64_t n) {
    for (int64_t i = 0; i < n; ++i, keys.next()) load_row<D>(keys.get(), rows_[i]);
  }
  void set_query(const T* q) { load_row<D>(q, query_); }
  __m512 dot(int64_t i) const {
    __m512 acc = _mm512_mul_ps(query_[0], rows_[i][0]);
    for (int c = 1; c < D / 16; ++c) acc = _mm512_fmadd_ps(query_[c], rows_[i][c], acc);
    return acc;
  }

 private:
  __m512 rows_[TILE][D / 16], query_[D / 16];
};

#if defined(__AVX512BF16__)
// bf16 keys on a CPU with AVX512-BF16: vdpbf16ps multiplies bf16 pairs straight from the cache and sums
// them in fp32 (half the instructions, and no conversion).
template <int D>
class KeyTile<D, at::BFloat16> {
 public:
  void load(PrefetchedRows<D, at::BFloat16>& keys, int64_t n) {
    for (int64_t i = 0; i < n; ++i, keys.next()) rows_[i] = keys.get();
  }
  void set_query(const at::BFloat16* q) {
    for (int c = 0; c < D / 32; ++c) query_[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  }
  __m512 dot(int64_t i) const {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < D / 32; ++c) acc = _mm512_dpbf16_ps(acc, query_[c], (__m512bh)_mm512_loadu_si512(rows_[i] + 32 * c));
    return acc;
  }

 private:
  const at::BFloat16* rows_[TILE];
  __m512bh query_[D / 32];
};
#endif

// Scores [group, padded] of one KV head: its query heads q [group, D] against K, times scale (the caller takes
// the softmax over the first ctx of each row).
template <int D, typename T>
void scores_of_head(const T* q, float scale, PrefetchedRows<D, T> keys, int64_t ctx, int64_t group, int64_t padded,
                    float* scores) {
  KeyTile<D, T> tile;
  __m512 dots[TILE];
  for (int64_t t0 = 0; t0 < ctx; t0 += TILE) {
    const int64_t n = std::min<int64_t>(TILE, ctx - t0);
    tile.load(keys, n);
    for (int64_t g = 0; g < group; ++g) {
      tile.set_query(q + g * D);
      for (int64_t i = 0; i < TILE; ++i) dots[i] = i < n ? tile.dot(i) : _mm512_setzero_ps();
      _mm512_storeu_ps(scores + g * padded + t0, _mm512_mul_ps(sum_lanes_of_16(dots), _mm512_set1_ps(scale)));
    }
  }
}

// out[g] = sum_t scores[g][t] * V[t] for H query heads starting at `first` (H a constant, so that the
// accumulators stay in registers).
template <int D, int H, typename T>
void weighted_values(const float* scores, PrefetchedRows<D, T> values, int64_t ctx, int64_t padded, int64_t first,
                     float* out) {
  __m512 acc[H][D / 16], v[D / 16];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < D / 16; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t, values.next()) {
    load_row<D>(values.get(), v);
    for (int h = 0; h < H; ++h) {
      const __m512 w = _mm512_set1_ps(scores[(first + h) * padded + t]);
      for (int c = 0; c < D / 16; ++c) acc[h][c] = _mm512_fmadd_ps(w, v[c], acc[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(out + (first + h) * D + 16 * c, acc[h][c]);
}

// weighted_values for `heads` (1 ... H) query heads.
template <int D, typename T, int H = heads_at_once<D>()>
void weighted_values_of(int64_t heads, const float* scores, PrefetchedRows<D, T> values, int64_t ctx, int64_t padded,
                        int64_t first, float* out) {
  if constexpr (H > 1)
    if (heads < H) return weighted_values_of<D, T, H - 1>(heads, scores, values, ctx, padded, first, out);
  weighted_values<D, H>(scores, values, ctx, padded, first, out);
}

template <int D, typename T>
void decode_attention(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
                      const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * D;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(group * D), scores;
    std::vector<int64_t> offsets;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, h = task % num_kv_heads, ctx = context_lens[seq];
      const int64_t padded = (ctx + TILE - 1) / TILE * TILE;
      const T* q = query + (seq * num_heads + h * group) * D;
      scores.resize(group * padded);
      if (task == begin || h == 0)  // (a thread's tasks of one sequence share its offsets)
        row_offsets(block_tables + seq * max_blocks, block_size, token_stride, ctx, offsets);
      scores_of_head<D>(q, scale, PrefetchedRows<D, T>(key_cache + h * D, offsets), ctx, group, padded, scores.data());
      // The first V rows are on their way while the softmax runs, not after it (1.02-1.03x in one
      // process on caches larger than L3, level at 32 sequences and in fp32). Prefetching more at once, the V rows
      // during the K pass or the next head's first K rows during the V pass, measured slower (up to 2x): not kept.
      const PrefetchedRows<D, T> values(value_cache + h * D, offsets);
      for (int64_t g = 0; g < group; ++g) softmax_in_place(scores.data() + g * padded, ctx);
      for (int64_t g = 0; g < group; g += heads_at_once<D>())
        weighted_values_of<D, T>(std::min<int64_t>(heads_at_once<D>(), group - g), scores.data(),
                                 g == 0 ? values : PrefetchedRows<D, T>(value_cache + h * D, offsets), ctx, padded, g,
                                 acc.data());
      T* o = out + (seq * num_heads + h * group) * D;
      for (int64_t i = 0; i < group * D; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

template <typename T>
bool dispatch_head_dim(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, float scale) {
  const int64_t head_dim = q.size(2);
  if (head_dim != 64 && head_dim != 128) return false;
  auto run = head_dim == 64 ? decode_attention<64, T> : decode_attention<128, T>;
  run(q.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(), tables.data_ptr<int32_t>(),
      lens.data_ptr<int32_t>(), out.data_ptr<T>(), q.size(0), q.size(1), key_cache.size(2), key_cache.size(1),
      tables.size(1), scale);
  return true;
}

}  // namespace

bool paged_decode_attention_avx512(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, float scale) {
  switch (q.scalar_type()) {
    case at::kFloat:
      return dispatch_head_dim<float>(q, key_cache, value_cache, tables, lens, out, scale);
    case at::kBFloat16:
      return dispatch_head_dim<at::BFloat16>(q, key_cache, value_cache, tables, lens, out, scale);
    default:
      return false;
  }
}

#else  // a CPU without AVX-512: the portable kernel runs

bool paged_decode_attention_avx512(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, at::Tensor&, float) {
  return false;
}

#endif
