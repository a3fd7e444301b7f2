// W8A8: y = (q_x q_w^T) * scale_x * scale_w (+ bias) for int8 weights [N, K] with per-channel scales, the activations
// quantized to int8 here first: per row (dynamic) or with one static scale (and, for msModelSlim's asymmetric
// activations, an integer offset). The arithmetic is torch_ref.int8_linear's (compressed-tensors'): scale = absmax /
// 127.5, q = clamp(round_half_even(x / scale + offset), -128, 127).
//
// Why not oneDNN's int8 GEMM: without VNNI it multiplies u8 x s8 through 16-bit intermediates (vpmaddubsw) that
// saturate on full-range int8 weights (docs/quantization.md). Here both operands are widened to 16 bits and
// multiplied with vpmaddwd: pairs of int16 products summed into int32, exact, 16 multiply-adds an instruction
// (twice an fp32 FMA's 8), from weights that stream a quarter of the bytes of fp32 ones.
//
// quantize_rows_u8 and scale_int8_sums are the two ends of the same product where oneDNN's int8 GEMM does the middle
// (CPUs with VNNI, npu_llm_kernels/cpu.py): each row quantized in one pass, stored as q + 128 in uint8 (the unsigned
// activations with zero point 128 that oneDNN multiplies in its fast kernels on every VNNI CPU; signed ones take its
// reference kernel where there is no AMX), and the GEMM's sums (already times the weight scales) times each row's
// scale, plus the bias, in one pass to the output's dtype.
//
// Work: stripes of NB output features are spread over the threads; inside a stripe (its weights stay in L2), each
// group of up to 4 rows of x (in L1, as int16) meets NT weight rows at a time, into NT x M int32 accumulators.
#include "ops.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <limits>

namespace {

constexpr int64_t KSTEP = 16;  // int16 lanes of a 256-bit vector
constexpr int64_t NB = 64;     // output features a stripe

inline __m256 load_as_float(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load_as_float(const at::BFloat16* p) { return load_bf16x8(p); }

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// One row of x as int16 values of int8 range into q; returns its scale (the static one, or absmax / 127.5), or NaN
// where x / scale is NaN somewhere (a NaN in x, or an infinite absmax): the row's outputs are then NaN, as torch_ref's.
// The static offset is added before rounding (0 for dynamic and symmetric scales).
template <typename T>
float quantize_row(const T* x, int64_t k, float static_scale, float offset, int16_t* q) {
  float scale = static_scale;
  if (scale <= 0.f) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t c = 0; c < k; c += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load_as_float(x + c)));
    scale = hmax(vmax) / 127.5f;
    if (scale == 0.f) scale = 1.1920928955078125e-07f;  // an all-zero row stays zero (torch_ref: fp32 eps)
  }
  const __m256 vscale = _mm256_set1_ps(scale), voffset = _mm256_set1_ps(offset);
  const __m256 lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
  __m256 unordered = _mm256_setzero_ps();  // max and min below would turn a NaN into a bound
  for (int64_t c = 0; c < k; c += 16) {
    __m256i halves[2];
    for (int h = 0; h < 2; ++h) {
      __m256 v = _mm256_add_ps(_mm256_div_ps(load_as_float(x + c + 8 * h), vscale), voffset);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // half to even, as torch.round
      halves[h] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    }
    // packs interleaves 128-bit lanes: restore the order
    const __m256i packed = _mm256_packs_epi32(halves[0], halves[1]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + c), _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
  }
  return _mm256_movemask_ps(unordered) ? std::numeric_limits<float>::quiet_NaN() : scale;
}

// acc[m][j] = q_x[m] . w[n0 + j] over k, for M rows of q_x (row stride k) and NT weight rows.
template <int M, int NT>
inline void tile(const int16_t* q, const int8_t* w, int64_t k, int64_t n0, int32_t (*acc)[NT]) {
  __m256i sum[NT][M];
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < M; ++m) sum[j][m] = _mm256_setzero_si256();
  for (int64_t c = 0; c < k; c += KSTEP) {
    __m256i xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * k + c));
    for (int j = 0; j < NT; ++j) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + j) * k + c)));
      for (int m = 0; m < M; ++m) sum[j][m] = _mm256_add_epi32(sum[j][m], _mm256_madd_epi16(xv[m], wv));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = hsum(sum[j][m]);
}

