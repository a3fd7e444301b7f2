// The CPU extension's ops: npu_llm_kernels/cpu.py builds the .cpp files of this folder into one module.
//
// Only the headers the kernels use: <torch/extension.h> (all of torch, pybind11 and Python) takes
// about 40 s to parse per file on a 2-core machine, these about 3, and the build runs at first start.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <optional>
#include <vector>

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);
// The AVX-512 decode kernel, where this CPU and the arguments allow it (fp32/bf16, head dim 64 or 128): writes
// `out` and returns true; false leaves the call to the portable kernel.
bool paged_decode_attention_avx512(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, float scale);
// Causal prefill attention of one sequence, bf16 (csrc/prefill_attention_avx512.cpp): q [q_len, heads, D] are the
// last q_len of the ctx tokens of k [ctx, kv_heads, D] and v [ctx, kv_heads, Dv]; returns [q_len, heads, Dv].
// AVX512-BF16 builds only (has_prefill_attention says whether this build has it).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
bool has_prefill_attention();
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                     double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                         const at::Tensor& cos_sin_cache);
// x [.., K] (at most 4 rows) times bf16 weight [N, K]^T (+ bias), in fp32, rounded to bf16 once; AVX2 builds only
// (has_linear_bf16_weights says whether this build has it).
// Batched LoRA (csrc/lora_cpu.cpp): y[start:end] += (x[start:end] shrink^T) expand_t for each segment (bounds holds
// start, end pairs), in place; x [T, K] and y [T, N] fp32 or bf16, shrink [w, K] and expand_t [w, N] fp32.
void lora_add(at::Tensor& y, const at::Tensor& x, const std::vector<int64_t>& bounds,
              const std::vector<at::Tensor>& shrinks, const std::vector<at::Tensor>& expands);
at::Tensor linear_bf16_weights(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
bool has_linear_bf16_weights();
// x [.., k] bf16 times bf16 weights [n, k] packed in stripes ([n / 64, k rounded up to even, 64], k in pairs:
// csrc/linear_bf16_avx512.cpp) (+ bias, bf16 or fp32), in fp32, rounded to bf16 once; AVX512-BF16 builds only
// (has_linear_bf16_stripes says whether this build has it). gated: the weights are the MLP's [gate | up] (2 n rows,
// n a multiple of 64) and y [.., n] is silu_and_mul of that matmul's output.
at::Tensor linear_bf16_stripes(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               int64_t n, int64_t k, bool gated = false);
bool has_linear_bf16_stripes();
// W8A8: x [.., K] (fp32 or bf16; K a multiple of 16) quantized to int8 per row (or with input_scale [1] and
// input_offset [1]) times int8 weight [N, K]^T with per-channel weight_scale [N, 1] (+ bias), exact int32 sums; the
// output in x's dtype (npu_llm_kernels/torch_ref.py int8_linear). AVX2 builds only (has_linear_int8_weights says
// whether this one has it).
at::Tensor linear_int8_weights(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                               const std::optional<at::Tensor>& input_scale, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& input_offset);
bool has_linear_int8_weights();
// The ends of a W8A8 matmul whose middle is oneDNN's int8 GEMM (same builds): x's rows quantized to int8, stored
// q + 128 in uint8 ([M, K], and the scales [M]); and the GEMM's fp32 sums times each row's scale, plus the bias.
std::tuple<at::Tensor, at::Tensor> quantize_rows_u8(const at::Tensor& x, const std::optional<at::Tensor>& input_scale,
                                                    const std::optional<at::Tensor>& input_offset);
at::Tensor scale_int8_sums(const at::Tensor& sums, const at::Tensor& row_scales, const std::optional<at::Tensor>& bias,
                           bool bf16);
// W8A16 (csrc/linear_w8a16.cpp): a few rows of x (fp32 or bf16) times int8 weights [N, K] dequantized in the inner
// loop, with fp32 scales [N, G] and per-channel offsets [N, 1] (AVX2 builds; has_linear_w8a16 says); and a block of
// those weights dequantized to fp32 or bf16, for a matmul library (every build).
at::Tensor linear_w8a16(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                        const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& bias);
bool has_linear_w8a16();
at::Tensor dequantize_int8(const at::Tensor& weight, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                           bool bf16);
// The experts of a MoE layer (npu_llm_kernels/torch_ref.py fused_experts), x and weights fp32 or bf16, the weights in
// stripes of expert_stripe() columns ([E, N / S, K, S]); fp32 experts with at least `onednn_from` tokens (0: none; bf16
// takes 0) run their matmuls through oneDNN's matmul, bf16 ones with at least `brgemm_from` (0: none; pairs builds)
// through its brgemm microkernel on the packed weights. has_fused_experts: whether this build has it.
at::Tensor fused_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t first_expert,
                         int64_t onednn_from, int64_t brgemm_from);
bool has_fused_experts();
int64_t expert_stripe();
// Whether bf16 weights go in pairs of k inside a stripe ([N / S, K / 2, S, 2]: AVX512-BF16 builds).
bool expert_pairs();
