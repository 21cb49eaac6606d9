// Sixteen lanes of int32 or float32 for int_matmul.cpp's integer dot products: one AVX-512
// register where the CPU has AVX512-VNNI, else two AVX2 registers,
// so that one kernel source serves both.
//
// A panel step reads 64 bytes: 4 bytes (inputs) for each of 16 output columns. dot_u8 adds, to
// each column's lane, the sum of its 4 unsigned bytes times the 4 signed activation bytes of one
// int32 word: vpdpbusd on AVX512-VNNI; on AVX2 vpmaddubsw (pairs into int16) then vpmaddwd,
// exact while a pair's sum fits int16, as for 4-bit values (15 * 127 * 2). int8 weights are
// stored q + 128: dot_q8 adds the q8 products on either ISA, vpdpbusd's on the biased bytes
// (kQ8Bias: the caller subtracts 128 * sum(x)), AVX2's on the signed q (q = byte ^ 0x80) by
// llama.cpp's sign trick, |q| * (x * sign(q)), each product within 127 * 127: no saturation.
// add_nibble_dot sums a group's 4-bit products: vpdpbusd's int32 on AVX512-VNNI, int16 pair sums
// on AVX2 widened once a group (NibbleSums, widen).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LLMQ_INT_MATMUL 1
#define LLMQ_INT_LANES_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLMQ_INT_MATMUL 1
#endif

