// The kernels' entry points, for one another (step_layers.cpp calls the rest).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace llmq {

// window, softcap, sinks: none by default (see paged_decode.cpp's Features).
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t block_size, double scale, int64_t window = 0,
                            double softcap = 0.0,
                            const std::optional<at::Tensor>& sinks = std::nullopt);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor qk_norm(const at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                   int64_t heads, int64_t kv_heads, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor panel_matmul(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                        const std::optional<at::Tensor>& bias);
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                     int64_t out_features, const std::optional<at::Tensor>& bias);
at::Tensor q6_matmul(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                     int64_t out_features, const std::optional<at::Tensor>& bias);
bool int_matmul_available();
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                     int64_t out_features, const std::optional<at::Tensor>& bias);
// layout: packed_linear.LAYOUT_CODES' (plain, oneDNN's packed, llmq's panels) for float weights;
// a projection with scales is int8 or int4 (projections.cpp).
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                   const at::Tensor& scale, int64_t layout, int64_t out_features);
void lora_deltas(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                 at::IntArrayRef columns, const at::Tensor& scales, const at::Tensor& rows,
                 at::IntArrayRef groups, at::IntArrayRef ranks);

}  // namespace llmq
