// The Python module of the CPU extension (see ops.h). pybind.h is the part of <torch/python.h> that
// converts tensors (half its parse time); a pybind call costs ~3 us less than one through torch.ops.
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("reshape_and_cache", &reshape_and_cache, "write new K/V rows into their cache slots, in place");
  m.def("rms_norm", &rms_norm, "RMSNorm, fused");
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm, fused; returns (normed, summed)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [.., gate | up], fused");
  m.def("rotary_embedding", &rotary_embedding, "neox rotary embedding of query and key; returns new tensors");
}
