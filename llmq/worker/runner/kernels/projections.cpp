// A step's projections, as packed_linear.Linear and quantized_linear's Int8Linear and Int4Linear
// compute them (step_layers.cpp calls them for every layer): float weights in llmq's panels,
// packed for oneDNN or plain; int8, int6 and int4 weights on llmq's integer kernels or torch's
// weight-only ones.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/add.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/linear.h>

#include <optional>
#include <string>

#include "ops.h"

namespace {

bool given(const at::Tensor& t) { return t.defined() && t.numel(); }

std::optional<at::Tensor> bias_of(const at::Tensor& b) {
  return given(b) ? std::optional<at::Tensor>(b) : std::nullopt;
}

// packed_linear.padded_rows: the row counts oneDNN's packed matmul runs (each one a primitive it
// builds and keeps), up to 16 as they are, above in four steps per doubling.
int64_t padded_rows(int64_t rows) {
  if (rows <= 16) return rows;
  int64_t bits = 0;
  for (int64_t r = rows - 1; r > 0; r >>= 1) ++bits;
  const int64_t step = int64_t{1} << (bits - 3);
  return (rows + step - 1) / step * step;
}

// packed_linear.LAYOUT_CODES: how a step's projection weights are held.
enum Layout : int64_t { kPlain = 0, kOneDnn = 1, kPanels = 2 };

at::Tensor project_float(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                         int64_t layout, int64_t out_features) {
  if (layout == kPanels) return llmq::panel_matmul(x, w, out_features, bias_of(b));
  if (layout == kPlain) return at::linear(x, w, bias_of(b));
  const int64_t rows = x.size(0), padded = padded_rows(rows);
  if (padded != rows) {
    return project_float(at::constant_pad_nd(x, {0, 0, 0, padded - rows}), w, b, layout,
                         out_features)
        .narrow(0, 0, rows);
  }
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(bias_of(b));
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::optional<std::string>(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// A quantized projection, as quantized_linear.Int8Linear and Int4Linear run it: in llmq's
// panels through q4_matmul or q8_matmul (x as it is, the bias held in float32); else the rows
// in bfloat16 (int8: zero columns up to the weight's padded width) through torch's weight-only
// kernel, the output cut to its width (int4 pads it), back to x's dtype, then the bias.
at::Tensor project_quantized(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                             const at::Tensor& scale, int64_t out_features) {
  if (w.dim() == 5) {  // llmq's panels: [P, K / 32, 4 (int4), 6 (int6) or 8 (int8), 16, 4]
    if (w.size(2) == 4) return llmq::q4_matmul(x, w, scale, out_features, bias_of(b));
    if (w.size(2) == 6) return llmq::q6_matmul(x, w, scale, out_features, bias_of(b));
    return llmq::q8_matmul(x, w, scale, out_features, bias_of(b));
  }
  at::Tensor a = x.to(at::kBFloat16);
  at::Tensor y;
  if (w.scalar_type() == at::kChar) {  // int8 [N, K padded]
    if (w.size(1) != a.size(1)) a = at::constant_pad_nd(a, {0, w.size(1) - a.size(1)});
    y = at::_weight_int8pack_mm(a.contiguous(), w, scale);
  } else {  // int4, packed; scales and zeros [K / group, N, 2]
    a = a.contiguous();
    y = at::_weight_int4pack_mm_for_cpu(a, w, a.size(1) / scale.size(0), scale);
    if (y.size(1) != out_features) y = y.narrow(1, 0, out_features);
  }
  y = y.to(x.scalar_type());
  return given(b) ? at::add(y, b) : y;
}

// A projection of x: quantized where it has scales, else its float weights in `layout`.
}  // namespace

namespace llmq {

at::Tensor project(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                   const at::Tensor& scale, int64_t layout, int64_t out_features) {
  if (given(scale)) return project_quantized(x, w, b, scale, out_features);
  return project_float(x, w, b, layout, out_features);
}

}  // namespace llmq
