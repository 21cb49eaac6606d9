// int4 and int8 projections (W4A8, W8A8) with integer dot products, as llama.cpp runs its
// quantized types on CPUs: the activations quantized per row to int8 in blocks of 32 (one float
// scale each; by default in two terms, the residual quantized again: int_common.h's
// activation_terms), every weight multiplied with them by vpdpbusd on AVX512-VNNI (64 products an
// instruction, unsigned weights by signed activations) or vpmaddubsw + vpmaddwd on AVX2
// (int_lanes.h), and each block's integer sum scaled in float32 once (what the integer kernels
// share: int_common.h; 6-bit weights: int6_matmul.cpp).
//
// int8 (q8_matmul): weights as quantized_linear.Int8Weight holds them, w = q * scale per group of
// 32 inputs (float16, as llama.cpp's Q8_0) or per output column (float32: a checkpoint's), q in
// -127..127, stored q + 128 (unsigned) in panels [P][K / 32][8][16][4]: one 64-byte load gives
// each of 16 columns 4 inputs. Block b of column n adds
// d * scale * (sum((q + 128) * xq) - 128 * sum(xq)), the bracket exact in int32 (on AVX2,
// d * scale * sum(q * xq) directly: kQ8Bias). With a minimum per group (quantized_weights.
// Int8Groups: w = scale * u + base, u in 0..255 stored as it is, float16 scale and base), block
// b adds d * (scale * sum(u * xq) + base * sum(xq)), as int4's.
//
// int4 (q4_matmul): w = scale * q + base per group of 32 input columns (q in 0..15), in panels
// of 16 output columns (quantized_linear.q4_panels): [P][K / 32][4][16][4] bytes, each byte two
// q's, so that one 64-byte load gives every column of a panel 8 inputs: its low nibbles inputs
// k..k+3, its high ones k+4..k+7. A group's scale and base come in one of two forms:
// - a checkpoint's (quantized_weights.Int4Weight): scale and zero bfloat16 [P][K / 32][2][16],
//   base = zero - 8 * scale (5 bits a weight);
// - k-quant blocks (quantized_weights.Int4Blocks, as llama.cpp's Q4_K holds them, with 8-bit
//   codes where Q4_K has 6): super-blocks of 8 groups [P][ceil(K / 256)][320 bytes], a float16
//   d and m step for each of 16 columns, then each group's scale codes (uint8 [8][16]) and base
//   codes (int8 [8][16]): scale = d * sc, base = m_step * m (4.625 bits a weight);
// - float16 scale and base (quantized_weights.Int4Groups: GGUF's Q4_1, d and m as its file holds
//   them) [P][K / 32][2][16] (5 bits a weight).
//
// For a row x quantized as x ~ d * xq per block (d = max|x| / 127, xq in -127..127), group g
// of column n adds  d * (scale * sum(xq * q) + base * sum(xq)):  exactly
// dequantize(xq) @ dequantize(W).T up to float32 rounding. A row's output does not depend on the
// other rows of the call.
//
// torch's weight-only kernels dequantize every weight to float for each row; these multiply the
// codes directly, so batches of rows run several times faster (docs/performance.md).

#include "int_common.h"  // first: vec.h sets the ISA ATen's headers compile for

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <type_traits>

