// The experts of one MoE layer in one call (npu_llm_kernels/torch_ref.py fused_experts defines it): the (token, expert)
// pairs sorted by expert, each expert's gate/up matmul, silu(gate) * up, its down matmul, and the weighted sum back per
// token.
//
// Why a kernel: at decode an expert sees a few tokens, and torch_ref's per-expert loop spends more time issuing 64
// experts' small matmuls from Python than in them. Here the experts with few tokens are (expert, stripe of output
// columns) tasks of one parallel region. The weights are stored in stripes, [E, N / S, K, S] (pack_expert_weights in
// npu_llm_kernels/cpu.py; S = expert_stripe()), so that a task streams one contiguous block and computes outer
// products: each weight vector read once per tile of tokens, each token's value broadcast, no horizontal sums. An
// expert with many tokens (prefill) runs on AMX tiles where the CPU has them, through oneDNN's brgemm microkernel on
// the same packed stripes; in bf16 on AVX512-BF16 it stays on the tiles (level with oneDNN's matmul at a few hundred
// tokens, faster at a 2048-token chunk: npu_llm_kernels/cpu.py ONEDNN_EXPERT_TOKENS); in fp32 an expert with `big`
// tokens gets oneDNN's matmul, whose blocking beats these tiles there. Rounding follows torch_ref: matmul outputs and
// the activation are rounded to the dtype; the per-token sum is in fp32.
#include "ops.h"
#include "stripe_tile.h"
#include "vec_math.h"

#include <ATen/native/CPUBlas.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>

#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

namespace {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int64_t kWidth = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
#else
using vec = __m256;
constexpr int64_t kWidth = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
#endif

// A register tile: kTokens x kVectors accumulators, beside kVectors weight vectors and one broadcast. AVX-512's 32
// registers hold 4 x 4; AVX2's 16 hold 6 x 2 (4 x 4 would spill).
#if defined(__AVX512F__)
constexpr int64_t kTokens = 4;
constexpr int64_t kVectors = 4;
#else
constexpr int64_t kTokens = 6;
constexpr int64_t kVectors = 2;
#endif
constexpr int64_t kStripe = kVectors * kWidth;  // output columns per task
constexpr int64_t kOneDnnRows = 64;  // oneDNN's matmuls take rows in multiples of this

// y[m][n0 .. n0 + kStripe) = x[m] w[:, n0 .. n0 + kStripe) for M tokens: x [M, k] fp32 (row stride k), the
// stripe's weights `w` [k, kStripe], contiguous.
template <int M, typename T>
inline void tile(const float* x, const T* w, int64_t k, int64_t n, int64_t n0, T* y) {
  vec acc[M][kVectors];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < kVectors; ++v) acc[m][v] = vzero();
  for (int64_t c = 0; c < k; ++c) {
    const T* row = w + c * kStripe;
    vec wv[kVectors];
    for (int v = 0; v < kVectors; ++v) wv[v] = vload(row + v * kWidth);
    for (int m = 0; m < M; ++m) {
      const vec xm = vset(x[m * k + c]);
      for (int v = 0; v < kVectors; ++v) acc[m][v] = vfma(xm, wv[v], acc[m][v]);
    }
  }
  alignas(64) float out[kStripe];
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < kVectors; ++v) vstore(out + v * kWidth, acc[m][v]);
    for (int64_t i = 0; i < kStripe; ++i) y[m * n + n0 + i] = static_cast<T>(out[i]);  // rounds, as a matmul does
  }
}

#if defined(__AVX512BF16__)
// The bf16 stripe where the CPU has AVX512-BF16: weights in pairs of k ([k / 2, kStripe, 2] per stripe, see
// expert_layout()), in csrc/stripe_tile.h's register tiles (a model's linear layers run on them too); x stays bf16.
static_assert(kStripe == stripe_tile::kStripe, "the experts' stripes are the tiles' width");

void stripe_pairs(const at::BFloat16* x, int64_t m, const at::BFloat16* w, int64_t k, int64_t n, int64_t n0,
                  at::BFloat16* y) {
  alignas(64) float sums[stripe_tile::kRows * kStripe];
  stripe_tile::Prefetch none;  // (a task's stripe is read once, for all its tokens)
  const auto* weights = reinterpret_cast<const uint16_t*>(w);
  for (int64_t t = 0; t < m; t += stripe_tile::kRows) {
    const int64_t rows = std::min<int64_t>(stripe_tile::kRows, m - t);
    stripe_tile::tile_of(rows, reinterpret_cast<const uint16_t*>(x + t * k), k, weights, k, true, sums, none);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t v = 0; v < kVectors; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (t + r) * n + n0 + v * kWidth),
                            fp32_to_bf16(_mm512_load_ps(sums + r * kStripe + v * kWidth)));
  }
}

