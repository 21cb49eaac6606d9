// The elementwise glue of a decoder layer, one call each, for steps of few tokens.
//
// A lone stream's decode step on 2 cores spent about 3.5 ms of its 9.5 in ~1,000 small torch
// ops called from Python (3-4 us each, for microseconds of arithmetic): transformers' RMSNorm
// is seven of them, the rotary embedding nine. Each op here does the same arithmetic as the
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
#include <vector>

#include "ops.h"

namespace {

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// transformers' LlamaRMSNorm: float32 statistics, scaled in float32, cast back, then times the
// weight in the model's dtype.
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t width, float eps) {
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
      const T scaled = round_to<T>(static_cast<float>(xr[i]) * inv);
      o[i] = round_to<T>(static_cast<float>(weight[i]) * static_cast<float>(scaled));
    }
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

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(),
              "rms_norm: [rows, width]");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight");
  at::Tensor out = at::empty(x.sizes(), x.options());
  LLMQ_DISPATCH(x.scalar_type(), over_rows(x.size(0), x.size(1), [&](int64_t first, int64_t n) {
                  rms_norm_rows<T>(x.const_data_ptr<T>() + first * x.size(1),
                                   weight.const_data_ptr<T>(),
                                   out.mutable_data_ptr<T>() + first * x.size(1), n, x.size(1),
                                   static_cast<float>(eps));
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
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &llmq::rms_norm);
  m.impl("rotary", c10::DispatchKey::CPU, &llmq::rotary);
  m.impl("silu_mul", c10::DispatchKey::CPU, &llmq::silu_mul);
}
