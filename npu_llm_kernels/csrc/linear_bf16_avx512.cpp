// y = x w^T (+ bias) for bf16 x and weights on CPUs with AVX512-BF16, the weights packed once in stripes of 64
// output columns with k in pairs ([N / 64, K / 2, 64, 2]: pack_linear_weight in npu_llm_kernels/cpu.py), the
// layout vdpbf16ps multiplies: each instruction takes 16 columns times two k of one row, summed in fp32.
//
// Why not oneDNN's matmul on its own packed weights: at decode sizes (32-64 rows) the weights stream from memory
// each step, and oneDNN's GEMM, computing at 700-850 GFLOP/s on weights in cache, fell to 500-650 on weights that
// are not (a model's layers one after another), while these tiles keep 800-900: each task prefetches the stripe it
// takes next while it computes on the current one, so memory and arithmetic overlap. At prefill sizes they are
// level with oneDNN (SmolLM2's and Llama-8B's layers, AMD Zen 5).
//
// A task is one stripe of the output (or, to keep both cores busy on a few stripes, half its rows): register tiles of 6
// rows x 64 columns (csrc/stripe_tile.h) walk k, each weight vector loaded once per tile and each row's pair of values
// broadcast. Over a long k the stripe is walked in blocks that stay in L2 for all of the task's rows, the sums kept in
// fp32 between blocks. Each output row's sums run in the same order whatever the batch: a row's result does not depend
// on the rows beside it. Rounding: fp32 sums, plus the bias, rounded to bf16 once.
//
// Gated (the MLP's [gate | up] projection, each half whole stripes): a task reads two weight stripes, computes a stripe
// of gate and the same stripe of up, and stores silu(gate) * up (vec_math.h's silu_times, on the two rounded to bf16 as
// the plain matmul stores them): the same bits as silu_and_mul of the plain matmul, without writing [gate | up] out and
// reading it back, which at prefill sizes (2048 rows x 3072 of SmolLM2's) costs as much as a fifth of the matmul.
#include "ops.h"
#include "stripe_tile.h"
#include "vec_math.h"

#if defined(__AVX512BF16__)
namespace {

using stripe_tile::kRows;
using stripe_tile::kStripe;
using stripe_tile::kVectors;
using stripe_tile::Prefetch;
using stripe_tile::tile_of;
constexpr int64_t kTaskRows = 192;  // at most this many rows per task: their fp32 sums (48 KB) stay in L2
constexpr int64_t kBlockK = 4096;   // k per pass over a stripe: 512 KB of it, in L2 for all the task's rows

struct Gemm {
  const uint16_t* x;
  int64_t lda, m, k;
  const uint16_t* w;  // [stripes, k_padded / 2, 64, 2]
  int64_t k_padded, n, stripes, row_blocks, rows_per_block;
  const float* bias;  // [n] or null ([2 n] where gated)
  uint16_t* y;        // [m, n]
  bool gated;         // w holds 2 x `stripes`: gate's, then up's; y = silu(x gate^T) * (x up^T)

  const uint16_t* block_of(int64_t stripe, int64_t k0) const { return w + (stripe * k_padded + k0) * kStripe; }

  // One task: output stripe `stripe`, rows [m0, m1). `next` is the task this thread runs after it (or -1).
  void run(int64_t stripe, int64_t m0, int64_t m1, int64_t next) const {
    alignas(64) float sums[kTaskRows * kStripe];
    const int64_t then = next < 0 ? -1 : next / row_blocks;  // the stripe read after this task's last
    if (!gated) {
      accumulate(stripe, m0, m1, sums, then);
      store(stripe, m0, m1, sums);
      return;
    }
    alignas(64) float up[kTaskRows * kStripe];
    accumulate(stripe, m0, m1, sums, stripes + stripe);
    accumulate(stripes + stripe, m0, m1, up, then);
    store_gated(stripe, m0, m1, sums, up);
  }

  // sums = rows [m0, m1) of x times stripe `stripe` of w, prefetching stripe `then`'s first block (-1: none) as it
  // walks the last.
  void accumulate(int64_t stripe, int64_t m0, int64_t m1, float* sums, int64_t then) const {
    const int64_t tiles = (m1 - m0 + kRows - 1) / kRows;
    for (int64_t k0 = 0; k0 < k; k0 += kBlockK) {
      const int64_t kb = std::min(kBlockK, k - k0);
      Prefetch pf = prefetch_after(stripe, k0, then, tiles * std::max<int64_t>(1, kb / 2));
      for (int64_t r = m0; r < m1; r += kRows)
        tile_of(std::min<int64_t>(kRows, m1 - r), x + r * lda + k0, lda, block_of(stripe, k0), kb, k0 == 0,
                sums + (r - m0) * kStripe, pf);
    }
  }

  // The block read after (stripe, k0): the stripe's next one, or stripe `then`'s first; spread over `steps`.
  Prefetch prefetch_after(int64_t stripe, int64_t k0, int64_t then, int64_t steps) const {
    Prefetch pf;
    int64_t k_next = k0 + kBlockK;
    if (k_next >= k) {
      if (then < 0) return pf;
      stripe = then;
      k_next = 0;
    }
    pf.base = reinterpret_cast<const char*>(block_of(stripe, k_next));
    pf.lines = (std::min(kBlockK, k_padded - k_next) / 2) * kStripe * 2 * sizeof(uint16_t) / 64;
    pf.per_step = (pf.lines + steps - 1) / steps;
    return pf;
  }

