// The elementwise glue of a decoder layer, one call each, for steps of few tokens.
//
// A lone stream's decode step spent a large part of its time in ~1,000 small torch ops called
// from Python, each costing more than its arithmetic (docs/performance.md): transformers'
// RMSNorm is seven of them, the rotary embedding nine. Each op here does the same arithmetic as the
// torch ops it replaces, rounding to the model's dtype where they do, so a bfloat16 step
// differs from the torch path only in the order of a float32 sum (the norm's mean of squares).
// Rows split across torch's threads once there are enough of them; sums and exp vectorized.

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace {

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// transformers' RMSNorms: float32 statistics. A weight of the activations' dtype (Llama's): scaled
// in float32, cast back, then times the weight in the model's dtype. A float32 weight (Gemma's,
// which holds 1 + weight): scaled and weighted in float32, cast back once.
template <typename T, typename W>
void rms_norm_rows(const T* x, const W* weight, T* out, int64_t rows, int64_t width, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * width;
    T* o = out + r * width;
    llmq::Vec acc(0.0f);
    int64_t i = 0;
    for (; i + llmq::kWidth <= width; i += llmq::kWidth) {
      const llmq::Vec v = llmq::load_float(xr + i);
      acc = at::vec::fmadd(v, v, acc);
    }
    float squares = llmq::sum_lanes(acc);
    for (; i < width; ++i) squares += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
    for (i = 0; i < width; ++i) {
      if constexpr (std::is_same_v<T, W>) {
        const T scaled = round_to<T>(static_cast<float>(xr[i]) * inv);
        o[i] = round_to<T>(static_cast<float>(weight[i]) * static_cast<float>(scaled));
      } else {
        const float scaled = static_cast<float>(xr[i]) * inv;
        o[i] = round_to<T>(scaled * static_cast<float>(weight[i]));
      }
    }
  }
}

// One row's norm with the weight of either kind (see rms_norm_rows).
template <typename T>
void norm_rows(const T* x, const at::Tensor& weight, T* out, int64_t rows, int64_t width,
               float eps) {
  if (weight.scalar_type() == at::kFloat && !std::is_same_v<T, float>) {
    rms_norm_rows<T, float>(x, weight.const_data_ptr<float>(), out, rows, width, eps);
  } else {
    rms_norm_rows<T, T>(x, weight.const_data_ptr<T>(), out, rows, width, eps);
  }
}

// q * cos + rotate_half(q) * sin over heads [rows, heads, dim], cos and sin [rows, dim]; each
// product and the sum rounded to the dtype, as three torch ops would.
template <typename T>
void rotary_rows(const T* x, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads,
                 int64_t dim, int64_t row_stride) {
  const int64_t half = dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + r * dim;
    const T* s = sin + r * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + r * row_stride + h * dim;
      T* o = out + (r * heads + h) * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float rotated =
            i < half ? -static_cast<float>(xh[i + half]) : static_cast<float>(xh[i - half]);
        const T a = round_to<T>(static_cast<float>(xh[i]) * static_cast<float>(c[i]));
        const T b =
            round_to<T>(static_cast<float>(round_to<T>(rotated)) * static_cast<float>(s[i]));
        o[i] = round_to<T>(static_cast<float>(a) + static_cast<float>(b));
      }
    }
  }
}

// silu(gate) * up, gate and up the two halves of each row of [rows, 2 * width]. silu as
// torch's vectorized kernel computes it (x / (1 + exp(-x)) with ATen's exp), rounded to the
// dtype, then times up.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  std::vector<float> act(width);
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * width;
    const T* u = g + width;
    T* o = out + r * width;
    int64_t i = 0;
    for (; i + llmq::kWidth <= width; i += llmq::kWidth) {
      const llmq::Vec x = llmq::load_float(g + i);
      (x / (llmq::Vec(1.0f) + x.neg().exp())).store(act.data() + i);
    }
    for (; i < width; ++i) {
      const float x = static_cast<float>(g[i]);
      act[i] = x / (1.0f + std::exp(-x));
    }
    for (i = 0; i < width; ++i) {
      o[i] = round_to<T>(static_cast<float>(round_to<T>(act[i])) * static_cast<float>(u[i]));
    }
  }
}

// Rows split across torch's threads where each thread gets at least ~16k elements of work.
template <typename F>
void over_rows(int64_t rows, int64_t row_elements, const F& body) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elements, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { body(begin, end - begin); });
}