constexpr int NT = 2;  // NT x 4 accumulators, 4 x and one w vector: within AVX2's 16 registers

template <int M>
void rows(const int16_t* q, const float* xscale, const int8_t* w, const float* wscale, const float* bias, int64_t k,
          int64_t n_begin, int64_t n_end, int64_t n, float* out) {
  int32_t acc[M][NT];
  for (int64_t n0 = n_begin; n0 < n_end; n0 += NT) {
    const int width = static_cast<int>(std::min<int64_t>(NT, n_end - n0));
    if (width == NT) {
      tile<M, NT>(q, w, k, n0, acc);
    } else {
      int32_t one[M][1];
      tile<M, 1>(q, w, k, n0, one);
      for (int m = 0; m < M; ++m) acc[m][0] = one[m][0];
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < width; ++j)
        out[m * n + n0 + j] = static_cast<float>(acc[m][j]) * wscale[n0 + j] * xscale[m] + (bias ? bias[n0 + j] : 0.f);
  }
}

template <typename T>
void linear(const T* x, int64_t m, int64_t k, const int8_t* w, const float* wscale, const float* bias, int64_t n,
            float static_scale, float offset, float* out) {
  std::vector<int16_t> q(m * k);
  std::vector<float> xscale(m);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) xscale[r] = quantize_row(x + r * k, k, static_scale, offset, q.data() + r * k);
  });
  at::parallel_for(0, (n + NB - 1) / NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t stripe = begin; stripe < end; ++stripe) {
      const int64_t n_begin = stripe * NB, n_end = std::min(n, n_begin + NB);
      for (int64_t r = 0; r < m; r += 4) {
        const int16_t* qr = q.data() + r * k;
        float* o = out + r * n;
        switch (std::min<int64_t>(4, m - r)) {
          case 1: rows<1>(qr, xscale.data() + r, w, wscale, bias, k, n_begin, n_end, n, o); break;
          case 2: rows<2>(qr, xscale.data() + r, w, wscale, bias, k, n_begin, n_end, n, o); break;
          case 3: rows<3>(qr, xscale.data() + r, w, wscale, bias, k, n_begin, n_end, n, o); break;
          default: rows<4>(qr, xscale.data() + r, w, wscale, bias, k, n_begin, n_end, n, o); break;
        }
      }
    }
  });
}

// The per-call checks and fp32 views both entry points share: (x as [M, K], its static scale or 0, its offset).
struct Activations {
  at::Tensor flat;
  float static_scale, offset;
};

Activations activations(const at::Tensor& x, int64_t k, const std::optional<at::Tensor>& input_scale,
                        const std::optional<at::Tensor>& input_offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: fp32 or bf16");
  TORCH_CHECK(x.is_cpu() && x.size(-1) == k && k % KSTEP == 0, "x [.., K] on the CPU, with K a multiple of 16");
  TORCH_CHECK(!input_scale.has_value() || input_scale->numel() == 1, "input_scale: one value");
  const float static_scale = input_scale.has_value() ? input_scale->to(at::kFloat).item<float>() : 0.f;
  TORCH_CHECK(!input_scale.has_value() || static_scale > 0.f, "input_scale must be positive");  // (checked at load)
  TORCH_CHECK(!input_offset.has_value() || (input_scale.has_value() && input_offset->numel() == 1),
              "input_offset: one value, beside a static input_scale");
  const float offset = input_offset.has_value() ? input_offset->to(at::kFloat).item<float>() : 0.f;
  return {x.reshape({-1, k}).contiguous(), static_scale, offset};
}

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, float static_scale, float offset, uint8_t* q, float* scales) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> row(k);
    for (int64_t r = begin; r < end; ++r) {
      scales[r] = quantize_row(x + r * k, k, static_scale, offset, row.data());
      uint8_t* out = q + r * k;
#pragma omp simd
      for (int64_t c = 0; c < k; ++c) out[c] = static_cast<uint8_t>(row[c] + 128);  // (int8 values already)
    }
  });
}

