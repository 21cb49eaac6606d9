// Decode attention read straight from an 8-bit paged KV pool (kv_quant.py): keys and values as
// int8 or float8 e4m3 codes, one float32 scale per token and KV head. The passes of
// paged_decode.cpp, each key and value row converted to float as it is loaded: a key's scale
// multiplies its dot product (one multiply a key, not one a value), a value's scale its
// probability. The scores and the softmax in float32, as there; the same features (window,
// softcap, sinks) through paged_common.h.

#include "vec.h"
#include "paged_common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

using llmq::kWidth;
using llmq::load_float;
using llmq::sum_lanes;
using llmq::Vec;
using llmq::paged::Features;
using llmq::paged::first_key;
using llmq::paged::kMaxChunks;
using llmq::paged::kParallelKeys;
using llmq::paged::Shape;
using Fp8 = c10::Float8_e4m3fn;

// Every e4m3 byte's float value, where no vector conversion is compiled.
const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(Fp8(static_cast<uint8_t>(i), Fp8::from_bits()));
    }
    return t;
  }();
  return table.data();
}

// e4m3 bytes as float16 bits: the sign to bit 15, exponent and mantissa under it (float16's
// 5-bit exponent holds e4m3's 4 bits; subnormals stay subnormal), worth 2^-8 of the code. The
// hardware's float16 conversion then reads them exactly, where a gather from fp8_table made the
// fp8 kernel several times slower than int8's (docs/performance.md).
#if defined(CPU_CAPABILITY_AVX512)
inline Vec fp8_to_float(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
  return Vec(_mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.0f)));
}
#elif defined(CPU_CAPABILITY_AVX2) && defined(__F16C__)
inline Vec fp8_to_float(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
  return Vec(_mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.0f)));
}
#else
inline Vec fp8_to_float(const uint8_t* p) {
  float row[kWidth];
  for (int64_t i = 0; i < kWidth; ++i) row[i] = fp8_table()[p[i]];
  return Vec::loadu(row);
}
#endif

// kWidth codes from p as floats.
template <typename Q>
inline Vec load_codes(const Q* p) {
  if constexpr (std::is_same_v<Q, int8_t>) {
    const auto* bytes = reinterpret_cast<const __m128i*>(p);
#if defined(CPU_CAPABILITY_AVX512)
    return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes))));
#elif defined(CPU_CAPABILITY_AVX2)
    return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(bytes))));
#else
    (void)bytes;
    float row[kWidth];
    for (int64_t i = 0; i < kWidth; ++i) row[i] = static_cast<float>(p[i]);
    return Vec::loadu(row);
#endif
  } else {
    return fp8_to_float(reinterpret_cast<const uint8_t*>(p));
  }
}

// A layer's codes and scales: keys of head h at codes + h * slots * D, their scales at
// scales + h * slots; the values' Hkv heads after the keys'.
template <typename Q>
struct Cache {
  const Q* keys;
  const Q* values;
  const float* key_scales;
  const float* value_scales;
};

// Scores [G, n] of the keys first .. context - 1, with G and D known to the compiler (the G
// query vectors stay in registers, as paged_decode.cpp's fixed passes).
template <typename Q, int G, int D>
void scores_fixed(const float* qf, const Cache<Q>& c, const int32_t* table, int64_t first,
                  int64_t context, int64_t bs, float* scores) {
  constexpr int C = D / kWidth;
  const int64_t n = context - first;
  Vec q[G][C];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < C; ++j) q[g][j] = Vec::loadu(qf + (g * C + j) * kWidth);
  for (int64_t t = first, b = first / bs; t < context; ++b) {
    for (const int64_t end = std::min(context, (b + 1) * bs); t < end; ++t) {
      const int64_t slot = static_cast<int64_t>(table[b]) * bs + t % bs;
      const Q* k = c.keys + slot * D;
      Vec row[C];
      for (int j = 0; j < C; ++j) row[j] = load_codes(k + j * kWidth);
      for (int g = 0; g < G; ++g) {
        Vec dot = q[g][0] * row[0];
        for (int j = 1; j < C; ++j) dot = at::vec::fmadd(q[g][j], row[j], dot);
        scores[g * n + (t - first)] = sum_lanes(dot) * c.key_scales[slot];
      }
    }
  }
}

