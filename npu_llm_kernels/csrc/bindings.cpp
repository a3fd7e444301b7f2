// The Python module of the CPU extension (see ops.h). pybind.h is the part of <torch/python.h> that
// converts tensors (half its parse time); a pybind call costs ~3 us less than one through torch.ops.
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

namespace {
// The ISA this module was compiled for, as npu_llm_kernels/cpu_features.py names the builds: npu_llm_kernels/cpu.py
// uses a module only where this agrees with the level it asked for.
const char* compiled_isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#elif defined(__x86_64__)
  return "x86_64";
#elif defined(__aarch64__)
  return "aarch64";
#else
  return "portable";
#endif
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL, as torch's own ops do: the serving threads beside the engine (Triton's
  // response sender, the request loop) would otherwise wait for the end of each kernel (docs/performance.md).
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("compiled_isa", &compiled_isa, "the ISA this module was compiled for");
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", no_gil);
  m.def("prefill_attention", &prefill_attention, "causal prefill attention of one sequence, bf16 (AVX512-BF16)",
        no_gil);
  m.def("has_prefill_attention", &has_prefill_attention, "whether this build has prefill_attention");
  m.def("reshape_and_cache", &reshape_and_cache, "write new K/V rows into their cache slots, in place", no_gil);
  m.def("rms_norm", &rms_norm, "RMSNorm, fused", no_gil);
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm, fused; returns (normed, summed)", no_gil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [.., gate | up], fused", no_gil);
  m.def("lora_add", &lora_add, "batched LoRA: each segment's rows plus x A^T B^T, in place", no_gil);
  m.def("linear_bf16_weights", &linear_bf16_weights, "a few rows times bf16 weights, in fp32 (AVX2)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(), no_gil);
  m.def("has_linear_bf16_weights", &has_linear_bf16_weights, "whether this build has linear_bf16_weights");
  m.def("linear_bf16_stripes", &linear_bf16_stripes, "x times bf16 weights packed in stripes of pairs (AVX512-BF16)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("n"),
        pybind11::arg("k"), pybind11::arg("gated") = false, no_gil);
  m.def("has_linear_bf16_stripes", &has_linear_bf16_stripes, "whether this build has linear_bf16_stripes");
  m.def("linear_int8_weights", &linear_int8_weights, "W8A8: x quantized to int8, times int8 weights (AVX2)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("weight_scale"),
        pybind11::arg("input_scale") = pybind11::none(), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("input_offset") = pybind11::none(), no_gil);
  m.def("quantize_rows_u8", &quantize_rows_u8, "x's rows quantized to int8, as q + 128 in uint8: (q, scales) (AVX2)",
        pybind11::arg("x"), pybind11::arg("input_scale") = pybind11::none(),
        pybind11::arg("input_offset") = pybind11::none(), no_gil);
  m.def("scale_int8_sums", &scale_int8_sums, "an int8 GEMM's sums times each row's scale, plus the bias (AVX2)",
        pybind11::arg("sums"), pybind11::arg("row_scales"), pybind11::arg("bias"), pybind11::arg("bf16"), no_gil);
  m.def("has_linear_int8_weights", &has_linear_int8_weights, "whether this build has linear_int8_weights");
  m.def("linear_w8a16", &linear_w8a16, "W8A16: a few rows times int8 weights dequantized in the inner loop (AVX2)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("weight_scale"),
        pybind11::arg("weight_offset") = pybind11::none(), pybind11::arg("bias") = pybind11::none(), no_gil);
  m.def("has_linear_w8a16", &has_linear_w8a16, "whether this build has linear_w8a16");
  m.def("dequantize_int8", &dequantize_int8, "int8 weights [N, K] as (q + offset) * scale, in bf16 or fp32",
        pybind11::arg("weight"), pybind11::arg("weight_scale"), pybind11::arg("weight_offset"), pybind11::arg("bf16"),
        no_gil);
  m.def("fused_experts", &fused_experts, "a MoE layer's experts on tokens sorted by expert, combined per token",
        no_gil);
  m.def("has_fused_experts", &has_fused_experts, "whether this build has fused_experts");
  m.def("expert_stripe", &expert_stripe, "the columns of one stripe of fused_experts' weights");
  m.def("expert_pairs", &expert_pairs, "whether fused_experts' bf16 weights go in pairs of k");
  m.def("rotary_embedding", &rotary_embedding, "neox rotary embedding of query and key; returns new tensors", no_gil);
}