namespace llmq {
namespace {

#if defined(LLMQ_INT_MATMUL)
using namespace lanes;  // NOLINT: the kernels below are written in its lanes

// An int4 panel's scales as a checkpoint's: bfloat16 scale and zero [K / 32][2][16].
struct Bf16Groups {
  const uint8_t* bytes;
  // Group g's scale and base (the value of q = 0) for each of the 16 columns.
  void at(int64_t g, Floats& scale, Floats& base) const {
    const auto* sz = reinterpret_cast<const uint16_t*>(bytes) + g * 2 * kCols;
    scale = load_bf16(sz);
    base = fnmadd(floats(8.0f), scale, load_bf16(sz + kCols));
  }
};

// Rows [0, R) of the quantized x (from row `row`) through one int4 panel (its scales read by
// Scales); out's columns [0, cols).
template <int R, typename Scales, typename O>
void q4_pass(const uint8_t* w, Scales scales, const QuantizedRows& x, int64_t row, int64_t k,
             const float* bias, O* out, int64_t out_stride, int64_t cols) {
  constexpr int S = kSums<R>;
  const auto* words = reinterpret_cast<const int32_t*>(x.xq.data() + row * k);
  const int64_t row_words = k / 4, groups = x.groups;
  const float* d = x.d.data() + row * groups;
  const float* dsum = x.dsum.data() + row * groups;
  Floats acc[R], acc_base[R];  // the scale * sum(xq * q) terms; the (zero - 8 scale) ones
  for (int r = 0; r < R; ++r) acc[r] = acc_base[r] = floats(0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    NibbleSums isum[R][S];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < S; ++i) isum[r][i] = NibbleSums{};
    prefetch_ahead(w + g * 4 * 64, 4);
    for (int64_t c = 0; c < 4; ++c) {
      const Bytes v = load_bytes(w + (g * 4 + c) * 64);
      const Bytes lo = low_nibbles(v), hi = high_nibbles(v);
      const int64_t word = g * 8 + c * 2;
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = words + r * row_words + word;
        isum[r][0] = add_nibble_dot(isum[r][0], lo, xr[0]);
        isum[r][S - 1] = add_nibble_dot(isum[r][S - 1], hi, xr[1]);
      }
    }
    Floats scale, base;
    scales.at(g, scale, base);
    for (int r = 0; r < R; ++r) {
      NibbleSums total = isum[r][0];
      if constexpr (S == 2) total = add(total, isum[r][1]);
      acc[r] = fmadd(widen(total), mul(scale, floats(d[r * groups + g])), acc[r]);
      acc_base[r] = fmadd(base, floats(dsum[r * groups + g]), acc_base[r]);
    }
  }
  const Floats b = bias != nullptr ? load_first(bias, cols) : floats(0.0f);
  for (int r = 0; r < R; ++r) store_first(add(add(acc[r], acc_base[r]), b), out + r * out_stride, cols);
}

// How an int8 panel's scales come: its columns' float32 [16] (symmetric, q + 128 bytes), its
// groups' float16 [K / 32][16] (symmetric, q + 128 bytes), or its groups' float16 scale and base
// (F16Groups: w = scale * u + base, the bytes u as they are).
enum class Q8Scales { kChannel, kGroup, kGroupBase };