template <typename Q, int G, int D>
void weighted_sum_fixed(const float* probs, const Cache<Q>& c, const int32_t* table,
                        int64_t first, int64_t context, int64_t bs, float* out) {
  constexpr int C = D / kWidth;
  const int64_t n = context - first;
  Vec acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < C; ++j) acc[g][j] = Vec(0.0f);
  for (int64_t t = first, b = first / bs; t < context; ++b) {
    for (const int64_t end = std::min(context, (b + 1) * bs); t < end; ++t) {
      const int64_t slot = static_cast<int64_t>(table[b]) * bs + t % bs;
      const Q* v = c.values + slot * D;
      Vec row[C];
      for (int j = 0; j < C; ++j) row[j] = load_codes(v + j * kWidth);
      const float vs = c.value_scales[slot];
      for (int g = 0; g < G; ++g) {
        const Vec p(probs[g * n + (t - first)] * vs);
        for (int j = 0; j < C; ++j) acc[g][j] = at::vec::fmadd(p, row[j], acc[g][j]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < C; ++j) acc[g][j].store(out + (g * C + j) * kWidth);
}

// Any group size and head dim (a multiple of kWidth): the same passes, reloading per key.
template <typename Q>
void scores_any(const float* qf, const Cache<Q>& c, const int32_t* table, int64_t first,
                int64_t context, int64_t bs, float* scores, int64_t G, int64_t D) {
  const int64_t chunks = D / kWidth, n = context - first;
  Vec row[kMaxChunks];
  for (int64_t t = first; t < context; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / bs]) * bs + t % bs;
    for (int64_t j = 0; j < chunks; ++j) row[j] = load_codes(c.keys + slot * D + j * kWidth);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      Vec dot = Vec::loadu(qg) * row[0];
      for (int64_t j = 1; j < chunks; ++j)
        dot = at::vec::fmadd(Vec::loadu(qg + j * kWidth), row[j], dot);
      scores[g * n + (t - first)] = sum_lanes(dot) * c.key_scales[slot];
    }
  }
}

template <typename Q>
void weighted_sum_any(const float* probs, const Cache<Q>& c, const int32_t* table, int64_t first,
                      int64_t context, int64_t bs, float* acc, int64_t G, int64_t D) {
  const int64_t chunks = D / kWidth, n = context - first;
  std::fill(acc, acc + G * D, 0.0f);
  Vec row[kMaxChunks];
  for (int64_t t = first; t < context; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / bs]) * bs + t % bs;
    for (int64_t j = 0; j < chunks; ++j) row[j] = load_codes(c.values + slot * D + j * kWidth);
    for (int64_t g = 0; g < G; ++g) {
      const Vec p(probs[g * n + (t - first)] * c.value_scales[slot]);
      float* a = acc + g * D;
      for (int64_t j = 0; j < chunks; ++j) {
        at::vec::fmadd(p, row[j], Vec::loadu(a + j * kWidth)).store(a + j * kWidth);
      }
    }
  }
}

template <typename Q>
struct Passes {
  using Pass = void (*)(const float*, const Cache<Q>&, const int32_t*, int64_t, int64_t, int64_t,
                        float*);
  Pass scores = nullptr;
  Pass weighted_sum = nullptr;
};

// The fixed passes for group sizes 1-8 at head dims 64 and 128; none elsewhere.
template <typename Q>
Passes<Q> fixed_passes(int64_t G, int64_t D) {
  // clang-format off
#define LLMQ_FIXED(g, d) \
  if (G == g && D == d) return {&scores_fixed<Q, g, d>, &weighted_sum_fixed<Q, g, d>};
#define LLMQ_FIXED_D(d) \
  LLMQ_FIXED(1, d) LLMQ_FIXED(2, d) LLMQ_FIXED(3, d) LLMQ_FIXED(4, d) \
  LLMQ_FIXED(5, d) LLMQ_FIXED(6, d) LLMQ_FIXED(7, d) LLMQ_FIXED(8, d)
  LLMQ_FIXED_D(64)
  LLMQ_FIXED_D(128)
#undef LLMQ_FIXED_D
#undef LLMQ_FIXED
  // clang-format on
  return {};
}

// One sequence and one KV head: the `group` query heads that share it (their sinks: `sinks`).
template <typename T, typename Q>
void attend_task(const T* q, int64_t q_head_stride, T* out, const Cache<Q>& c,
                 const int32_t* table, int64_t context, const Shape& s, float scale,
                 const Features& f, const float* sinks, const Passes<Q>& fixed,
                 std::vector<float>& scratch) {
  const int64_t G = s.group, D = s.head_dim, bs = s.block_size, chunks = D / kWidth;
  const int64_t first = first_key(context, f.window), n = context - first;
  scratch.resize(2 * G * D + G * n + G);
  float* qf = scratch.data();
  float* acc = qf + G * D;
  float* scores = acc + G * D;
  float* inv_sum = scores + G * n;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < chunks; ++j) {
      (load_float(q + g * q_head_stride + j * kWidth) * Vec(scale)).store(qf + g * D + j * kWidth);
    }
  }
  if (fixed.scores != nullptr) {
    fixed.scores(qf, c, table, first, context, bs, scores);
  } else {
    scores_any<Q>(qf, c, table, first, context, bs, scores, G, D);
  }
  llmq::paged::softmax_rows(scores, n, G, f.softcap, sinks, inv_sum);
  if (fixed.weighted_sum != nullptr) {
    fixed.weighted_sum(scores, c, table, first, context, bs, acc);
  } else {
    weighted_sum_any<Q>(scores, c, table, first, context, bs, acc, G, D);
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
  }
}

