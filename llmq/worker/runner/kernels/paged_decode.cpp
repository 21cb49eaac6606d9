// Decode attention read straight from the paged KV pool: one query token per sequence.
//
// The eager path gathers every sequence's blocks into a contiguous buffer, then runs a bf16
// baddbmm, a softmax and a bmm: the keys and values are copied once and read twice, and each
// of the three calls pays oneDNN's per-call primitive lookup (docs/performance.md, "Choices:
// CPU kernels"). Here each (sequence, KV head) task reads its keys and
// values once from the pool, with the scores and the softmax in float32.
//
// A layer may ask more (Features, as attention_features.py does on the gathered path): a
// sliding window (the keys before it are neither read nor checked, so their blocks may be
// gone), an attention logit softcap, and per-head sinks (gpt-oss: one more logit in the
// softmax's denominator). A layer that asks none of them runs the same loops as before.
//
// ATen's Vectorized types, compiled with -march=native on the machine that runs it (AVX-512,
// AVX2, or their scalar fallback elsewhere); built on first use by cpu_kernels.py.

#include "vec.h"
#include "paged_common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"

namespace {

using llmq::kWidth;
using llmq::load_float;
using llmq::sum_lanes;
using llmq::Vec;
using llmq::paged::Features;
using llmq::paged::first_key;
using llmq::paged::kMaxChunks;
using llmq::paged::kParallelKeys;
using llmq::paged::keys_read;
using llmq::paged::Shape;
using llmq::paged::softmax_rows;
// Every pass below covers the keys first .. context - 1 of a sequence; its scores and
// probabilities lie [G, n] (n = context - first), one row a query head.

// The two passes over a sequence's keys and values with the group size G and the head dim D
// known to the compiler: the G query vectors and the G running sums stay in registers (at
// D = 64, G = 3: 12 AVX-512 registers each), where the generic pass reloads them per key:
// several times faster (docs/performance.md).
#if defined(CPU_CAPABILITY_AVX512)
// The lane sums of 16 vectors as one vector (v[j]'s sum in lane j): 45 shuffles and adds where
// 16 separate reductions take about 130.
inline __m512 sum_lanes_16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                       _mm512_shuffle_f32x4(low, high, 0xDD));
}

// Scores of 16 keys from t on, for every query head: one vector of 16 a head, stored at
// scores + g * n.
template <typename T, int G, int C>
void scores_of_16(const Vec (&q)[G][C], const T* keys, const int32_t* table, int64_t t, int64_t bs,
                  int64_t n, float* scores) {
  constexpr int D = C * kWidth;
  __m512 dots[G][16];
  for (int j = 0; j < 16; ++j) {
    const T* k = keys + (static_cast<int64_t>(table[(t + j) / bs]) * bs + (t + j) % bs) * D;
    Vec row[C];
    for (int c = 0; c < C; ++c) row[c] = load_float(k + c * kWidth);
    for (int g = 0; g < G; ++g) {
      Vec dot = q[g][0] * row[0];
      for (int c = 1; c < C; ++c) dot = at::vec::fmadd(q[g][c], row[c], dot);
      dots[g][j] = dot;
    }
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * n, sum_lanes_16(dots[g]));
}
#endif

template <typename T, int G, int D>
void scores_fixed(const float* qf, const T* keys, const int32_t* table, int64_t first,
                  int64_t context, int64_t bs, float* scores) {
  constexpr int C = D / kWidth;
  const int64_t n = context - first;
  Vec q[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) q[g][c] = Vec::loadu(qf + (g * C + c) * kWidth);
  int64_t t = first;
#if defined(CPU_CAPABILITY_AVX512)
  for (; t + 16 <= context; t += 16)
    scores_of_16<T, G, C>(q, keys, table, t, bs, n, scores + (t - first));
#endif
  for (int64_t b = t / bs; t < context; ++b) {
    const T* k = keys + (static_cast<int64_t>(table[b]) * bs + t % bs) * D;
    for (const int64_t end = std::min(context, (b + 1) * bs); t < end; ++t, k += D) {
      Vec row[C];
      for (int c = 0; c < C; ++c) row[c] = load_float(k + c * kWidth);
      for (int g = 0; g < G; ++g) {
        Vec dot = q[g][0] * row[0];
        for (int c = 1; c < C; ++c) dot = at::vec::fmadd(q[g][c], row[c], dot);
        scores[g * n + (t - first)] = sum_lanes(dot);
      }
    }
  }
}