// Rows [0, R) of the quantized x (from row `row`) through one int8 panel with scales Q; out's
// columns [0, cols).
template <int R, Q8Scales Q, typename O>
void q8_pass(const uint8_t* w, const void* scales, const QuantizedRows& x, int64_t row, int64_t k,
             const float* bias, O* out, int64_t out_stride, int64_t cols) {
  constexpr bool kGrouped = Q != Q8Scales::kChannel, kBase = Q == Q8Scales::kGroupBase;
  // dot_q8 sums (byte - 128 + kQ8Bias) * xq: back to (byte - 128) * xq, or byte * xq with a base
  constexpr int32_t kStart = kBase ? 128 - kQ8Bias : -kQ8Bias;
  const auto* words = reinterpret_cast<const int32_t*>(x.xq.data() + row * k);
  const int64_t row_words = k / 4, groups = x.groups;
  const float* d = x.d.data() + row * groups;
  const float* dsum = x.dsum.data() + row * groups;
  const int32_t* sum = x.sum.data() + row * groups;
  const auto* group_scales = static_cast<const uint16_t*>(scales);
  constexpr int S = kSums<R>;
  Floats acc[R], acc_base[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_base[r] = floats(0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    Ints isum[R][S];
    for (int r = 0; r < R; ++r) {
      isum[r][0] = ints(kStart * sum[r * groups + g]);
      if constexpr (S == 2) isum[r][1] = ints(0);
    }
    if constexpr (R >= 2) prefetch_ahead(w + g * 8 * 64, 8);
    for (int64_t c = 0; c < 8; ++c) {
      const Bytes v = load_bytes(w + (g * 8 + c) * 64);
      for (int r = 0; r < R; ++r) {
        isum[r][c % S] = dot_q8(isum[r][c % S], v, words[r * row_words + g * 8 + c]);
      }
    }
    Floats scale = floats(1.0f), base = floats(0.0f);
    if constexpr (kBase) {
      F16Groups{static_cast<const uint8_t*>(scales)}.at(g, scale, base);
    } else if constexpr (kGrouped) {
      scale = load_f16(group_scales + g * kCols);
    }
    for (int r = 0; r < R; ++r) {
      Ints total = isum[r][0];
      if constexpr (S == 2) total = add(total, isum[r][1]);
      Floats dg = floats(d[r * groups + g]);
      if constexpr (kGrouped) dg = mul(dg, scale);
      acc[r] = fmadd(total, dg, acc[r]);
      if constexpr (kBase) acc_base[r] = fmadd(base, floats(dsum[r * groups + g]), acc_base[r]);
    }
  }
  const Floats s = kGrouped ? floats(1.0f) : load_first(static_cast<const float*>(scales), cols);
  const Floats b = bias != nullptr ? load_first(bias, cols) : floats(0.0f);
  for (int r = 0; r < R; ++r) {
    if constexpr (kBase) acc[r] = add(acc[r], acc_base[r]);
    store_first(fmadd(acc[r], s, b), out + r * out_stride, cols);
  }
}

enum class Form { kInt4, kInt4Blocks, kInt4Groups, kInt8Channel, kInt8Grouped, kInt8Base };

// Every row through one panel, up to eight at a time; scales: the int4 panel's scale and zero
// (bfloat16), k-quant blocks or float16 scale and base, or the int8 panel's group scales
// (float16), column scales (float32) or group scales and bases (float16).
template <Form F, typename O>
void panel_rows(int64_t rows, const uint8_t* w, const void* scales, const QuantizedRows& x,
                int64_t k, const float* bias, O* out, int64_t out_stride, int64_t cols) {
  in_row_passes(rows, [&](int64_t r0, auto count) {
    constexpr int R = decltype(count)::value;
    O* o = out + r0 * out_stride;
    const auto* bytes = static_cast<const uint8_t*>(scales);
    if constexpr (F == Form::kInt4) {
      q4_pass<R>(w, Bf16Groups{bytes}, x, r0, k, bias, o, out_stride, cols);
    } else if constexpr (F == Form::kInt4Blocks) {
      q4_pass<R>(w, KBlocks{bytes}, x, r0, k, bias, o, out_stride, cols);
    } else if constexpr (F == Form::kInt4Groups) {
      q4_pass<R>(w, F16Groups{bytes}, x, r0, k, bias, o, out_stride, cols);
    } else {
      constexpr Q8Scales Q = F == Form::kInt8Channel ? Q8Scales::kChannel
                             : F == Form::kInt8Grouped ? Q8Scales::kGroup
                                                       : Q8Scales::kGroupBase;
      q8_pass<R, Q>(w, scales, x, r0, k, bias, o, out_stride, cols);
    }
  });
}

// x (quantized into q) through every panel in form F.
template <Form F>
void run_form(const QuantizedRows& q, int64_t rows, const uint8_t* w, int64_t panel_bytes,
              const at::Tensor& scales, int64_t panel_scale_bytes, const float* bias,
              at::Tensor& out, int64_t count, int64_t k) {
  run_panels(w, panel_bytes, scales, panel_scale_bytes, bias, out, count,
             [&](const uint8_t* wp, const void* sp, const float* b, auto* o, int64_t cols) {
               panel_rows<F>(rows, wp, sp, q, k, b, o, out.size(1), cols);
             });
}

#endif

}  // namespace

bool int_matmul_available() {
#if defined(LLMQ_INT_MATMUL)
  return true;
#else
  return false;
#endif
}

// The int8 terms the kernels quantize each row of activations into from now on (1 or 2:
// int_common.h's activation_terms), and the setting as it was.
int64_t set_activation_terms(int64_t terms) {
  TORCH_CHECK(terms == 1 || terms == 2, "set_activation_terms: 1 or 2 terms, not ", terms);
  return activation_terms.exchange(static_cast<int>(terms));
}

int64_t get_activation_terms() { return activation_terms.load(); }

// x [M, K] (bfloat16 or float32) times the int4 panels with their scales (any of the three
// forms), plus bias [N] (float32): [M, N] in x's dtype.
at::Tensor q4_matmul(const at::Tensor& x_in, const at::Tensor& panels, const at::Tensor& scales,
                     int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(int_matmul_available(), "q4_matmul: this build has neither AVX512-VNNI nor AVX2");
  TORCH_CHECK(panels.dim() == 5 && panels.scalar_type() == at::kByte && panels.size(2) == 4 &&
                  panels.size(3) == kCols && panels.size(4) == 4 && panels.is_contiguous(),
              "q4_matmul: panels are [P, K / 32, 4, 16, 4] uint8, contiguous");
  const int64_t count = panels.size(0), groups = panels.size(1), k = groups * kGroup;
  const bool blocks = scales.scalar_type() == at::kByte, f16 = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.is_contiguous() &&
                  (blocks || f16 || scales.scalar_type() == at::kBFloat16) &&
                  scales.nbytes() == count * (blocks ? k_block_bytes(groups)
                                                     : f16 ? f16_group_bytes(groups)
                                                           : bf16_group_bytes(groups)),
              "q4_matmul: scales are [P, K / 32, 2, 16] bf16 (scale, zero) or float16 (scale, "
              "base), or [P, ceil(K / 256), 320] uint8, contiguous");
  check_call("q4_matmul", x_in, k, count, out_features, bias);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
