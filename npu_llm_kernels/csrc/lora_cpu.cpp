// Batched LoRA (vLLM's punica SGMV, on the CPU): y[rows] += (x[rows] A^T) B^T for each segment of rows that share an
// adapter, in one call per layer. Each adapter is small (rank r: A [w, K], B^T [w, N], w = parts x r), so a step's
// cost was the fixed cost of two library GEMMs per segment per layer (50-100 us each on a 2-core AVX2 machine,
// against a few us of arithmetic at decode sizes); here one call does every segment.
//
// Work items are blocks of up to ROWS rows of one segment; a block reads its adapter's weights once for all its rows
// (fp32, so the inner loops are plain fused multiply-adds the compiler vectorizes at this build's level). The shrink
// takes K-long dot products, the expand N-long axpys into fp32 sums; y is read once and written once, rounded to
// its dtype then, as y + delta is in torch.
#include "ops.h"

namespace {

constexpr int64_t ROWS = 4;

template <typename T>
void add_block(T* y, const T* x, int64_t rows, int64_t k, int64_t n, const float* shrink, const float* expand_t,
               int64_t width, std::vector<float>& xs, std::vector<float>& mid, std::vector<float>& sums) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) xs[r * k + c] = static_cast<float>(x[r * k + c]);
  for (int64_t j = 0; j < width; ++j) {
    const float* a = shrink + j * k;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = xs.data() + r * k;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < k; ++c) dot += a[c] * xr[c];
      mid[r * width + j] = dot;
    }
  }
  std::fill(sums.begin(), sums.begin() + rows * n, 0.f);
  for (int64_t j = 0; j < width; ++j) {
    const float* b = expand_t + j * n;
    for (int64_t r = 0; r < rows; ++r) {
      const float s = mid[r * width + j];
      float* out = sums.data() + r * n;
#pragma omp simd
      for (int64_t o = 0; o < n; ++o) out[o] += s * b[o];
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < n; ++o) y[r * n + o] = static_cast<T>(static_cast<float>(y[r * n + o]) + sums[r * n + o]);
}

}  // namespace

void lora_add(at::Tensor& y, const at::Tensor& x, const std::vector<int64_t>& bounds,
              const std::vector<at::Tensor>& shrinks, const std::vector<at::Tensor>& expands) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.scalar_type() == y.scalar_type(),
              "lora_add: x [T, K] and y [T, N] of one dtype");
  TORCH_CHECK(y.is_contiguous() && x.stride(1) == 1, "lora_add: y contiguous, x's rows contiguous");
  TORCH_CHECK(bounds.size() == 2 * shrinks.size() && shrinks.size() == expands.size(),
              "lora_add: a (start, end) and a shrink and expand per segment");
  const int64_t k = x.size(1), n = y.size(1), x_stride = x.stride(0);
  TORCH_CHECK(x_stride == k, "lora_add: x's rows packed");
  std::vector<std::tuple<int64_t, int64_t, size_t>> blocks;  // (first row, rows, segment)
  int64_t max_width = 0;
  for (size_t s = 0; s < shrinks.size(); ++s) {
    const auto& a = shrinks[s];
    const auto& b = expands[s];
    TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.is_contiguous() &&
                    b.is_contiguous() && a.size(1) == k && b.size(1) == n && a.size(0) == b.size(0),
                "lora_add: fp32 shrink [w, K] and expand^T [w, N]");
    TORCH_CHECK(0 <= bounds[2 * s] && bounds[2 * s] <= bounds[2 * s + 1] && bounds[2 * s + 1] <= y.size(0),
                "lora_add: segment rows out of range");
    max_width = std::max(max_width, a.size(0));
    for (int64_t row = bounds[2 * s]; row < bounds[2 * s + 1]; row += ROWS)
      blocks.emplace_back(row, std::min(ROWS, bounds[2 * s + 1] - row), s);
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "lora_add", [&] {
    scalar_t* ys = y.data_ptr<scalar_t>();
    const scalar_t* xs = x.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xbuf(ROWS * k), mid(ROWS * max_width), sums(ROWS * n);
      for (int64_t i = begin; i < end; ++i) {
        const auto [row, rows, s] = blocks[i];
        add_block<scalar_t>(ys + row * n, xs + row * k, rows, k, n, shrinks[s].data_ptr<float>(),
                            expands[s].data_ptr<float>(), shrinks[s].size(0), xbuf, mid, sums);
      }
    });
  });
}