template <typename T, int G, int D>
void weighted_sum_fixed(const float* probs, const T* values, const int32_t* table, int64_t first,
                        int64_t context, int64_t bs, float* out) {
  constexpr int C = D / kWidth;
  const int64_t n = context - first;
  Vec acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = Vec(0.0f);
  for (int64_t t = first, b = first / bs; t < context; ++b) {
    const T* v = values + (static_cast<int64_t>(table[b]) * bs + t % bs) * D;
    for (const int64_t end = std::min(context, (b + 1) * bs); t < end; ++t, v += D) {
      Vec row[C];
      for (int c = 0; c < C; ++c) row[c] = load_float(v + c * kWidth);
      for (int g = 0; g < G; ++g) {
        const Vec p(probs[g * n + (t - first)]);
        for (int c = 0; c < C; ++c) acc[g][c] = at::vec::fmadd(p, row[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c].store(out + (g * C + c) * kWidth);
}

// Any group size and head dim (a multiple of kWidth): the same passes, reloading per key.
template <typename T>
void scores_any(const float* qf, const T* keys, const int32_t* table, int64_t first,
                int64_t context, int64_t bs, float* scores, int64_t G, int64_t D) {
  const int64_t chunks = D / kWidth, n = context - first;
  Vec row[kMaxChunks];
  for (int64_t t = first; t < context; ++t) {
    const T* k = keys + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * D;
    for (int64_t c = 0; c < chunks; ++c) row[c] = load_float(k + c * kWidth);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      Vec dot = Vec::loadu(qg) * row[0];
      for (int64_t c = 1; c < chunks; ++c)
        dot = at::vec::fmadd(Vec::loadu(qg + c * kWidth), row[c], dot);
      scores[g * n + (t - first)] = sum_lanes(dot);
    }
  }
}

template <typename T>
void weighted_sum_any(const float* probs, const T* values, const int32_t* table, int64_t first,
                      int64_t context, int64_t bs, float* acc, int64_t G, int64_t D) {
  const int64_t chunks = D / kWidth, n = context - first;
  std::fill(acc, acc + G * D, 0.0f);
  Vec row[kMaxChunks];
  for (int64_t t = first; t < context; ++t) {
    const T* v = values + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * D;
    for (int64_t c = 0; c < chunks; ++c) row[c] = load_float(v + c * kWidth);
    for (int64_t g = 0; g < G; ++g) {
      const Vec p(probs[g * n + (t - first)]);
      float* a = acc + g * D;
      for (int64_t c = 0; c < chunks; ++c) {
        at::vec::fmadd(p, row[c], Vec::loadu(a + c * kWidth)).store(a + c * kWidth);
      }
    }
  }
}

template <typename T>
struct Passes {
  using Pass = void (*)(const float*, const T*, const int32_t*, int64_t, int64_t, int64_t, float*);
  Pass scores = nullptr;
  Pass weighted_sum = nullptr;
};

// The fixed passes for group sizes 1-8 at head dims 64 and 128; none elsewhere.
template <typename T>
Passes<T> fixed_passes(int64_t G, int64_t D) {
  // clang-format off
#define LLMQ_FIXED(g, d) \
  if (G == g && D == d) return {&scores_fixed<T, g, d>, &weighted_sum_fixed<T, g, d>};
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
// Keys are read once (scores of every query head of the group), values once (every head's
// weighted sum).
template <typename T>
void attend_task(const T* q, int64_t q_head_stride, T* out, const T* keys, const T* values,
                 const int32_t* table, int64_t context, const Shape& s, float scale,
                 const Features& f, const float* sinks, const Passes<T>& fixed,
                 std::vector<float>& scratch) {
  const int64_t G = s.group, D = s.head_dim, bs = s.block_size, chunks = D / kWidth;
  const int64_t first = first_key(context, f.window), n = context - first;
  scratch.resize(2 * G * D + G * n + G);
  float* qf = scratch.data();
  float* acc = qf + G * D;
  float* scores = acc + G * D;
  float* inv_sum = scores + G * n;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t c = 0; c < chunks; ++c) {
      (load_float(q + g * q_head_stride + c * kWidth) * Vec(scale)).store(qf + g * D + c * kWidth);
    }
  }
  if (fixed.scores != nullptr) {
    fixed.scores(qf, keys, table, first, context, bs, scores);
  } else {
    scores_any<T>(qf, keys, table, first, context, bs, scores, G, D);
  }
  softmax_rows(scores, n, G, f.softcap, sinks, inv_sum);
  if (fixed.weighted_sum != nullptr) {
    fixed.weighted_sum(scores, values, table, first, context, bs, acc);
  } else {
    weighted_sum_any<T>(scores, values, table, first, context, bs, acc, G, D);
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
  }
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv, const at::Tensor& tables,
         const at::Tensor& contexts, const Shape& s, double scale, const Features& f) {
  const int64_t n = query.size(0);
  const int64_t slots = kv.size(1);
  const T* q = query.const_data_ptr<T>();
  const T* pool = kv.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const int32_t* table = tables.const_data_ptr<int32_t>();
  const int32_t* ctx = contexts.const_data_ptr<int32_t>();
  const int64_t q_seq = query.stride(0), q_head = query.stride(1);
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t tasks = n * s.kv_heads;
  const int64_t keys = keys_read(table, ctx, n, slots / s.block_size, s, f.window);
  // Waking the other threads costs a few us: below 512 keys of work in all, one thread runs
  // every task; the threshold matters little until it is far larger (docs/performance.md).
  const bool serial = keys * s.kv_heads < kParallelKeys || at::in_parallel_region();
  const int threads =
      serial ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
  const Passes<T> fixed = fixed_passes<T>(s.group, s.head_dim);
  // Tasks handed out as threads ask (dynamic): a thread another process preempts holds up the
  // step by the task it holds, not by the rest of a static share.
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t i = task / s.kv_heads, h = task % s.kv_heads;
      const T* keys_h = pool + h * slots * s.head_dim;
      const T* values_h = pool + (s.kv_heads + h) * slots * s.head_dim;
      attend_task<T>(q + i * q_seq + h * s.group * q_head, q_head,
                     o + i * o_seq + h * s.group * o_head, keys_h, values_h,
                     table + i * s.max_blocks, ctx[i], s, static_cast<float>(scale), f,
                     f.sinks == nullptr ? nullptr : f.sinks + h * s.group, fixed, scratch);
    }
  }
}