#if defined(LLMQ_INT_MATMUL)
namespace llmq {
namespace lanes {

// To bfloat16 as torch rounds (to nearest, ties to even).
inline uint16_t to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

#if defined(LLMQ_INT_LANES_AVX512)
constexpr int32_t kQ8Bias = 128;

struct Bytes { __m512i v; };
struct Ints { __m512i v; };
struct Floats { __m512 v; };

inline Bytes load_bytes(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline Bytes low_nibbles(Bytes b) { return {_mm512_and_si512(b.v, _mm512_set1_epi8(0x0F))}; }
inline Bytes high_nibbles(Bytes b) {
  return {_mm512_and_si512(_mm512_srli_epi16(b.v, 4), _mm512_set1_epi8(0x0F))};
}
inline Ints ints(int32_t v) { return {_mm512_set1_epi32(v)}; }
inline Ints add(Ints a, Ints b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline Ints dot_u8(Ints acc, Bytes w, int32_t x) {
  return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x))};
}
inline Ints dot_q8(Ints acc, Bytes biased, int32_t x) { return dot_u8(acc, biased, x); }
// A group's 4-bit products (see NibbleSums below): vpdpbusd's int32 sums as they are.
constexpr bool kChainedDots = true;
using NibbleSums = Ints;
inline NibbleSums add_nibble_dot(NibbleSums acc, Bytes w, int32_t x) { return dot_u8(acc, w, x); }
inline Ints widen(NibbleSums s) { return s; }
// 6-bit values (int6_matmul.cpp): a step's low-nibble and high-nibble products, each below
// 2 * 63 * 127 in a pair.
inline Ints add_six_dot(Ints acc, Bytes lo, int32_t xlo, Bytes hi, int32_t xhi) {
  return dot_u8(dot_u8(acc, lo, xlo), hi, xhi);
}
inline Bytes or_bytes(Bytes a, Bytes b) { return {_mm512_or_si512(a.v, b.v)}; }
// Bits 4-5 of each byte of h shifted by Shift (left; right where negative), the rest zero.
template <int Shift>
inline Bytes bits_4_5(Bytes h) {
  __m512i v = h.v;
  if constexpr (Shift > 0) v = _mm512_slli_epi16(v, Shift);
  if constexpr (Shift < 0) v = _mm512_srli_epi16(v, -Shift);
  return {_mm512_and_si512(v, _mm512_set1_epi8(0x30))};
}

inline Floats floats(float v) { return {_mm512_set1_ps(v)}; }
inline Floats to_floats(Ints a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline Floats add(Floats a, Floats b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Floats mul(Floats a, Floats b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Floats fmadd(Floats a, Floats b, Floats c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Floats fnmadd(Floats a, Floats b, Floats c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline Floats load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline Floats load_f16(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
// 16 bytes as floats: unsigned, or signed.
inline Floats load_u8(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline Floats load_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// The first `count` of 16 floats, zeros past them.
inline Floats load_first(const float* p, int64_t count) {
  const __mmask16 mask = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  return {_mm512_maskz_loadu_ps(mask, p)};
}
inline void to_array(Floats a, float* out) { _mm512_storeu_ps(out, a.v); }
// All 16 lanes into out: float32, or bfloat16 rounded as to_bf16 (one vector store).
inline void store16(Floats a, float* out) { _mm512_storeu_ps(out, a.v); }
template <typename O>
inline void store16(Floats a, O* out) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

#else  // AVX2: two registers of 8 lanes
constexpr int32_t kQ8Bias = 0;

struct Bytes { __m256i lo, hi; };
struct Ints { __m256i lo, hi; };
struct Floats { __m256 lo, hi; };

inline Bytes load_bytes(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline Bytes low_nibbles(Bytes b) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(b.lo, m), _mm256_and_si256(b.hi, m)};
}
inline Bytes high_nibbles(Bytes b) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(b.lo, 4), m),
          _mm256_and_si256(_mm256_srli_epi16(b.hi, 4), m)};
}
inline Ints ints(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline Ints add(Ints a, Ints b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline __m256i pair_sums(__m256i u8, __m256i s8) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1));
}
inline Ints dot_u8(Ints acc, Bytes w, int32_t x) {
  const __m256i xv = _mm256_set1_epi32(x);
  return {_mm256_add_epi32(acc.lo, pair_sums(w.lo, xv)),
          _mm256_add_epi32(acc.hi, pair_sums(w.hi, xv))};
}
inline __m256i signed_dot(__m256i biased, __m256i xv) {
  const __m256i q = _mm256_xor_si256(biased, _mm256_set1_epi8(static_cast<char>(0x80)));
  return pair_sums(_mm256_abs_epi8(q), _mm256_sign_epi8(xv, q));
}
inline Ints dot_q8(Ints acc, Bytes biased, int32_t x) {
  const __m256i xv = _mm256_set1_epi32(x);
  return {_mm256_add_epi32(acc.lo, signed_dot(biased.lo, xv)),
          _mm256_add_epi32(acc.hi, signed_dot(biased.hi, xv))};
}
// A group's 4-bit products: vpmaddubsw's int16 pair sums added as int16, widened once a group
// by vpmaddwd (a group's 8 steps sum at most 8 * 2 * 15 * 127 = 30,480 in a lane: exact), as
// llama.cpp sums its 4-bit blocks: one multiply a step instead of two, faster on AVX2; four rows
// a pass and L1-sized panel slices gained nothing and were dropped (docs/performance.md).
constexpr bool kChainedDots = false;  // vpaddw / vpaddd chains: a cycle a step
struct NibbleSums { __m256i lo, hi; };
inline NibbleSums add_nibble_dot(NibbleSums acc, Bytes w, int32_t x) {
  const __m256i xv = _mm256_set1_epi32(x);
  return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(w.lo, xv)),
          _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(w.hi, xv))};
}
inline NibbleSums add(NibbleSums a, NibbleSums b) {
  return {_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)};
}
inline Ints widen(NibbleSums s) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(s.lo, ones), _mm256_madd_epi16(s.hi, ones)};
}
// 6-bit values (int6_matmul.cpp): a step's low-nibble and high-nibble pair sums added in int16
// (at most 2 * 2 * 63 * 127 = 32,004: exact), widened once.
inline Ints add_six_dot(Ints acc, Bytes lo, int32_t xlo, Bytes hi, int32_t xhi) {
  const __m256i xl = _mm256_set1_epi32(xlo), xh = _mm256_set1_epi32(xhi);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(lo.lo, xl), _mm256_maddubs_epi16(hi.lo, xh));
  const __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(lo.hi, xl), _mm256_maddubs_epi16(hi.hi, xh));
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a, ones)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(b, ones))};
}
inline __m128i eight_bytes(const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
// Q6_K's sub-blocks (int6_matmul.cpp's q6k_pass): int16 pairs, one a column's lane, against
// which vpmaddwd widens a step's pair sums: with a sub-block's scale in both halves it widens
// and scales them at once, so a group's two sub-blocks share one int32 sum a row.
struct Pairs { __m256i lo, hi; };
// Each of 16 columns' int8 scale (s[c] << shift) in the low half of its lane, t[c] << shift in
// the high half.
inline __m256i pairs8(const int8_t* s, const int8_t* t, int shift) {
  const __m256i a = _mm256_cvtepi8_epi32(eight_bytes(s)), b = _mm256_cvtepi8_epi32(eight_bytes(t));
  const __m256i low = _mm256_and_si256(_mm256_sll_epi32(a, _mm_cvtsi32_si128(shift)),
                                       _mm256_set1_epi32(0xFFFF));
  return _mm256_or_si256(low, _mm256_sll_epi32(b, _mm_cvtsi32_si128(shift + 16)));
}
inline Pairs pairs(const int8_t* s, const int8_t* t, int shift) {
  return {pairs8(s, t, shift), pairs8(s + 8, t + 8, shift)};
}
inline Ints add_six_dot(Ints acc, Bytes lo, int32_t xlo, Bytes hi, int32_t xhi, Pairs scale) {
  const __m256i xl = _mm256_set1_epi32(xlo), xh = _mm256_set1_epi32(xhi);
  const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(lo.lo, xl), _mm256_maddubs_epi16(hi.lo, xh));
  const __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(lo.hi, xl), _mm256_maddubs_epi16(hi.hi, xh));
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a, scale.lo)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(b, scale.hi))};
}
// acc - (each column's pair times the int16 pair `both`, low and high halves, summed).
inline Ints sub_pair_dot(Ints acc, Pairs p, int32_t both) {
  const __m256i v = _mm256_set1_epi32(both);
  return {_mm256_sub_epi32(acc.lo, _mm256_madd_epi16(p.lo, v)),
          _mm256_sub_epi32(acc.hi, _mm256_madd_epi16(p.hi, v))};
}
inline Bytes or_bytes(Bytes a, Bytes b) {
  return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)};
}
template <int Shift>
inline __m256i shifted_4_5(__m256i v) {
  if constexpr (Shift > 0) v = _mm256_slli_epi16(v, Shift);
  if constexpr (Shift < 0) v = _mm256_srli_epi16(v, -Shift);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x30));
}
template <int Shift>
inline Bytes bits_4_5(Bytes h) { return {shifted_4_5<Shift>(h.lo), shifted_4_5<Shift>(h.hi)}; }

