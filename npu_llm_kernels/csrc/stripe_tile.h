// The register tile of the bf16 matmuls whose weights lie in stripes of 64 output columns with k in pairs
// ([k / 2, 64, 2] a stripe: the layout AVX512-BF16's vdpbf16ps multiplies, 16 columns times two k of one row summed
// in fp32): a model's linear layers (csrc/linear_bf16_avx512.cpp) and an MoE layer's experts with few tokens
// (csrc/fused_moe_cpu.cpp). Up to 6 rows x 64 columns of fp32 sums in registers, each weight vector loaded once per
// tile and each row's pair of values broadcast; the callers round the sums (and add biases) as their outputs need.
#pragma once

#include "vec_math.h"

#if defined(__AVX512BF16__)
namespace stripe_tile {

constexpr int64_t kStripe = 64;  // output columns per stripe: 4 vectors of 16
constexpr int kVectors = 4;
constexpr int kRows = 6;  // rows per register tile: 6 x 4 accumulators beside 4 weight vectors

// Software prefetch of the weights a task reads next, spread over the tiles of the current block: `lines` cache
// lines from `base`, `per_step` of them at each k pair (the hardware prefetchers follow a stripe once it is being
// read, but not the jump to the next one).
struct Prefetch {
  const char* base = nullptr;
  int64_t lines = 0, next = 0, per_step = 0;
  void step() {
    for (int64_t i = 0; i < per_step && next < lines; ++i, ++next) _mm_prefetch(base + 64 * next, _MM_HINT_T0);
  }
};

// sums[r][0 .. 64) (+)= x[r][0 .. k) . w for R rows of x (row stride lda) and one stripe's block of k values w
// ([k / 2, 64, 2], k rounded up to even, the pad zero); a fresh sum where `first`, else added to what sums holds.
template <int R>
inline void tile(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t k, bool first, float* sums, Prefetch& pf) {
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * kStripe + 16 * v);
  const auto multiply = [&](const uint16_t* pair_row, auto x_pair) {
    __m512bh wv[kVectors];
    for (int v = 0; v < kVectors; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(pair_row + 32 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(x_pair(x + r * lda));
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xr, wv[v]);
    }
  };
  const int64_t whole = k & ~int64_t{1};
  for (int64_t c = 0; c < whole; c += 2) {
    pf.step();
    multiply(w + c * kStripe, [c](const uint16_t* row) { return bf16_pair(row + c); });
  }
  if (k % 2)  // an odd k's last value, paired with the zero the packing put beside it in w
    multiply(w + whole * kStripe, [whole](const uint16_t* row) { return static_cast<int32_t>(row[whole]); });
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(sums + r * kStripe + 16 * v, acc[r][v]);
}

// tile for `rows` (1 ... kRows) rows.
template <int R = kRows>
inline void tile_of(int64_t rows, const uint16_t* x, int64_t lda, const uint16_t* w, int64_t k, bool first,
                    float* sums, Prefetch& pf) {
  if constexpr (R > 1)
    if (rows < R) return tile_of<R - 1>(rows, x, lda, w, k, first, sums, pf);
  tile<R>(x, lda, w, k, first, sums, pf);
}

}  // namespace stripe_tile
#endif