// out [n, Hq, D] (head rows contiguous), query [n, Hq, D] (last dim contiguous), kv [2 * Hkv,
// slots, D] (one layer of the pool: keys then values), block_tables [n, max_blocks] int32,
// context_lens [n] int32 (every one at least 1); window (0: none), softcap (0: none), sinks [Hq]
// (any float dtype) as Features says. Keys narrower than the values (MLA) are stored at the
// values' width, zero-padded, and the query with them: the pool has one width.
}  // namespace

namespace llmq {

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t block_size, double scale, int64_t window, double softcap,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.scalar_type() == kv.scalar_type(), "paged_decode_attention: one dtype");
  const Shape s = llmq::paged::checked_shape(out, query, kv, block_tables, context_lens,
                                             block_size, window, softcap);
  at::Tensor sinks_f;  // float32, alive until the tasks are done
  const Features f = llmq::paged::features_of(window, softcap, sinks, query.size(1), sinks_f);
  switch (kv.scalar_type()) {
    case at::kFloat:
      return run<float>(out, query, kv, block_tables, context_lens, s, scale, f);
    case at::kBFloat16:
      return run<c10::BFloat16>(out, query, kv, block_tables, context_lens, s, scale, f);
    case at::kHalf:
      return run<c10::Half>(out, query, kv, block_tables, context_lens, s, scale, f);
    default:
      TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16");
  }
}

}  // namespace llmq

TORCH_LIBRARY_FRAGMENT(llmq, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv, Tensor block_tables, "
      "Tensor context_lens, int block_size, float scale, int window=0, float softcap=0., "
      "Tensor? sinks=None) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &llmq::paged_decode_attention);
}