// y = sums * scale (+ bias), multiplied then added, as torch_ref rounds them: contracting the two into one FMA (which
// -O3 does) would round once where torch_ref rounds twice, and fp32 results would differ from its in the last bit.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void scale_row(const float* sums, float scale, const float* bias,
                                                            int64_t n, T* y) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) {
    const float product = sums[c] * scale;
    store_as(bias ? product + bias[c] : product, y + c);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_rows_u8(const at::Tensor& x, const std::optional<at::Tensor>& input_scale,
                                                    const std::optional<at::Tensor>& input_offset) {
  const Activations a = activations(x, x.size(-1), input_scale, input_offset);
  const int64_t m = a.flat.size(0), k = a.flat.size(1);
  at::Tensor q = at::empty({m, k}, a.flat.options().dtype(at::kByte));
  at::Tensor scales = at::empty({m}, a.flat.options().dtype(at::kFloat));
  if (a.flat.scalar_type() == at::kFloat) {
    quantize_rows(a.flat.data_ptr<float>(), m, k, a.static_scale, a.offset, q.data_ptr<uint8_t>(),
                  scales.data_ptr<float>());
  } else {
    quantize_rows(a.flat.data_ptr<at::BFloat16>(), m, k, a.static_scale, a.offset, q.data_ptr<uint8_t>(),
                  scales.data_ptr<float>());
  }
  return {q, scales};
}

at::Tensor scale_int8_sums(const at::Tensor& sums, const at::Tensor& row_scales, const std::optional<at::Tensor>& bias,
                           bool bf16) {
  TORCH_CHECK(sums.scalar_type() == at::kFloat && sums.dim() == 2 && sums.is_contiguous(), "sums: fp32 [M, N]");
  const int64_t m = sums.size(0), n = sums.size(1);
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.numel() == m, "row_scales: fp32 [M]");
  std::optional<at::Tensor> fp32_bias;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bias: one value per output feature");
    fp32_bias = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, sums.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float* s = sums.data_ptr<float>();
  const float* rs = row_scales.data_ptr<float>();
  const float* b = fp32_bias.has_value() ? fp32_bias->data_ptr<float>() : nullptr;
  void* dst = out.data_ptr();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      with_output(bf16, dst, r * n, [&](auto* y) { scale_row(s + r * n, rs[r], b, n, y); });
    }
  });
  return out;
}

at::Tensor linear_int8_weights(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                               const std::optional<at::Tensor>& input_scale, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& input_offset) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(), "weight: int8 [N, K]");
  TORCH_CHECK(weight.is_cpu() && weight_scale.is_cpu(), "CPU tensors only");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(weight_scale.numel() == n, "weight_scale: one scale per output feature");
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "bias: one value per output feature");
  const at::Tensor scales = weight_scale.to(at::kFloat).contiguous().reshape({n});
  const auto [flat, static_scale, offset] = activations(x, k, input_scale, input_offset);
  const int64_t m = flat.size(0);
  std::optional<at::Tensor> fp32_bias;
  if (bias.has_value()) fp32_bias = bias->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n}, flat.options().dtype(at::kFloat));
  const float* b = fp32_bias.has_value() ? fp32_bias->data_ptr<float>() : nullptr;
  if (flat.scalar_type() == at::kFloat) {
    linear(flat.data_ptr<float>(), m, k, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), b, n, static_scale,
           offset, out.data_ptr<float>());
  } else {
    linear(flat.data_ptr<at::BFloat16>(), m, k, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), b, n,
           static_scale, offset, out.data_ptr<float>());
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.to(x.scalar_type()).reshape(shape);
}

bool has_linear_int8_weights() { return true; }

#else  // no AVX2: torch_ref takes these calls

at::Tensor linear_int8_weights(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "linear_int8_weights needs AVX2 and FMA");
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_u8(const at::Tensor&, const std::optional<at::Tensor>&,
                                                    const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "quantize_rows_u8 needs AVX2 and FMA");
}

at::Tensor scale_int8_sums(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "scale_int8_sums needs AVX2 and FMA");
}

bool has_linear_int8_weights() { return false; }

#endif
