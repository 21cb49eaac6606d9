// 6-bit projections (W6A8), for the tensors a 4-bit model keeps at more bits, as llama.cpp's
// Q4_K_M keeps them in Q6_K: w = scale * q + base per group of 32 input columns, q in 0..63, the
// scales in k-quant super-blocks as int4's (int_common.h's KBlocks: scale = d * sc, base =
// m_step * m; quantized_weights.Int6Blocks), or a float16 scale and base per group (F16Groups:
// GGUF's Q5_1, quantized_weights.Int6Groups). 6.625 bits a weight against the 8.5 of int8 in
// groups of 32, with the activations quantized per row as int_matmul.cpp's.
//
// Panels of 16 output columns, [P][K / 32][6][16][4] bytes: a group's first 4 x 64 bytes hold
// its values' low nibbles as int4's panels do (step c's byte i of a column: input 8c + i low,
// 8c + 4 + i high), its last 2 x 64 bytes their top two bits: byte i of a column in part j holds,
// from its low bits up, those of step 2j's low and high nibble, then step 2j + 1's. Each step's
// values are put together in registers (an or of the nibbles with the bits shifted to 4-5) and
// multiplied with the activations as unsigned bytes, as int4's: vpdpbusd on AVX512-VNNI,
// vpmaddubsw + vpmaddwd on AVX2 (int_lanes.h's add_six_dot).
//
// Fewer bytes than int8 (6.625 bits a weight against 8.5), so a decode's memory-bound row runs
// faster than int8's and batches about as fast (docs/performance.md).

#include "int_common.h"  // first: vec.h sets the ISA ATen's headers compile for

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops.h"