  // y[m0 .. m1)[stripe's columns] = sums + bias, rounded to bf16; the last stripe's columns past n are not stored.
  void store(int64_t stripe, int64_t m0, int64_t m1, const float* sums) const {
    const int64_t n0 = stripe * kStripe;
    for (int v = 0; v < kVectors; ++v) {
      const int64_t c = n0 + 16 * v;
      if (c >= n) break;
      const __mmask16 mask = first_lanes(n - c);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
      for (int64_t r = m0; r < m1; ++r) {
        const __m512 out = _mm512_add_ps(_mm512_loadu_ps(sums + (r - m0) * kStripe + 16 * v), b);
        _mm256_mask_storeu_epi16(y + r * n + c, mask, fp32_to_bf16(out));
      }
    }
  }

  // y[m0 .. m1)[stripe's columns] = silu(gate) * up, each of the two its sums plus its bias rounded to bf16 first.
  void store_gated(int64_t stripe, int64_t m0, int64_t m1, const float* gate, const float* up) const {
    const int64_t n0 = stripe * kStripe;
    for (int v = 0; v < kVectors; ++v) {
      const int64_t c = n0 + 16 * v;
      const __m512 gb = bias ? _mm512_loadu_ps(bias + c) : _mm512_setzero_ps();
      const __m512 ub = bias ? _mm512_loadu_ps(bias + n + c) : _mm512_setzero_ps();
      for (int64_t r = m0; r < m1; ++r) {
        const int64_t at = (r - m0) * kStripe + 16 * v;
        const __m512 g = bf16_to_fp32(fp32_to_bf16(_mm512_add_ps(_mm512_loadu_ps(gate + at), gb)));
        const __m512 u = bf16_to_fp32(fp32_to_bf16(_mm512_add_ps(_mm512_loadu_ps(up + at), ub)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + c), silu_times(g, u));
      }
    }
  }

  void operator()() const {
    const int64_t tasks = stripes * row_blocks;
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t m0 = (t % row_blocks) * rows_per_block;
        run(t / row_blocks, m0, std::min(m, m0 + rows_per_block), t + 1 < end ? t + 1 : -1);
      }
    });
  }
};

// Row blocks per stripe: enough that a block's sums fit `sums`, and two where the stripes alone would leave a core
// with one more stripe than the other (SmolLM2's 9 stripes of 576 columns: 5 and 4), if the rows fill two tiles.
int64_t row_blocks_for(int64_t m, int64_t stripes) {
  const int64_t blocks = (m + kTaskRows - 1) / kTaskRows;
  const int64_t threads = at::get_num_threads();
  return blocks == 1 && m >= 2 * kRows && stripes % threads ? 2 : blocks;
}

}  // namespace

at::Tensor linear_bf16_stripes(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               int64_t n, int64_t k, bool gated) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "linear_bf16_stripes takes bf16 x and weights");
  TORCH_CHECK(weight.dim() == 3 && weight.size(2) == kStripe && weight.size(1) % 2 == 0 && weight.is_contiguous(),
              "linear_bf16_stripes: weights as [N / 64, K (even), 64] stripes (pack_linear_weight)");
  // gated: the weights are [gate | up], 2 n rows of whole stripes, and y has n columns
  TORCH_CHECK(!gated || (n % kStripe == 0 && weight.size(0) % 2 == 0),
              "linear_bf16_stripes: gated weights are two halves of whole stripes; got n = ", n, " for ",
              weight.size(0), " stripes");
  const int64_t stripes = gated ? weight.size(0) / 2 : weight.size(0);
  const int64_t weight_rows = gated ? 2 * n : n;  // (and bias elements)
  TORCH_CHECK(x.size(-1) == k && weight.size(1) == k + k % 2 && n <= stripes * kStripe && n > (stripes - 1) * kStripe,
              "linear_bf16_stripes: x [.., ", x.size(-1), "] and weights [", weight_rows, ", ", k,
              "] do not match, or the weights' stripes ", weight.sizes(), " are not theirs");
  at::Tensor rows = x.reshape({-1, k});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t m = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == weight_rows, "linear_bf16_stripes: bias of ", bias->numel(), " for ", weight_rows,
                " outputs");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  if (m == 0) return y;
  const int64_t row_blocks = row_blocks_for(m, stripes);
  const int64_t rows_per_block = ((m + row_blocks - 1) / row_blocks + kRows - 1) / kRows * kRows;
  const Gemm gemm{reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>()), rows.stride(0), m, k,
                  reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), weight.size(1), n, stripes,
                  (m + rows_per_block - 1) / rows_per_block, rows_per_block,
                  bias32 ? bias32->data_ptr<float>() : nullptr,
                  reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), gated};
  gemm();
  return y;
}

bool has_linear_bf16_stripes() { return true; }

#else  // without AVX512-BF16 the weights stay in oneDNN's layout (or as they are): see pack_linear_weight

at::Tensor linear_bf16_stripes(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                               int64_t, bool) {
  TORCH_CHECK(false, "linear_bf16_stripes needs an AVX512-BF16 build");
}

bool has_linear_bf16_stripes() { return false; }

#endif
