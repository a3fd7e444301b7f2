// The CPU extension's ops: kernels/cpu.py builds paged_attention_cpu.cpp, fused_ops_cpu.cpp and
// bindings.cpp into one module.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
std::vector<torch::Tensor> rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                                            torch::Tensor cos_sin_cache);
