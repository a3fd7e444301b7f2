// Math the kernels' loops need in a form the compiler vectorizes (libm's expf is a call per element), and on
// AVX-512 CPUs the same exp and the bf16 <-> fp32 conversions 16 lanes at a time, for hand-vectorized loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// exp(x), relative error ~2e-7: 2^(x log2 e) split into an integer power (exponent bits) and a degree-6
// polynomial for the fraction (Cephes' coefficients). Below -87 it returns exp(-87) ~ 1.6e-38, not 0;
// above 88 it returns exp(88).
inline float fast_exp(float x) {
  const float t = std::min(std::max(x, -87.f), 88.f) * 1.44269504088896341f;
  const float whole = std::floor(t);
  const float f = t - whole;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// fp32 -> bf16 bits, rounded to nearest even, NaN kept a (quiet) NaN: c10::BFloat16's rounding in integer operations
// the compiler vectorizes (the c10 conversion, called per value, does not).
inline uint16_t bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

// An fp32 result stored in an output of either dtype the kernels write: fp32 as it is, bf16 as its bits (bf16_bits).
inline void store_as(float v, float* y) { *y = v; }
inline void store_as(float v, uint16_t* y) { *y = bf16_bits(v); }

// f(row) with `row` the output `dst` from element `offset` on, typed as its dtype says (bf16 as uint16_t bits): one
// body, written once with `auto*`, serves both.
template <typename F>
inline void with_output(bool bf16, void* dst, int64_t offset, F&& f) {
  if (bf16) {
    f(static_cast<uint16_t*>(dst) + offset);
  } else {
    f(static_cast<float*>(dst) + offset);
  }
}

// s[0 .. n) <- softmax(s[0 .. n)), in fp32.
inline void softmax_in_place(float* s, int64_t n) {
  float max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max)
  for (int64_t t = 0; t < n; ++t) max = std::max(max, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = fast_exp(s[t] - max);
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

#if defined(__AVX2__)
#include <immintrin.h>

// The sum of a vector's 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 bf16 values (their raw bits) as fp32: bf16 is fp32's upper half.
inline __m256 load_bf16x8(const void* p) {
  const __m128i bits = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

// The first min(n, 16) of 16 lanes, for a loop's tail (n > 0).
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// Two bf16 values side by side as one 32-bit lane: what AVX512-BF16's dot product takes from each operand.
inline int32_t bf16_pair(const void* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return pair;
}

// fast_exp, 16 at a time.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// bf16 is fp32's upper half.
inline __m512 bf16_to_fp32(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }

// fp32 to bf16, rounding to nearest even as torch does (NaN stays NaN).
inline __m256i fp32_to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
#endif
}

// The gated MLP's activation on 16 bf16 gate and up values (in fp32): silu(gate) rounded to bf16, times up, rounded
// to bf16, as torch_ref.silu_and_mul's two ops round; one definition for csrc/silu_and_mul_cpu.cpp and the matmul that
// fuses it (csrc/linear_bf16_avx512.cpp), so the two agree bit for bit.
inline __m256i silu_times(__m512 gate, __m512 up) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return fp32_to_bf16(_mm512_mul_ps(bf16_to_fp32(fp32_to_bf16(silu)), up));
}
#endif
