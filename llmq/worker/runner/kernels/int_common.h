// What the integer kernels share (int_matmul.cpp: int4 and int8; int6_matmul.cpp: 6-bit): the
// panels' shape, the activations quantized per row in blocks of 32, the k-quant super-blocks of
// scales, the software prefetch and the arguments' checks. See int_matmul.cpp for the method.
#pragma once

#include "vec.h"  // first: it sets the ISA ATen's headers compile for

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "int_lanes.h"
#include "panel_loop.h"

namespace llmq {

// The int8 terms a row of activations is quantized into (set_activation_terms): 1, x ~ d * xq
// per block of 32 as llama.cpp's Q8_1 (its rounding, up to 1/254 of a block's largest value,
// turned SmolLM2-135M's greedy answer into nonsense); 2, the residual x - d * xq quantized again
// with its own scale, as a second row whose products are added to the first's: within 1/64,516
// of the block's largest value, finer than bfloat16's rounding of every value. One setting for
// every call, so a row's bits never depend on the rows beside it.
inline std::atomic<int> activation_terms{2};

namespace {

constexpr int64_t kCols = 16;   // output columns per panel: one vector of int32 / float lanes
constexpr int64_t kGroup = 32;  // inputs per weight group and per activation block
constexpr int64_t kChunkBytes = 64 * 1024;  // weights a thread takes at a time (panel_loop.h)
// Software prefetch of a pass's weights this far ahead: the hardware's prefetchers alone fall
// short of the memory's pace (docs/performance.md). The `lines` cache lines from p +
// kPrefetchAhead on towards L1:
constexpr int64_t kPrefetchAhead = 4096;
inline void prefetch_ahead(const uint8_t* p, int lines) {
  for (int i = 0; i < lines; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead + i * 64), _MM_HINT_T0);
  }
}

// A panel's int4 scale bytes: bfloat16 scale and zero per group, or k-quant super-blocks of 8
// groups (320 bytes each: float16 d and m step [2][16], codes uint8 [8][16] and int8 [8][16]).
constexpr int64_t kKBlockBytes = 320;
constexpr int64_t bf16_group_bytes(int64_t groups) { return groups * 2 * kCols * 2; }
constexpr int64_t k_block_bytes(int64_t groups) { return (groups + 7) / 8 * kKBlockBytes; }
// Q6_K's scales (int6_matmul.cpp): a super-block's float16 d [16] and int8 sc [16][16].
constexpr int64_t kQ6KBlockBytes = 288;

// Rows quantized per block of 32: xq int8 (as int32 words of 4), d, sum(xq) and d * sum(xq), and
// the sum of a block's first 16 (Q6_K's 16-value sub-blocks, int6_matmul.cpp).
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> d, dsum;
  std::vector<int32_t> sum, first_half;
  int64_t groups = 0;
};


// Block g of row r of q from the 32 values in `block`; block keeps what the quantization left.
inline void quantize_block(float* block, int64_t r, int64_t g, int64_t k, QuantizedRows& q) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(block[i]));
  const float d = amax / 127.0f;
  const float inv = d != 0.0f ? 1.0f / d : 0.0f;
  int32_t sum = 0;
  int8_t* out = q.xq.data() + r * k + g * kGroup;
  for (int64_t i = 0; i < kGroup; ++i) {
    const float v = std::nearbyint(block[i] * inv);  // ties to even, as torch.round
    out[i] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
    block[i] -= d * static_cast<float>(out[i]);
    sum += out[i];
    if (i == kGroup / 2 - 1) q.first_half[r * q.groups + g] = sum;
  }
  q.d[r * q.groups + g] = d;
  q.sum[r * q.groups + g] = sum;
  q.dsum[r * q.groups + g] = d * static_cast<float>(sum);
}