namespace llmq {
namespace {

constexpr int64_t kSixParts = 6;  // 64-byte parts of a panel's group: 4 of nibbles, 2 of top bits

#if defined(LLMQ_INT_MATMUL)
using namespace lanes;  // NOLINT: the kernel below is written in its lanes

// Step `step` of a group's 6-bit values (their nibbles v, their top bits at 4-5: lo_top, hi_top)
// times rows [0, R) of the activations' words from `word`.
// `scale`: the sub-block's scales AVX2's q6k_pass widens the products against, or none.
template <int R, int S, typename... Scale>
inline void six_step(Ints (&isum)[R][S], Bytes v, Bytes lo_top, Bytes hi_top, const int32_t* words,
                     int64_t row_words, int64_t word, Scale... scale) {
  const Bytes lo = or_bytes(low_nibbles(v), lo_top), hi = or_bytes(high_nibbles(v), hi_top);
  for (int r = 0; r < R; ++r) {
    const int32_t* xr = words + r * row_words + word;
    isum[r][word / 2 % S] = add_six_dot(isum[r][word / 2 % S], lo, xr[0], hi, xr[1], scale...);
  }
}

// Rows [0, R) of the quantized x (from row `row`) through one 6-bit panel; out's columns
// [0, cols). Its frame repeats int_matmul.cpp's q4_pass: one pass templated on how a group's
// sums are made was slower built for AVX2 (docs/performance.md), so the two stay apart.
template <int R, typename Scales, typename O>
void q6_pass(const uint8_t* w, Scales scales, const QuantizedRows& x, int64_t row, int64_t k,
             const float* bias, O* out, int64_t out_stride, int64_t cols) {
  constexpr int S = kSums<R>;
  const auto* words = reinterpret_cast<const int32_t*>(x.xq.data() + row * k);
  const int64_t row_words = k / 4, groups = x.groups;
  const float* d = x.d.data() + row * groups;
  const float* dsum = x.dsum.data() + row * groups;
  Floats acc[R], acc_base[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_base[r] = floats(0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gw = w + g * kSixParts * 64;
    Ints isum[R][S];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < S; ++i) isum[r][i] = ints(0);
    prefetch_ahead(gw, kSixParts);
    for (int64_t j = 0; j < 2; ++j) {
      const Bytes top = load_bytes(gw + (4 + j) * 64);
      const int64_t word = g * 8 + j * 4;
      six_step(isum, load_bytes(gw + 2 * j * 64), bits_4_5<4>(top), bits_4_5<2>(top), words,
               row_words, word);
      six_step(isum, load_bytes(gw + (2 * j + 1) * 64), bits_4_5<0>(top), bits_4_5<-2>(top),
               words, row_words, word + 2);
    }
    Floats scale, base;
    scales.at(g, scale, base);
    for (int r = 0; r < R; ++r) {
      Ints total = isum[r][0];
      if constexpr (S == 2) total = add(total, isum[r][1]);
      acc[r] = fmadd(total, mul(scale, floats(d[r * groups + g])), acc[r]);
      acc_base[r] = fmadd(base, floats(dsum[r * groups + g]), acc_base[r]);
    }
  }
  const Floats b = bias != nullptr ? load_first(bias, cols) : floats(0.0f);
  for (int r = 0; r < R; ++r) store_first(add(add(acc[r], acc_base[r]), b), out + r * out_stride, cols);
}

// A pass's rows of the quantized x from `row`: their words, block scales and sums of values.
struct Q6KRows {
  const int32_t* words;
  int64_t row_words;
  const float* d;
  const int32_t *sum, *first_half;
  Q6KRows(const QuantizedRows& x, int64_t row, int64_t k)
      : words(reinterpret_cast<const int32_t*>(x.xq.data() + row * k)), row_words(k / 4),
        d(x.d.data() + row * x.groups), sum(x.sum.data() + row * x.groups),
        first_half(x.first_half.data() + row * x.groups) {}
};

// q6_pass for Q6_K's scales (Q6KBlocks): a group's two 16-value halves (steps 0-1, 2-3) summed
// apart, each (sum - 32 * sum(x)) times its sub-block's d * sc. No base term: the -32 is the
// sums' own. Two chains of vpdpbusd a row, as q6_pass's kSums makes for few rows: faster than
// int8 at one row (fewer bytes), slower at many, where a group's ten vector operations (q6_pass's
// five) are the time (docs/performance.md).
#if defined(LLMQ_INT_LANES_AVX512)
template <int R, typename O>
void q6k_pass(const uint8_t* w, Q6KBlocks scales, const QuantizedRows& x, int64_t row, int64_t k,
              const float* bias, O* out, int64_t out_stride, int64_t cols) {
  const Q6KRows rows(x, row, k);
  const int64_t groups = x.groups;
  Floats acc[R];
  for (int r = 0; r < R; ++r) acc[r] = floats(0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gw = w + g * kSixParts * 64;
    Ints half[2][R][1];
    for (int r = 0; r < R; ++r) half[0][r][0] = half[1][r][0] = ints(0);
    prefetch_ahead(gw, kSixParts);
    for (int64_t j = 0; j < 2; ++j) {
      const Bytes top = load_bytes(gw + (4 + j) * 64);
      const int64_t word = g * 8 + j * 4;
      six_step(half[j], load_bytes(gw + 2 * j * 64), bits_4_5<4>(top), bits_4_5<2>(top), rows.words,
               rows.row_words, word);
      six_step(half[j], load_bytes(gw + (2 * j + 1) * 64), bits_4_5<0>(top), bits_4_5<-2>(top),
               rows.words, rows.row_words, word + 2);
    }
    Floats first, second;
    scales.at(g, first, second);
    for (int r = 0; r < R; ++r) {
      const int32_t xs = rows.first_half[r * groups + g], xs2 = rows.sum[r * groups + g] - xs;
      const Floats a = to_floats(add(half[0][r][0], ints(-32 * xs)));
      const Floats b = to_floats(add(half[1][r][0], ints(-32 * xs2)));
      acc[r] = fmadd(fmadd(a, first, mul(b, second)), floats(rows.d[r * groups + g]), acc[r]);
    }
  }
  const Floats b = bias != nullptr ? load_first(bias, cols) : floats(0.0f);
  for (int r = 0; r < R; ++r) store_first(add(acc[r], b), out + r * out_stride, cols);
}
#else
// q6k_pass on AVX2: a step's int16 pair sums widened by vpmaddwd against its sub-block's sc
// instead of ones (the widening scales them), so a group's two halves make one int32 sum a row
// (exact: at most 4 * 2 * 32,004 * 128), the -32 taken once a group: (32 sc, 32 sc') against
// the halves' sums of x. A row's group ends in four operations of two registers, faster than
// AVX-512's form built for AVX2 from 4 rows on (docs/performance.md). One form for every pass: a
// row's bits do not depend on the rows beside it.
template <int R, typename O>
void q6k_pass(const uint8_t* w, Q6KBlocks scales, const QuantizedRows& x, int64_t row, int64_t k,
              const float* bias, O* out, int64_t out_stride, int64_t cols) {
  const Q6KRows rows(x, row, k);
  const int64_t groups = x.groups;
  Floats acc[R];
  for (int r = 0; r < R; ++r) acc[r] = floats(0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gw = w + g * kSixParts * 64;
    const int8_t* sc = scales.sc(g);
    Ints isum[R][1];
    for (int r = 0; r < R; ++r) isum[r][0] = ints(0);
    prefetch_ahead(gw, kSixParts);
    for (int64_t j = 0; j < 2; ++j) {
      const Pairs scale = pairs(sc + j * kCols, sc + j * kCols, 0);
      const Bytes top = load_bytes(gw + (4 + j) * 64);
      const int64_t word = g * 8 + j * 4;
      six_step(isum, load_bytes(gw + 2 * j * 64), bits_4_5<4>(top), bits_4_5<2>(top), rows.words,
               rows.row_words, word, scale);
      six_step(isum, load_bytes(gw + (2 * j + 1) * 64), bits_4_5<0>(top), bits_4_5<-2>(top),
               rows.words, rows.row_words, word + 2, scale);
    }
    const Pairs offsets = pairs(sc, sc + kCols, 5);
    const Floats step = scales.d(g);
    for (int r = 0; r < R; ++r) {
      const int32_t xs = rows.first_half[r * groups + g], xs2 = rows.sum[r * groups + g] - xs;
      const uint32_t both = (static_cast<uint32_t>(xs) & 0xFFFF) | (static_cast<uint32_t>(xs2) << 16);
      const Ints total = sub_pair_dot(isum[r][0], offsets, static_cast<int32_t>(both));
      acc[r] = fmadd(total, mul(step, floats(rows.d[r * groups + g])), acc[r]);
    }
  }
  const Floats b = bias != nullptr ? load_first(bias, cols) : floats(0.0f);
  for (int r = 0; r < R; ++r) store_first(add(acc[r], b), out + r * out_stride, cols);
}
#endif

#endif

}  // namespace

// x [M, K'] (bfloat16 or float32; K' within 32 of K) times the 6-bit panels with their scales,
// plus bias [N] (float32): [M, N] in x's dtype. The scales [P, ceil(K / 256), 320] (uint8) are
// k-quant super-blocks (w = d * sc * q + m_step * m), [P, K / 256, 288] Q6_K's (w = d * sc *
// (q - 32) per 16 values; K a multiple of 256), [P, K / 32, 2, 16] float16 a group's scale and
// base (GGUF's Q5_1: w = d * q + m).
at::Tensor q6_matmul(const at::Tensor& x_in, const at::Tensor& panels, const at::Tensor& scales,
                     int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(int_matmul_available(), "q6_matmul: this build has neither AVX512-VNNI nor AVX2");
  TORCH_CHECK(panels.dim() == 5 && panels.scalar_type() == at::kByte &&
                  panels.size(2) == kSixParts && panels.size(3) == kCols && panels.size(4) == 4 &&
                  panels.is_contiguous(),
              "q6_matmul: panels are [P, K / 32, 6, 16, 4] uint8, contiguous");
  const int64_t count = panels.size(0), groups = panels.size(1), k = groups * kGroup;
  const bool f16 = scales.scalar_type() == at::kHalf;
  const bool q6k =
      !f16 && groups % 8 == 0 && scales.nbytes() == count * groups / 8 * kQ6KBlockBytes;
  const int64_t scale_bytes = f16   ? f16_group_bytes(groups)
                              : q6k ? groups / 8 * kQ6KBlockBytes
                                    : k_block_bytes(groups);
  TORCH_CHECK(scales.is_contiguous() && (f16 || scales.scalar_type() == at::kByte) &&
                  scales.nbytes() == count * scale_bytes,
              "q6_matmul: scales are [P, ceil(K / 256), 320] or [P, K / 256, 288] uint8, or "
              "[P, K / 32, 2, 16] float16, contiguous");
  check_call("q6_matmul", x_in, k, count, out_features, bias);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
#if defined(LLMQ_INT_MATMUL)
  const int64_t n = out_features;
  run_terms(x, k, bias ? bias->const_data_ptr<float>() : nullptr, out,
            [&](const QuantizedRows& q, int64_t rows, const float* bb, at::Tensor& o) {
              run_panels(panels.const_data_ptr<uint8_t>(), groups * kSixParts * 64, scales,
                         scale_bytes, bb, o, count,
                         [&](const uint8_t* wp, const void* sp, const float* b, auto* op,
                             int64_t cols) {
                           const auto* block_bytes = static_cast<const uint8_t*>(sp);
                           in_row_passes(rows, [&](int64_t r0, auto pass) {
                             constexpr int R = decltype(pass)::value;
                             if (q6k) {
                               q6k_pass<R>(wp, Q6KBlocks{block_bytes}, q, r0, k, b, op + r0 * n, n,
                                           cols);
                             } else if (f16) {
                               q6_pass<R>(wp, F16Groups{block_bytes}, q, r0, k, b, op + r0 * n, n,
                                          cols);
                             } else {
                               q6_pass<R>(wp, KBlocks{block_bytes}, q, r0, k, b, op + r0 * n, n,
                                          cols);
                             }
                           });
                         });
            });
#endif
  return out;
}

}  // namespace llmq

TORCH_LIBRARY_FRAGMENT(llmq, m) {
  m.def(
      "q6_matmul(Tensor x, Tensor panels, Tensor scales, int out_features, Tensor? bias) -> "
      "Tensor");
  m.impl("q6_matmul", c10::DispatchKey::CPU, &llmq::q6_matmul);
}