// clang-format off
#define LLMQ_DISPATCH(dtype, CALL)                                       \
  switch (dtype) {                                                       \
    case at::kFloat: { using T = float; CALL; break; }                   \
    case at::kBFloat16: { using T = c10::BFloat16; CALL; break; }        \
    case at::kHalf: { using T = c10::Half; CALL; break; }                \
    default: TORCH_CHECK(false, "llmq small-step ops: float32, bfloat16 or float16"); \
  }
// clang-format on

}  // namespace

namespace llmq {

static void check_norm_weight(const at::Tensor& x, const at::Tensor& weight, int64_t width,
                       const char* name) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == width &&
                  (weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat),
              name, ": a weight of the width, in the activations' dtype or float32");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: [rows, width]");
  check_norm_weight(x, weight, x.size(1), "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  LLMQ_DISPATCH(x.scalar_type(), over_rows(x.size(0), x.size(1), [&](int64_t first, int64_t n) {
                  norm_rows<T>(x.const_data_ptr<T>() + first * x.size(1), weight,
                               out.mutable_data_ptr<T>() + first * x.size(1), n, x.size(1),
                               static_cast<float>(eps));
                }))
  return out;
}

// Qwen 3's and Gemma 3's norms of each query and key head: qkv [rows, >= heads + kv_heads,
// dim] (a packed qkv row: queries, keys, values), each query head normed with q_weight, each key
// head with k_weight (as rms_norm takes them). Returns a new [rows, heads + kv_heads, dim].
at::Tensor qk_norm(const at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                   int64_t heads, int64_t kv_heads, double eps) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2) &&
                  qkv.size(1) >= heads + kv_heads,
              "qk_norm: qkv [rows, heads, dim] with contiguous heads");
  const int64_t rows = qkv.size(0), dim = qkv.size(2), width = heads + kv_heads;
  check_norm_weight(qkv, q_weight, dim, "qk_norm");
  check_norm_weight(qkv, k_weight, dim, "qk_norm");
  at::Tensor out = at::empty({rows, width, dim}, qkv.options());
  LLMQ_DISPATCH(qkv.scalar_type(), over_rows(rows, width * dim, [&](int64_t first, int64_t n) {
                  for (int64_t r = first; r < first + n; ++r) {
                    const T* in = qkv.const_data_ptr<T>() + r * qkv.stride(0);
                    T* o = out.mutable_data_ptr<T>() + r * width * dim;
                    norm_rows<T>(in, q_weight, o, heads, dim, static_cast<float>(eps));
                    norm_rows<T>(in + heads * dim, k_weight, o + heads * dim, kv_heads, dim,
                                 static_cast<float>(eps));
                  }
                }))
  return out;
}

// x [rows, >= heads, dim] (rows may be strided: the first heads of a packed qkv row), cos and
// sin [rows, dim]: a new [rows, heads, dim].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(1) >= heads,
              "rotary: x [rows, heads, dim] with contiguous heads");
  const int64_t rows = x.size(0), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == rows * dim && sin.numel() == rows * dim &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos and sin [rows, dim]");
  at::Tensor out = at::empty({rows, heads, dim}, x.options());
  LLMQ_DISPATCH(x.scalar_type(), over_rows(rows, heads * dim, [&](int64_t first, int64_t n) {
                  rotary_rows<T>(
                      x.const_data_ptr<T>() + first * x.stride(0),
                      cos.const_data_ptr<T>() + first * dim, sin.const_data_ptr<T>() + first * dim,
                      out.mutable_data_ptr<T>() + first * heads * dim, n, heads, dim, x.stride(0));
                }))
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: [rows, 2 * width]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  LLMQ_DISPATCH(gate_up.scalar_type(), over_rows(rows, 2 * width, [&](int64_t first, int64_t n) {
                  silu_mul_rows<T>(gate_up.const_data_ptr<T>() + first * 2 * width,
                                   out.mutable_data_ptr<T>() + first * width, n, width);
                }))
  return out;
}

}  // namespace llmq

TORCH_LIBRARY_FRAGMENT(llmq, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("qk_norm(Tensor qkv, Tensor q_weight, Tensor k_weight, int heads, int kv_heads, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &llmq::rms_norm);
  m.impl("qk_norm", c10::DispatchKey::CPU, &llmq::qk_norm);
  m.impl("rotary", c10::DispatchKey::CPU, &llmq::rotary);
  m.impl("silu_mul", c10::DispatchKey::CPU, &llmq::silu_mul);
}
