// y = x w^T (+ bias) for a few rows of x (up to a few tens), with w kept in bf16 and the math in fp32, on CPUs where oneDNN has no
// bf16 (AVX2 without AVX-512). A decode step of one to four sequences is bound by streaming the weights: bf16
// weights stream half the bytes that fp32-packed ones do, and converting them to fp32 costs one shift per 8 values.
//
// Each task takes a stripe of output features. Its inner loop walks NT weight rows at once along K, 8 values a
// step, into NT x M accumulators (independent FMA chains, so the FMA latency is hidden even at M = 1); the
// activations (M rows of K fp32 values) sit in L1 for the whole stripe. Semantics: F.linear of bf16 tensors,
// rounded to bf16 once, as a bf16 GEMM rounds (summation order aside).
#include "ops.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

// out[m][n0 .. n0 + NT) for M rows of x (fp32, row stride k) and NT rows of w from n0.
template <int M, int NT>
inline void tile(const float* x, const at::BFloat16* w, int64_t k, int64_t n0, float* out, int64_t n) {
  __m256 acc[NT][M];
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < M; ++m) acc[j][m] = _mm256_setzero_ps();
  const int64_t whole = k - k % 8;
  for (int64_t c = 0; c < whole; c += 8) {
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * k + c);
    for (int j = 0; j < NT; ++j) {
      const __m256 wv = load_bf16x8(w + (n0 + j) * k + c);
      for (int m = 0; m < M; ++m) acc[j][m] = _mm256_fmadd_ps(xv[m], wv, acc[j][m]);
    }
  }
  for (int j = 0; j < NT; ++j) {
    for (int m = 0; m < M; ++m) {
      float sum = hsum(acc[j][m]);
      for (int64_t c = whole; c < k; ++c) sum += x[m * k + c] * static_cast<float>(w[(n0 + j) * k + c]);
      out[m * n + n0 + j] = sum;
    }
  }
}

template <int M>
void rows(const float* x, const at::BFloat16* w, int64_t k, int64_t n, float* out) {
  constexpr int NT = M <= 2 ? 4 : 2;  // NT x M accumulators, M x and NT w vectors: within AVX2's 16 registers
  at::parallel_for(0, (n + NT - 1) / NT, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NT;
      if (n0 + NT <= n) {
        tile<M, NT>(x, w, k, n0, out, n);
      } else {
        for (int64_t r = n0; r < n; ++r) tile<M, 1>(x, w, k, r, out, n);
      }
    }
  });
}

// More than 4 rows (a speculative verification's k + 1 positions, a few decodes with drafts): each task's stripe of
// 2 weight rows is applied to the rows 4 at a time while it sits in L1, so the weights still stream from memory
// once, as bf16.
template <int M>
inline void stripe(const float* x, const at::BFloat16* w, int64_t k, int64_t n0, float* out, int64_t n) {
  if (n0 + 2 <= n) {
    tile<M, 2>(x, w, k, n0, out, n);
  } else {
    tile<M, 1>(x, w, k, n0, out, n);  // (the last weight row of an odd n)
  }
}

void many_rows(const float* x, const at::BFloat16* w, int64_t k, int64_t n, int64_t m, float* out) {
  at::parallel_for(0, (n + 1) / 2, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t g = 0; g < m; g += 4) {
        const float* xg = x + g * k;
        float* og = out + g * n;
        switch (std::min<int64_t>(4, m - g)) {
          case 4: stripe<4>(xg, w, k, 2 * t, og, n); break;
          case 3: stripe<3>(xg, w, k, 2 * t, og, n); break;
          case 2: stripe<2>(xg, w, k, 2 * t, og, n); break;
          default: stripe<1>(xg, w, k, 2 * t, og, n); break;
        }
      }
    }
  });
}

}  // namespace

at::Tensor linear_bf16_weights(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 x and weight only");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && x.size(-1) == weight.size(1), "weight [N, K], x [.., K]");
  const int64_t k = weight.size(1), n = weight.size(0);
  const at::Tensor flat = x.reshape({-1, k}).to(at::kFloat).contiguous();  // a few rows: a few KB
  const int64_t m = flat.size(0);
  at::Tensor out = at::empty({m, n}, flat.options());
  const float* xs = flat.data_ptr<float>();
  const auto* w = weight.data_ptr<at::BFloat16>();
  float* ys = out.data_ptr<float>();
  switch (m) {
    case 1: rows<1>(xs, w, k, n, ys); break;
    case 2: rows<2>(xs, w, k, n, ys); break;
    case 3: rows<3>(xs, w, k, n, ys); break;
    case 4: rows<4>(xs, w, k, n, ys); break;
    case 0: break;
    default: many_rows(xs, w, k, n, m, ys); break;
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.to(at::kBFloat16).reshape(shape);
}

bool has_linear_bf16_weights() { return true; }

#else  // no AVX2: F.linear takes these calls

at::Tensor linear_bf16_weights(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "linear_bf16_weights needs AVX2 and FMA");
}

bool has_linear_bf16_weights() { return false; }

#endif