inline Floats floats(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline Floats to_floats(Ints a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline Floats add(Floats a, Floats b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Floats mul(Floats a, Floats b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Floats fmadd(Floats a, Floats b, Floats c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Floats fnmadd(Floats a, Floats b, Floats c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline __m256 bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline Floats load_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline Floats load_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline Floats load_u8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight_bytes(p))),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight_bytes(p + 8)))};
}
inline Floats load_i8(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight_bytes(p))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight_bytes(p + 8)))};
}
inline Floats load_first(const float* p, int64_t count) {
  float tmp[16] = {};
  std::memcpy(tmp, p, sizeof(float) * (count >= 16 ? 16 : count));
  return {_mm256_loadu_ps(tmp), _mm256_loadu_ps(tmp + 8)};
}
inline void to_array(Floats a, float* out) {
  _mm256_storeu_ps(out, a.lo);
  _mm256_storeu_ps(out + 8, a.hi);
}
#endif

inline Floats fmadd(Ints a, Floats b, Floats c) { return fmadd(to_floats(a), b, c); }

// The first `count` of the 16 lanes into out (float32, or bfloat16 as torch rounds).
template <typename O>
inline void store_first(Floats a, O* out, int64_t count) {
#if defined(LLMQ_INT_LANES_AVX512)
  if (count >= 16) return store16(a, out);
#endif
  alignas(64) float tmp[16];
  to_array(a, tmp);
  const int64_t n = count >= 16 ? 16 : count;
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<O, float>) {
      out[i] = tmp[i];
    } else {
      const uint16_t bits = to_bf16(tmp[i]);
      std::memcpy(&out[i], &bits, 2);
    }
  }
}

}  // namespace lanes
}  // namespace llmq
#endif