#if defined(LLMQ_INT_MATMUL)
  const uint8_t* w = panels.const_data_ptr<uint8_t>();
  const int64_t panel_bytes = groups * 4 * kCols * 4;
  run_terms(x, k, bias ? bias->const_data_ptr<float>() : nullptr, out,
            [&](const QuantizedRows& q, int64_t rows, const float* b, at::Tensor& o) {
              if (blocks) {
                run_form<Form::kInt4Blocks>(q, rows, w, panel_bytes, scales, k_block_bytes(groups),
                                            b, o, count, k);
              } else if (f16) {
                run_form<Form::kInt4Groups>(q, rows, w, panel_bytes, scales,
                                            f16_group_bytes(groups), b, o, count, k);
              } else {
                run_form<Form::kInt4>(q, rows, w, panel_bytes, scales, bf16_group_bytes(groups), b,
                                      o, count, k);
              }
            });
#endif
  return out;
}

// x [M, K'] (bfloat16 or float32; K' within 32 of K) times the int8 panels with their scales:
// symmetric (q + 128 bytes) per group [P, K / 32, 16] float16 or per column [N padded to 16]
// float32, or a scale and base per group [P, K / 32, 2, 16] float16 (the bytes u, w = scale * u
// + base); plus bias [N] (float32): [M, N] in x's dtype.
at::Tensor q8_matmul(const at::Tensor& x_in, const at::Tensor& panels, const at::Tensor& scales,
                     int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(int_matmul_available(), "q8_matmul: this build has neither AVX512-VNNI nor AVX2");
  TORCH_CHECK(panels.dim() == 5 && panels.scalar_type() == at::kByte && panels.size(2) == 8 &&
                  panels.size(3) == kCols && panels.size(4) == 4 && panels.is_contiguous(),
              "q8_matmul: panels are [P, K / 32, 8, 16, 4] uint8, contiguous");
  const int64_t count = panels.size(0), groups = panels.size(1), k = groups * kGroup;
  const bool half = scales.scalar_type() == at::kHalf;
  const bool based = half && scales.numel() == count * groups * 2 * kCols;
  const bool grouped = half && !based;
  TORCH_CHECK(scales.is_contiguous() &&
                  (grouped ? scales.numel() == count * groups * kCols
                           : based || (scales.scalar_type() == at::kFloat &&
                                       scales.numel() == count * kCols)),
              "q8_matmul: scales are [P, K / 32, 16] or [P, K / 32, 2, 16] float16 or [P * 16] "
              "float32, contiguous");
  check_call("q8_matmul", x_in, k, count, out_features, bias);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
#if defined(LLMQ_INT_MATMUL)
  const float* b = bias ? bias->const_data_ptr<float>() : nullptr;
  const int64_t panel_bytes = groups * 8 * kCols * 4;
  const uint8_t* w = panels.const_data_ptr<uint8_t>();
  run_terms(x, k, b, out, [&](const QuantizedRows& q, int64_t rows, const float* bb, at::Tensor& o) {
    if (grouped) {
      run_form<Form::kInt8Grouped>(q, rows, w, panel_bytes, scales, groups * kCols * 2, bb, o,
                                   count, k);
    } else if (based) {
      run_form<Form::kInt8Base>(q, rows, w, panel_bytes, scales, f16_group_bytes(groups), bb, o,
                                count, k);
    } else {
      run_form<Form::kInt8Channel>(q, rows, w, panel_bytes, scales, kCols * 4, bb, o, count, k);
    }
  });
#endif
  return out;
}

}  // namespace llmq

TORCH_LIBRARY_FRAGMENT(llmq, m) {
  m.def("int_matmul_available() -> bool", &llmq::int_matmul_available);
  m.def("set_activation_terms(int terms) -> int", &llmq::set_activation_terms);
  m.def("activation_terms() -> int", &llmq::get_activation_terms);
  m.def(
      "q4_matmul(Tensor x, Tensor panels, Tensor scales, int out_features, Tensor? bias) -> "
      "Tensor");
  m.def(
      "q8_matmul(Tensor x, Tensor panels, Tensor scales, int out_features, Tensor? bias) -> "
      "Tensor");
  m.impl("q4_matmul", c10::DispatchKey::CPU, &llmq::q4_matmul);
  m.impl("q8_matmul", c10::DispatchKey::CPU, &llmq::q8_matmul);
}
