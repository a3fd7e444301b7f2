// Writes a step's new K/V rows into their cache slots. Semantics: npu_llm_kernels/torch_ref.py::reshape_and_cache.
//
// The slots of a decode step lie anywhere in a cache far larger than the CPU's caches, so each write waits
// on memory; index_copy_ issued them one after another (about 75 us per layer for 64 tokens in a 4 GiB
// cache). Plain copies split over the threads keep many writes in flight at once.
#include "ops.h"

#include <ATen/Parallel.h>

namespace {

void check_rows(const at::Tensor& rows, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == cache.size(2) && rows.size(2) == cache.size(3), name,
              " must be [tokens, num_kv_heads, head_dim] of the cache's heads");
  TORCH_CHECK(rows.stride(2) == 1 && (rows.size(1) == 1 || rows.stride(1) == rows.size(2)), "each token's ", name,
              " heads must be contiguous");
  TORCH_CHECK(rows.scalar_type() == cache.scalar_type(), name, " and its cache must share a dtype");
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  check_rows(key, key_cache, "key");
  check_rows(value, value_cache, "value");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t tokens = key.size(0), capacity = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(value.size(0) == tokens && slots.numel() == tokens, "one slot per token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " outside the cache's ", capacity);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  auto* k_cache = static_cast<char*>(key_cache.data_ptr());
  auto* v_cache = static_cast<char*>(value_cache.data_ptr());
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(k_cache + slot[t] * row_bytes, k + t * k_stride, row_bytes);
      std::memcpy(v_cache + slot[t] * row_bytes, v + t * v_stride, row_bytes);
    }
  });
}
