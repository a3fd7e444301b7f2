// Fused elementwise ops for the CPU: each reads its inputs once and writes its outputs once, where the
// portable versions (npu_llm_kernels/torch_ref.py) run five to eight torch ops, each a pass over memory with
// its own dispatch. Math in fp32, one rounding to the tensor's dtype at the end. Semantics:
// torch_ref.rms_norm, add_rms_norm and rotary_embedding (neox style).
#include "ops.h"

#include <ATen/Parallel.h>

namespace {

// Element access on raw storage: bf16 as its uint16 bits, so that the loops below vectorize (the
// compiler does not see through c10::BFloat16's constructors).
template <typename T>
struct Raw {
  using type = T;
  static float get(const T* p, int64_t i) { return static_cast<float>(p[i]); }
  static void put(T* p, int64_t i, float v) { p[i] = static_cast<T>(v); }
  static float round(float v) { return static_cast<float>(static_cast<T>(v)); }
};

template <>
struct Raw<at::BFloat16> {
  using type = uint16_t;
  static float get(const uint16_t* p, int64_t i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
  // round to nearest even, as torch rounds
  static uint16_t bits_of(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    return static_cast<uint16_t>((nan ? 0x7fc00000u : bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
  static void put(uint16_t* p, int64_t i, float v) { p[i] = bits_of(v); }
  static float round(float v) {
    const uint32_t bits = static_cast<uint32_t>(bits_of(v)) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
};

template <typename T>
using raw_t = typename Raw<T>::type;

template <typename T>
raw_t<T>* raw(const at::Tensor& t) {
  return reinterpret_cast<raw_t<T>*>(t.data_ptr<T>());
}

// rows of `dim` elements: out = weight * round(x * rsqrt(mean(x^2) + eps)), as Hugging Face Llama computes it.
template <typename T>
void rms_norm_rows(const raw_t<T>* x, const raw_t<T>* weight, raw_t<T>* out, int64_t rows, int64_t dim, float eps) {
  using R = Raw<T>;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const raw_t<T>* xr = x + r * dim;
      raw_t<T>* o = out + r * dim;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < dim; ++d) squares += R::get(xr, d) * R::get(xr, d);
      const float inv = 1.f / std::sqrt(squares / dim + eps);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) R::put(o, d, R::get(weight, d) * R::round(R::get(xr, d) * inv));
    }
  });
}

// summed = round(x + residual), out = rms_norm(summed)
template <typename T>
void add_rms_norm_rows(const raw_t<T>* x, const raw_t<T>* residual, const raw_t<T>* weight, raw_t<T>* out,
                       raw_t<T>* summed, int64_t rows, int64_t dim, float eps) {
  using R = Raw<T>;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const raw_t<T>* xr = x + r * dim;
      const raw_t<T>* rr = residual + r * dim;
      raw_t<T>* s = summed + r * dim;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < dim; ++d) {
        const float v = R::round(R::get(xr, d) + R::get(rr, d));
        R::put(s, d, v);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / dim + eps);
      raw_t<T>* o = out + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) R::put(o, d, R::get(weight, d) * R::round(R::get(s, d) * inv));
    }
  });
}

// One head of one token: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves.
template <typename T>
inline void rotate(const raw_t<T>* x, const raw_t<T>* cos, const raw_t<T>* sin, raw_t<T>* out, int64_t half) {
  using R = Raw<T>;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = R::get(x, i), x2 = R::get(x, i + half);
    const float c = R::get(cos, i), s = R::get(sin, i);
    R::put(out, i, x1 * c - x2 * s);
    R::put(out, i + half, x2 * c + x1 * s);
  }
}

template <typename T>
void rotary_rows(const int64_t* positions, const raw_t<T>* q, const raw_t<T>* k, const raw_t<T>* cache,
                 raw_t<T>* q_out, raw_t<T>* k_out, int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                 int64_t q_stride, int64_t k_stride) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const raw_t<T>* cos = cache + positions[t] * head_dim;
      const raw_t<T>* sin = cos + half;
      for (int64_t h = 0; h < q_heads; ++h)
        rotate<T>(q + t * q_stride + h * head_dim, cos, sin, q_out + (t * q_heads + h) * head_dim, half);
      for (int64_t h = 0; h < k_heads; ++h)
        rotate<T>(k + t * k_stride + h * head_dim, cos, sin, k_out + (t * k_heads + h) * head_dim, half);
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), name, " must be contiguous");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  auto w = weight.to(x.scalar_type()).contiguous();
  TORCH_CHECK(w.numel() == x.size(-1), "weight must have the hidden size");
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(raw<scalar_t>(x), raw<scalar_t>(w), raw<scalar_t>(out), rows, dim, static_cast<float>(eps));
  });
  return out;
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                     double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must match in shape and dtype");
  auto w = weight.to(x.scalar_type()).contiguous();
  TORCH_CHECK(w.numel() == x.size(-1), "weight must have the hidden size");
  auto out = at::empty_like(x);
  auto summed = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(raw<scalar_t>(x), raw<scalar_t>(residual), raw<scalar_t>(w), raw<scalar_t>(out),
                                raw<scalar_t>(summed), rows, dim, static_cast<float>(eps));
  });
  return {out, summed};
}

std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                         const at::Tensor& cos_sin_cache) {
  // query [T, Hq, D], key [T, Hkv, D]: views into the fused QKV output are fine as long as each token's heads
  // are contiguous (head stride D, element stride 1). A single head's stride is whatever torch left it: with one
  // head (tensor parallel) torch calls the view contiguous and .contiguous() keeps it.
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3, "query [T, Hq, D] and key [T, Hkv, D] expected");
  const int64_t tokens = query.size(0), head_dim = query.size(2);
  auto heads_contiguous = [head_dim](const at::Tensor& x) {
    return x.stride(2) == 1 && (x.size(1) == 1 || x.stride(1) == head_dim);
  };
  TORCH_CHECK(heads_contiguous(query) && heads_contiguous(key),
              "each token's heads must be contiguous");
  TORCH_CHECK(key.size(0) == tokens && key.size(2) == head_dim && head_dim % 2 == 0, "query and key do not match");
  auto cache = cos_sin_cache.to(query.scalar_type()).contiguous();
  TORCH_CHECK(cache.dim() == 2 && cache.size(1) == head_dim, "cos_sin_cache must be [max_position, head_dim]");
  auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == tokens, "one position per token");
  // (a plain loop: at::aminmax and two item() calls took 0.8 of the 6.3 us of a call at 64 tokens)
  const int64_t* position = pos.data_ptr<int64_t>();
  const int64_t max_positions = cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(position[t] >= 0 && position[t] < max_positions, "position ", position[t],
                " outside cos_sin_cache of ", max_positions, " positions");
  auto q_out = at::empty({tokens, query.size(1), head_dim}, query.options());
  auto k_out = at::empty({tokens, key.size(1), head_dim}, key.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    rotary_rows<scalar_t>(position, raw<scalar_t>(query), raw<scalar_t>(key), raw<scalar_t>(cache),
                          raw<scalar_t>(q_out), raw<scalar_t>(k_out), tokens, query.size(1), key.size(1), head_dim,
                          query.stride(0), key.stride(0));
  });
  return {q_out, k_out};
}