// The same stripe for an expert with many tokens, as oneDNN's batch-reduce GEMM microkernel (torch's cpublas::brgemm:
// AMX tiles where the CPU has them, else AVX512-BF16). The pairs layout is its packed ("VNNI") B, so the weights
// are used where they lie: rows go in blocks of kBrgemmRows, each [rows, kStripe] block of fp32 sums rounded to bf16.
constexpr int64_t kBrgemmRows = 32;

void stripe_brgemm(const at::BFloat16* x, int64_t m, const at::BFloat16* w, int64_t k, int64_t n, int64_t n0,
                   at::BFloat16* y) {
  alignas(64) float sums[kBrgemmRows * kStripe];
  for (int64_t t = 0; t < m; t += kBrgemmRows) {
    const int64_t rows = std::min(kBrgemmRows, m - t);
    at::native::cpublas::brgemm(rows, kStripe, k, k, kStripe, kStripe, false, x + t * k, w, sums, true);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t v = 0; v < kVectors; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (t + r) * n + n0 + v * kWidth),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + r * kStripe + v * kWidth)));
  }
}

constexpr bool kPairs = true;
#else
constexpr bool kPairs = false;
#endif

// tile<rows> for 1 <= rows <= M
template <int M, typename T>
inline void tile_of(int64_t rows, const float* x, const T* w, int64_t k, int64_t n, int64_t n0, T* y) {
  if constexpr (M > 1) {
    if (rows < M) return tile_of<M - 1>(rows, x, w, k, n, n0, y);
  }
  tile<M>(x, w, k, n, n0, y);
}

template <typename T>
void stripe(const float* x, int64_t m, const T* w, int64_t k, int64_t n, int64_t n0, T* y) {
  for (int64_t t = 0; t < m; t += kTokens)  // the stripe's weights: from memory once, then from cache
    tile_of<kTokens>(std::min(kTokens, m - t), x + t * k, w, k, n, n0, y + t * n);
}

// y [pairs, n] = x [pairs, k] w_e [k, n] for each expert's rows of x (w: [E, n / kStripe, k, kStripe]): the experts
// with fewer than `big` pairs in one parallel region of (expert, stripe, up to kTaskRows rows) tasks, then (fp32 only:
// bf16 experts take the tiles at every size) the others one oneDNN matmul each (parallel inside; their [k, n] weights
// are put back together first, a small copy beside the matmul). In pairs, experts with at least `brgemm_from` rows
// (0: none) take stripe_brgemm rather than the tiles.
constexpr int64_t kTaskRows = 128;  // a task's rows: a busy expert's stripe is split, so threads end together

template <typename T>
void experts_matmul(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& offsets, int64_t big,
                    int64_t brgemm_from, at::Tensor& y) {
  const int64_t experts = w.size(0), k = w.size(2), n = w.size(1) * kStripe;
  constexpr bool pairs = kPairs && std::is_same_v<T, at::BFloat16>;
  const at::Tensor xf = pairs ? x : x.to(at::kFloat);  // (FMA tiles broadcast from fp32: one instruction)
  const T* ws = w.data_ptr<T>();
  T* ys = y.data_ptr<T>();
  struct Task { int64_t expert, column, first, rows; };
  std::vector<Task> tasks;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = offsets[e + 1] - offsets[e];
    if (count > 0 && count < big)
      for (int64_t c = 0; c < n; c += kStripe)
        for (int64_t r = 0; r < count; r += kTaskRows)
          tasks.push_back({e, c, offsets[e] + r, std::min(kTaskRows, count - r)});
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    [[maybe_unused]] bool used_brgemm = false;
    for (int64_t i = begin; i < end; ++i) {
      const auto [e, c, first, count] = tasks[i];
      const T* stripe_w = ws + e * k * n + c * k;
#if defined(__AVX512BF16__)
      if constexpr (pairs) {
        const at::BFloat16* rows = xf.data_ptr<at::BFloat16>() + first * k;
        const int64_t expert_rows = offsets[e + 1] - offsets[e];
        if (brgemm_from > 0 && expert_rows >= brgemm_from) {
          stripe_brgemm(rows, count, stripe_w, k, n, c, ys + first * n);
          used_brgemm = true;
        } else {
          stripe_pairs(rows, count, stripe_w, k, n, c, ys + first * n);
        }
        continue;
      }
#endif
      stripe(xf.data_ptr<float>() + first * k, count, stripe_w, k, n, c, ys + first * n);
    }
#if defined(__AVX512BF16__)
    if (used_brgemm) at::native::cpublas::brgemm_release(true);  // (hands the AMX tile state back)
#endif
  });
  if constexpr (!std::is_same_v<T, float>) return;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = offsets[e], count = offsets[e + 1] - first;
    if (count < big) continue;
    const at::Tensor whole = w[e].permute({1, 0, 2}).reshape({k, n});  // [n / S, k, S] back to [k, n]
    // oneDNN builds a kernel for every new shape, which costs more than the matmul: the rows are padded to a
    // multiple of kOneDnnRows, so that a few shapes serve every step (its primitive cache keeps them).
    const int64_t padded = (count + kOneDnnRows - 1) / kOneDnnRows * kOneDnnRows;
    at::Tensor rows = at::zeros({padded, k}, x.options());
    rows.narrow(0, 0, count).copy_(x.narrow(0, first, count));
    y.narrow(0, first, count).copy_(at::matmul(rows, whole).narrow(0, 0, count));
  }
}