template <typename T, typename Q>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv, const at::Tensor& scales,
         const at::Tensor& tables, const at::Tensor& contexts, const Shape& s, double scale,
         const Features& f) {
  const int64_t n = query.size(0), slots = kv.size(1), D = s.head_dim;
  const T* q = query.const_data_ptr<T>();
  const Q* codes = kv.const_data_ptr<Q>();
  const float* sc = scales.const_data_ptr<float>();
  T* o = out.mutable_data_ptr<T>();
  const int32_t* table = tables.const_data_ptr<int32_t>();
  const int32_t* ctx = contexts.const_data_ptr<int32_t>();
  const int64_t q_seq = query.stride(0), q_head = query.stride(1);
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t tasks = n * s.kv_heads;
  const int64_t keys = llmq::paged::keys_read(table, ctx, n, slots / s.block_size, s, f.window);
  // As paged_decode.cpp: one thread below 512 keys of work, tasks handed out dynamically.
  const bool serial = keys * s.kv_heads < kParallelKeys || at::in_parallel_region();
  const int threads =
      serial ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
  const Passes<Q> fixed = fixed_passes<Q>(s.group, D);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t i = task / s.kv_heads, h = task % s.kv_heads, vh = s.kv_heads + h;
      const Cache<Q> c{codes + h * slots * D, codes + vh * slots * D, sc + h * slots,
                       sc + vh * slots};
      attend_task<T, Q>(q + i * q_seq + h * s.group * q_head, q_head,
                        o + i * o_seq + h * s.group * o_head, c, table + i * s.max_blocks, ctx[i],
                        s, static_cast<float>(scale), f,
                        f.sinks == nullptr ? nullptr : f.sinks + h * s.group, fixed, scratch);
    }
  }
}

template <typename Q>
void run_codes(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv,
               const at::Tensor& scales, const at::Tensor& tables, const at::Tensor& contexts,
               const Shape& s, double scale, const Features& f) {
  switch (query.scalar_type()) {
    case at::kFloat:
      return run<float, Q>(out, query, kv, scales, tables, contexts, s, scale, f);
    case at::kBFloat16:
      return run<c10::BFloat16, Q>(out, query, kv, scales, tables, contexts, s, scale, f);
    case at::kHalf:
      return run<c10::Half, Q>(out, query, kv, scales, tables, contexts, s, scale, f);
    default:
      TORCH_CHECK(false, "paged_decode_attention_q8: a float32, bfloat16 or float16 query");
  }
}

}  // namespace

namespace llmq {

// As paged_decode_attention, kv [2 * Hkv, slots, D] holding int8 or float8_e4m3fn codes and
// scales [2 * Hkv, slots] float32 their scales: a key or value is code * scale.
void paged_decode_attention_q8(at::Tensor out, const at::Tensor& query, const at::Tensor& kv,
                               const at::Tensor& scales, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t block_size, double scale,
                               int64_t window, double softcap,
                               const std::optional<at::Tensor>& sinks) {
  const Shape s = paged::checked_shape(out, query, kv, block_tables, context_lens, block_size,
                                       window, softcap);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == kv.size(0) && scales.size(1) == kv.size(1),
              "paged_decode_attention_q8: float32 scales [2 * kv_heads, slots]");
  at::Tensor sinks_f;  // float32, alive until the tasks are done
  const Features f = paged::features_of(window, softcap, sinks, query.size(1), sinks_f);
  switch (kv.scalar_type()) {
    case at::kChar:
      return run_codes<int8_t>(out, query, kv, scales, block_tables, context_lens, s, scale, f);
    case at::kFloat8_e4m3fn:
      return run_codes<Fp8>(out, query, kv, scales, block_tables, context_lens, s, scale, f);
    default:
      TORCH_CHECK(false, "paged_decode_attention_q8: int8 or float8_e4m3fn codes");
  }
}

}  // namespace llmq

TORCH_LIBRARY_FRAGMENT(llmq, m) {
  m.def(
      "paged_decode_attention_q8(Tensor(a!) out, Tensor query, Tensor kv, Tensor scales, "
      "Tensor block_tables, Tensor context_lens, int block_size, float scale, int window=0, "
      "float softcap=0., Tensor? sinks=None) -> ()");
  m.impl("paged_decode_attention_q8", c10::DispatchKey::CPU, &llmq::paged_decode_attention_q8);
}
