// What the paged decode kernels share (paged_decode.cpp: the pool in the model's dtype;
// paged_decode_q8.cpp: 8-bit codes and scales): the shapes, a layer's features, the softmax
// over a task's scores and the check of the tables.
#pragma once

#include "vec.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

namespace llmq::paged {

constexpr int64_t kMaxChunks = 512 / kWidth;  // head_dim up to 512
constexpr int64_t kParallelKeys = 512;

struct Shape {
  int64_t group;     // query heads per KV head
  int64_t head_dim;  // a multiple of kWidth
  int64_t block_size;
  int64_t kv_heads;
  int64_t max_blocks;  // columns of the block table
};

struct Features {
  int64_t window = 0;            // > 0: the query (at context - 1) sees the last `window` keys
  float softcap = 0.0f;          // > 0: scores become softcap * tanh(scores / softcap)
  const float* sinks = nullptr;  // [Hq] float32: a logit a head, in the denominator only
};

// The first key a query at position context - 1 sees: transformers' kv_idx > q_idx - window.
inline int64_t first_key(int64_t context, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, context - window) : 0;
}

// Each query head's scores [G, n] -> exp(score - max), and the reciprocal of their sum: after
// the softcap, with the head's sink taking part in the max and the sum (as the models' eager
// attention does), its own probability dropped.
inline void softmax_rows(float* scores, int64_t n, int64_t G, float softcap, const float* sinks,
                         float* inv_sum) {
  const Vec cap(softcap);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    if (softcap > 0.0f) at::vec::map([cap](Vec x) { return (x / cap).tanh() * cap; }, sg, sg, n);
    float top = at::vec::reduce_all<float>(
        [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, sg, n);
    if (sinks != nullptr) top = std::max(top, sinks[g]);
    at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, sg, sg, n);
    float sum = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sg, n);
    if (sinks != nullptr) sum += std::exp(sinks[g] - top);
    inv_sum[g] = 1.0f / sum;
  }
}

// The keys the tasks will read (blocks checked: in the pool; contexts: within their tables).
inline int64_t keys_read(const int32_t* table, const int32_t* ctx, int64_t n, int64_t blocks,
                         const Shape& s, int64_t window) {
  int64_t keys = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ctx[i] >= 1 && ctx[i] <= s.max_blocks * s.block_size,
                "paged_decode_attention: context length out of its table");
    const int32_t* row = table + i * s.max_blocks;
    const int64_t first = first_key(ctx[i], window);
    for (int64_t b = first / s.block_size; b < (ctx[i] + s.block_size - 1) / s.block_size; ++b) {
      TORCH_CHECK(row[b] >= 0 && row[b] < blocks, "paged_decode_attention: block out of the pool");
    }
    keys += ctx[i] - first;
  }
  return keys;
}

// The arguments' checks both kernels make; the Shape they describe. out [n, Hq, D] (head rows
// contiguous), query [n, Hq, D] (last dim contiguous), kv [2 * Hkv, slots, D].
inline Shape checked_shape(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           int64_t block_size, int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && kv.dim() == 3, "paged_decode_attention: ranks");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "paged_decode_attention: head rows must be contiguous");
  TORCH_CHECK(kv.is_contiguous() && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_attention: kv and tables must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "paged_decode_attention: int32 tables");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "paged_decode_attention: out's dtype");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) &&
                  context_lens.numel() == query.size(0) && out.size(0) == query.size(0),
              "paged_decode_attention: a table row and a context a sequence");
  const int64_t heads = query.size(1), kv_heads = kv.size(0) / 2;
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && kv.size(2) == query.size(2) &&
                  out.size(1) == heads && out.size(2) == query.size(2),
              "paged_decode_attention: heads");
  TORCH_CHECK(query.size(2) % kWidth == 0 && query.size(2) <= 512,
              "paged_decode_attention: head_dim");
  TORCH_CHECK(block_size > 0 && kv.size(1) % block_size == 0,
              "paged_decode_attention: whole blocks");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_decode_attention: window, softcap >= 0");
  return Shape{heads / kv_heads, query.size(2), block_size, kv_heads, block_tables.size(1)};
}

// A layer's features; its sinks converted to float32 into `sinks_f`, which must outlive them.
inline Features features_of(int64_t window, double softcap, const std::optional<at::Tensor>& sinks,
                            int64_t heads, at::Tensor& sinks_f) {
  Features f{window, static_cast<float>(softcap), nullptr};
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == heads, "paged_decode_attention: one sink a query head");
    sinks_f = sinks->to(at::kFloat).contiguous();
    f.sinks = sinks_f.const_data_ptr<float>();
  }
  return f;
}

}  // namespace llmq::paged