// x [rows, k_in] into blocks of 32 over k columns (k_in <= k: the columns past it zero), each
// row as `terms` rows (row r's term t at r * terms + t).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k_in, int64_t k, int terms,
                   QuantizedRows& q) {
  q.groups = k / kGroup;
  const int64_t out_rows = rows * terms;
  q.xq.resize(out_rows * k);
  q.d.resize(out_rows * q.groups);
  q.dsum.resize(out_rows * q.groups);
  q.sum.resize(out_rows * q.groups);
  q.first_half.resize(out_rows * q.groups);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float block[kGroup];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < q.groups; ++g) {
        for (int64_t i = 0; i < kGroup; ++i) {
          const int64_t col = g * kGroup + i;
          block[i] = col < k_in ? static_cast<float>(x[r * k_in + col]) : 0.0f;
        }
        for (int t = 0; t < terms; ++t) quantize_block(block, r * terms + t, g, k, q);
      }
    }
  });
}

#if defined(LLMQ_INT_MATMUL)
// An int4 or int6 panel's scales as k-quant super-blocks of 8 groups: [ceil(K / 256)][320 bytes].
struct KBlocks {
  using Floats = lanes::Floats;
  const uint8_t* bytes;
  void at(int64_t g, Floats& scale, Floats& base) const {
    const uint8_t* block = bytes + (g / 8) * kKBlockBytes;
    const auto* steps = reinterpret_cast<const uint16_t*>(block);  // d [16], m step [16]
    const int64_t code = (g % 8) * kCols;
    scale = lanes::mul(lanes::load_f16(steps), lanes::load_u8(block + 64 + code));
    base = lanes::mul(lanes::load_f16(steps + kCols), lanes::load_i8(reinterpret_cast<const int8_t*>(block + 192 + code)));
  }
};

// An int4, 6-bit or int8 panel's scales as float16 pairs per group, [K / 32][2][16]: scale and
// base (w = scale * q + base, q unsigned), as GGUF's Q4_1 and Q5_1 hold their d and m (exact
// where 8-bit codes are not) and as int8 with a minimum holds its groups.
constexpr int64_t f16_group_bytes(int64_t groups) { return groups * 2 * kCols * 2; }
struct F16Groups {
  using Floats = lanes::Floats;
  const uint8_t* bytes;
  void at(int64_t g, Floats& scale, Floats& base) const {
    const auto* pair = reinterpret_cast<const uint16_t*>(bytes) + g * 2 * kCols;
    scale = lanes::load_f16(pair);
    base = lanes::load_f16(pair + kCols);
  }
};

// A 6-bit panel's scales as llama.cpp's Q6_K holds them, w = d * sc * (q - 32): per super-block of
// 8 groups (16 sub-blocks of 16) [K / 256][288 bytes]: float16 d [16], int8 sc [16][16].
struct Q6KBlocks {
  using Floats = lanes::Floats;
  const uint8_t* bytes;
  // Group g's super-block step d, and its two sub-blocks' sc [2][16].
  Floats d(int64_t g) const {
    return lanes::load_f16(reinterpret_cast<const uint16_t*>(bytes + (g / 8) * kQ6KBlockBytes));
  }
  const int8_t* sc(int64_t g) const {
    return reinterpret_cast<const int8_t*>(bytes + (g / 8) * kQ6KBlockBytes + 32 + (g % 8) * 2 * kCols);
  }
  // Group g's two sub-blocks' scales d * sc.
  void at(int64_t g, Floats& first, Floats& second) const {
    const Floats step = d(g);
    first = lanes::mul(step, lanes::load_i8(sc(g)));
    second = lanes::mul(step, lanes::load_i8(sc(g) + kCols));
  }
};

// x quantized per row and block in `terms` (one buffer per calling thread: a step makes over a
// hundred calls), the columns past x's zero up to k.
const QuantizedRows& quantized(const at::Tensor& x, int64_t k, int terms) {
  thread_local QuantizedRows q;
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.const_data_ptr<float>(), x.size(0), x.size(1), k, terms, q);
  } else {
    quantize_rows(x.const_data_ptr<at::BFloat16>(), x.size(0), x.size(1), k, terms, q);
  }
  return q;
}