// out[t] = sum over t's pairs held here of weight * down[pair], in fp32, in the order of t's choices.
template <typename T>
at::Tensor combine(const at::Tensor& down, const at::Tensor& weights, const std::vector<int64_t>& slot,
                   int64_t tokens, int64_t top_k) {
  const int64_t hidden = down.size(1);
  at::Tensor out = at::zeros({tokens, hidden}, down.options().dtype(at::kFloat));
  const T* d = down.data_ptr<T>();
  const float* wt = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t s = slot[t * top_k + j];
        if (s < 0) continue;
        const vec scale = vset(static_cast<float>(static_cast<T>(wt[t * top_k + j])));  // (weights in the dtype)
        for (int64_t c = 0; c < hidden; c += kWidth)
          vstore(o + t * hidden + c, vfma(scale, vload(d + s * hidden + c), vload(o + t * hidden + c)));
      }
  });
  return out;
}

}  // namespace

at::Tensor fused_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t first_expert,
                         int64_t onednn_from, int64_t brgemm_from) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w13.is_contiguous() &&
                  w2.is_contiguous(),
              "contiguous x [T, H] and w13, w2 [E, N / S, K, S] (expert_stripe()'s S) expected");
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.size(3) == kStripe && w2.size(3) == kStripe,
              "w13 and w2 must be in stripes of ", kStripe, " columns");
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = w13.size(0), inter = w2.size(2);
  TORCH_CHECK(w13.size(2) == hidden && w13.size(1) * kStripe == 2 * inter && w2.size(0) == experts &&
                  w2.size(1) * kStripe == hidden,
              "w13 (H x 2I) and w2 (I x H) must agree with x");
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && w13.scalar_type() == w2.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x and the expert weights must share a dtype, float32 or bfloat16");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_weights.sizes() == topk_ids.sizes(),
              "topk_ids and topk_weights must be [T, k]");
  const int64_t top_k = topk_ids.size(1), pairs = tokens * top_k;
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();

  // Counting sort of the pairs held here by expert (stable: by token inside an expert); slot[p]: pair p's row.
  std::vector<int64_t> offsets(experts + 1, 0), slot(pairs, -1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = id[p] - first_expert;
    if (e >= 0 && e < experts) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  const int64_t held = offsets[experts];
  at::Tensor rows = at::empty({held}, ids.options());
  int64_t* row = rows.data_ptr<int64_t>();
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = id[p] - first_expert;
    if (e >= 0 && e < experts) {
      slot[p] = next[e];
      row[next[e]++] = p / top_k;
    }
  }

  TORCH_CHECK(onednn_from == 0 || x.scalar_type() == at::kFloat,
              "fused_experts: bf16 experts run on the tiles (or AMX's brgemm) at every size; onednn_from is for fp32");
  const int64_t big = onednn_from > 0 ? onednn_from : pairs + 1;  // fp32 experts with this many pairs: oneDNN
  const at::Tensor gathered = at::index_select(x, 0, rows);
  at::Tensor gate_up = at::empty({held, 2 * inter}, x.options());
  at::Tensor down = at::empty({held, hidden}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    experts_matmul<at::BFloat16>(gathered, w13, offsets, big, brgemm_from, gate_up);
    experts_matmul<at::BFloat16>(silu_and_mul(gate_up), w2, offsets, big, brgemm_from, down);
    return combine<at::BFloat16>(down, weights, slot, tokens, top_k).to(at::kBFloat16);
  }
  experts_matmul<float>(gathered, w13, offsets, big, 0, gate_up);
  experts_matmul<float>(silu_and_mul(gate_up), w2, offsets, big, 0, down);
  return combine<float>(down, weights, slot, tokens, top_k);
}

bool has_fused_experts() { return true; }
int64_t expert_stripe() { return kStripe; }
bool expert_pairs() { return kPairs; }

#else  // neither AVX-512 nor AVX2: torch_ref's per-expert loop takes these calls

at::Tensor fused_experts(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "fused_experts needs AVX2 and FMA, or AVX-512");
}

bool has_fused_experts() { return false; }
int64_t expert_stripe() { return 0; }
bool expert_pairs() { return false; }

#endif
