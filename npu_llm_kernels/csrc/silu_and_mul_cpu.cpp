// The gated MLP's activation, silu(gate) * up, over rows of [gate | up]. Semantics: torch_ref.silu_and_mul,
// which runs F.silu (rounding to the dtype) and then a multiply: two passes over memory and two dispatches.
//
// bf16 on an AVX-512 CPU is fused into one pass: the product is computed as torch_ref does, with silu's
// result rounded to bf16 before the multiply, and exp from a polynomial (relative error ~2e-7, below bf16's
// resolution). Everything else runs torch_ref's two ops, so fp32 results stay exactly torch_ref's.
#include "ops.h"
#include "vec_math.h"

#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

// The fused loop's masked 16-bit loads and stores need AVX512BW and VL besides AVX512F.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FUSED_SILU 1

namespace {

void silu_and_mul_bf16(const uint16_t* x, uint16_t* out, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(dim, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* gate = x + r * 2 * dim;
      const uint16_t* up = gate + dim;
      uint16_t* o = out + r * dim;
      for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 lanes = first_lanes(dim - d);
        const __m512 g = bf16_to_fp32(_mm256_maskz_loadu_epi16(lanes, gate + d));
        const __m512 u = bf16_to_fp32(_mm256_maskz_loadu_epi16(lanes, up + d));
        _mm256_mask_storeu_epi16(o + d, lanes, silu_times(g, u));
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
