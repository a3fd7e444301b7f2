// The gated MLP's activation, silu(gate) * up, over rows of [gate | up]. Semantics: torch_ref.silu_and_mul,
// which runs F.silu (rounding to the dtype) and then a multiply: two passes over memory and two dispatches.
//
// bf16 on an AVX-512 CPU is fused into one pass: the product is computed as torch_ref does, with silu's
// result rounded to bf16 before the multiply, and exp from a polynomial (relative error ~2e-7, below bf16's
// resolution). Everything else runs torch_ref's two ops, so fp32 results stay exactly torch_ref's.
#include "ops.h"

#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

// The fused loop's masked 16-bit loads and stores need AVX512BW and VL besides AVX512F.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FUSED_SILU 1
#include <immintrin.h>

namespace {

// exp(x), 16 at a time: vec_math.h's fast_exp.
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

void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(dim, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* gate = x + r * 2 * dim;
      const uint16_t* up = gate + dim;
      uint16_t* o = out + r * dim;
      for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 lanes = dim - d >= 16 ? 0xffff : static_cast<__mmask16>((1u << (dim - d)) - 1);
        const __m512 g = bf16_to_fp32(_mm256_maskz_loadu_epi16(lanes, gate + d));
        const __m512 u = bf16_to_fp32(_mm256_maskz_loadu_epi16(lanes, up + d));
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        const __m512 product = _mm512_mul_ps(bf16_to_fp32(fp32_to_bf16(silu)), u);
        _mm256_mask_storeu_epi16(o + d, lanes, fp32_to_bf16(product));
      }
    }
  });
}

}  // namespace
#endif

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "the last dimension holds gate and up: it must be even");
  const int64_t dim = x.size(-1) / 2;
#if defined(FUSED_SILU)
  if (x.scalar_type() == at::kBFloat16 && x.is_contiguous()) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = dim;
    auto out = at::empty(shape, x.options());
    silu_and_mul_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()),
                      dim ? out.numel() / dim : 0, dim);
    return out;
  }
#endif
  return at::mul(at::silu(x.narrow(-1, 0, dim)), x.narrow(-1, dim, dim));
}
