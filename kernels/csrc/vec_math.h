// Math the kernels' loops need in a form the compiler vectorizes (libm's expf is a call per element).
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
