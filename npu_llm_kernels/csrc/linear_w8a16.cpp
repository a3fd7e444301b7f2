// W8A16: y = x ((q + offset) * scale)^T (+ bias) for int8 weights q [N, K], with scales [N, G] (G = 1: one per output
// channel; else one per group of K / G input features) and msModelSlim's per-channel offsets [N, 1], x in fp32 or
// bf16. The weights stay int8 in memory; they are dequantized where they are multiplied, never as a whole layer.
//
// linear_w8a16 (a few rows: decode steps, bound by streaming the weights, which int8 makes half of bf16's bytes):
// each task takes NT weight rows and walks them along K, 8 values a step, widened to fp32 in registers, into NT x M
// accumulators; at the end of each group its sums are scaled into NT x M totals. The offset's share,
// offset * scale * sum(x), is added once per row after. The activations (M rows, fp32) sit in L1 throughout.
//
// dequantize_int8 (many rows: prefill, bound by arithmetic): a block of weights in the activations' dtype, rounded
// once, for a matmul library to multiply (npu_llm_kernels/cpu.py); one pass, where torch's would take three.
#include "ops.h"
#include "vec_math.h"

namespace {

void check_w8a16(const at::Tensor& weight, const at::Tensor& scale, const std::optional<at::Tensor>& offset) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(), "weight: int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.is_contiguous() &&
                  scale.size(0) == weight.size(0) && scale.size(1) >= 1 && weight.size(1) % scale.size(1) == 0,
              "weight_scale: fp32 [N, G], G dividing K");
  TORCH_CHECK(!offset.has_value() || (offset->scalar_type() == at::kFloat && offset->numel() == weight.size(0) &&
                                      scale.size(1) == 1),
              "weight_offset: fp32 [N, 1], with one scale per output channel");
}

}  // namespace

at::Tensor dequantize_int8(const at::Tensor& weight, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                           bool bf16) {
  check_w8a16(weight, scale, offset);
  const int64_t n = weight.size(0), k = weight.size(1), groups = scale.size(1), group = k / groups;
  at::Tensor out = at::empty({n, k}, weight.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const int8_t* q = weight.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  const float* o = offset.has_value() ? offset->data_ptr<float>() : nullptr;
  void* dst = out.data_ptr();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int8_t* row = q + r * k;
      const float shift = o ? o[r] : 0.f;
      with_output(bf16, dst, r * k, [&](auto* y) {
        for (int64_t g = 0; g < groups; ++g) {
          const float sg = s[r * groups + g];
#pragma omp simd
          for (int64_t c = g * group; c < (g + 1) * group; ++c) {
            store_as((static_cast<float>(row[c]) + shift) * sg, y + c);
          }
        }
      });
    }
  });
  return out;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

inline __m256 load_int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// out[m][n0 .. n0 + NT) for M rows of x (fp32, row stride k) and NT weight rows from n0, in groups of `group`
// (a multiple of 8). Two accumulators a pair (even and odd steps of 8) keep 2 x NT x M FMA chains in flight.
template <int M, int NT>
inline void tile(const float* x, const int8_t* w, const float* scale, int64_t groups, int64_t k, int64_t n0,
                 float* out, int64_t n) {
  const int64_t group = k / groups;
  __m256 total[NT][M];
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < M; ++m) total[j][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 even[NT][M], odd[NT][M];
    for (int j = 0; j < NT; ++j)
      for (int m = 0; m < M; ++m) even[j][m] = odd[j][m] = _mm256_setzero_ps();
    const int64_t begin = g * group, end = begin + group;
    int64_t c = begin;
    for (; c + 16 <= end; c += 16) {
      __m256 xe[M], xo[M];
      for (int m = 0; m < M; ++m) {
        xe[m] = _mm256_loadu_ps(x + m * k + c);
        xo[m] = _mm256_loadu_ps(x + m * k + c + 8);
      }
      for (int j = 0; j < NT; ++j) {
        const int8_t* row = w + (n0 + j) * k + c;
        const __m256 we = load_int8x8(row), wo = load_int8x8(row + 8);
        for (int m = 0; m < M; ++m) {
          even[j][m] = _mm256_fmadd_ps(xe[m], we, even[j][m]);
          odd[j][m] = _mm256_fmadd_ps(xo[m], wo, odd[j][m]);
        }
      }
    }
    if (c < end) {  // (a group of an odd number of 8s)
      for (int j = 0; j < NT; ++j) {
        const __m256 we = load_int8x8(w + (n0 + j) * k + c);
        for (int m = 0; m < M; ++m) even[j][m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + c), we, even[j][m]);
      }
    }
    for (int j = 0; j < NT; ++j) {
      const __m256 sv = _mm256_set1_ps(scale[(n0 + j) * groups + g]);
      for (int m = 0; m < M; ++m) total[j][m] = _mm256_fmadd_ps(_mm256_add_ps(even[j][m], odd[j][m]), sv, total[j][m]);
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < M; ++m) out[m * n + n0 + j] = hsum(total[j][m]);
}

// Weight rows a tile: with AVX2's 16 registers, 2 x NT x M accumulators, NT x M totals and 2M + 2 operands fit at
// M = 1 with 3 rows; AVX-512 builds (32 registers, for these 256-bit operations too) take 4, and 2 from M = 3.
#if defined(__AVX512VL__)
template <int M> constexpr int NT = M <= 2 ? 4 : 2;
#else
template <int M> constexpr int NT = M == 1 ? 3 : 1;
#endif

template <int M>
void rows(const float* x, const int8_t* w, const float* scale, int64_t groups, int64_t k, int64_t n, float* out) {
  constexpr int T = NT<M>;
  at::parallel_for(0, (n + T - 1) / T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * T;
      if (n0 + T <= n) {
        tile<M, T>(x, w, scale, groups, k, n0, out, n);
      } else {
        for (int64_t r = n0; r < n; ++r) tile<M, 1>(x, w, scale, groups, k, r, out, n);
      }
    }
  });
}

}  // namespace

at::Tensor linear_w8a16(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                        const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias) {
  check_w8a16(weight, scale, offset);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: fp32 or bf16");
  const int64_t k = weight.size(1), n = weight.size(0), groups = scale.size(1);
  TORCH_CHECK(x.size(-1) == k && (k / groups) % 8 == 0, "x [.., K], and groups of a multiple of 8 input features");
  const at::Tensor flat = x.reshape({-1, k}).to(at::kFloat).contiguous();  // a few rows: a few KB
  const int64_t m = flat.size(0);
  at::Tensor out = at::empty({m, n}, flat.options());
  const float* xs = flat.data_ptr<float>();
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  for (int64_t r = 0; r < m; r += 4) {  // (the weights stream once per 4 rows: callers send few)
    float* y = ys + r * n;
    switch (std::min<int64_t>(4, m - r)) {
      case 1: rows<1>(xs + r * k, w, s, groups, k, n, y); break;
      case 2: rows<2>(xs + r * k, w, s, groups, k, n, y); break;
      case 3: rows<3>(xs + r * k, w, s, groups, k, n, y); break;
      default: rows<4>(xs + r * k, w, s, groups, k, n, y); break;
    }
  }
  if (offset.has_value()) out.add_(flat.sum(1, true).mul(scale.view({1, n}).mul(offset->view({1, n}))));
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.to(x.scalar_type()).reshape(shape);
}

bool has_linear_w8a16() { return true; }

#else  // no AVX2: torch_ref's dequantizing matmul takes these calls

at::Tensor linear_w8a16(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "linear_w8a16 needs AVX2 and FMA");
}

bool has_linear_w8a16() { return false; }

#endif