// out [M, N] (float32 or bfloat16) = the sum of each row's terms' products, parts [M * terms,
// N] float32, plus bias (or null).
inline void add_terms(const at::Tensor& parts, int terms, const float* bias, at::Tensor& out) {
  const int64_t n = out.size(1);
  const float* p = parts.const_data_ptr<float>();
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, out.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        float v = p[r * terms * n + c];
        for (int t = 1; t < terms; ++t) v += p[(r * terms + t) * n + c];
        if (bias != nullptr) v += bias[c];
        if (bf16) {
          const uint16_t bits = lanes::to_bf16(v);
          std::memcpy(static_cast<at::BFloat16*>(out.data_ptr()) + r * n + c, &bits, 2);
        } else {
          static_cast<float*>(out.data_ptr())[r * n + c] = v;
        }
      }
    }
  });
}

// out = x through run(quantized rows, their count, bias or null, out) with x's rows in
// activation_terms terms (the terms' products into float32 rows, then added).
template <typename Run>
void run_terms(const at::Tensor& x, int64_t k, const float* bias, at::Tensor& out, const Run& run) {
  const int terms = activation_terms.load(std::memory_order_relaxed);
  const QuantizedRows& q = quantized(x, k, terms);
  if (terms == 1) return run(q, x.size(0), bias, out);
  at::Tensor parts = at::empty({x.size(0) * terms, out.size(1)}, x.options().dtype(at::kFloat));
  run(q, parts.size(0), nullptr, parts);
  add_terms(parts, terms, bias, out);
}

// Independent integer sums a row keeps in a pass: a lone row's group is a chain of vpdpbusd (5
// cycles' latency each), which bounds one row's pass below the memory's pace with one sum
// (docs/performance.md); few rows split it in two (AVX2's chains are of one-cycle adds).
template <int R>
constexpr int kSums = lanes::kChainedDots && R <= 4 ? 2 : 1;

// Every panel of a projection through(panel's weights, its scales, its bias or null,
// out at its first column (float or bfloat16), its columns), handed out to the threads as they
// ask; a panel's scales panel_scale_bytes apart.
template <typename Through>
void run_panels(const uint8_t* w, int64_t panel_bytes, const at::Tensor& scales,
                int64_t panel_scale_bytes, const float* bias, at::Tensor& out, int64_t count,
                const Through& through) {
  const int64_t n = out.size(1);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  void* op = out.data_ptr();
  const auto* scale_bytes = static_cast<const uint8_t*>(scales.const_data_ptr());
  auto run = [&](int64_t p) {
    const int64_t col = p * kCols, cols = std::min(kCols, n - col);
    const uint8_t* wp = w + p * panel_bytes;
    const void* sp = scale_bytes + p * panel_scale_bytes;
    const float* b = bias ? bias + col : nullptr;
    if (bf16) {
      through(wp, sp, b, static_cast<at::BFloat16*>(op) + col, cols);
    } else {
      through(wp, sp, b, static_cast<float*>(op) + col, cols);
    }
  };
  for_each_panel(count, run, std::max<int64_t>(1, kChunkBytes / panel_bytes));
}

#endif

void check_call(const char* name, const at::Tensor& x, int64_t k, int64_t count,
                int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              name, ": x is [M, K] bf16 or float32");
  TORCH_CHECK(x.size(1) <= k && x.size(1) > k - kGroup, name, ": x has ", x.size(1), " columns, W ",
              k);
  TORCH_CHECK(out_features > (count - 1) * kCols && out_features <= count * kCols, name, ": ",
              out_features, " outputs do not fill ", count, " panels");
  TORCH_CHECK(!bias || (bias->numel() == out_features && bias->scalar_type() == at::kFloat &&
                        bias->is_contiguous()),
              name, ": the bias is [N] float32");
}

}  // namespace
}  // namespace llmq
