// bfloat16 projections over a weight layout of llmq's own, on CPUs with AVX512-BF16: any row
// count, from a lone stream's decode to a prompt chunk.
//
// A decode step of one row reads every weight once and does two flops per weight read: its time
// is memory bandwidth plus what each call costs besides, so each call is kept cheap and reads the
// weights at the memory's pace (docs/performance.md, "Choices: CPU kernels"). Each projection
// is one parallel loop over panels of 32 output columns whose weights lie in one contiguous
// run, in the pair-interleaved order vdpbf16ps reads: [panel][K / 2][32 columns][2]. Panels
// are handed out as threads ask for them (dynamic), so a thread that another process preempts
// holds up only the panel it holds, not the whole team at a static share's end. Rows go eight
// at a time through a panel (two float32 sums each in registers); the panel stays in cache for
// the next eight, so the same loop serves prompt chunks at oneDNN's pace or better.
//
// Sums in float32 (vdpbf16ps: pairs of bfloat16 products added to a float32 lane; or, where the
// CPU runs them faster, float32 FMAs that add the same products in the same order; or, where
// the CPU has AMX and its tiles time faster at load, tdpbf16ps on tiles that load the panels as
// they lie, at every row count), then the bias, one rounding to bfloat16. Not oneDNN's summation order: its output differs from
// F.linear's by roundings, as any other bfloat16 matmul's does.

#include "vec.h"  // first: it sets the ISA ATen's headers compile for

#include "panel_loop.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__)
#define LLMQ_PANEL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace llmq {
namespace {

constexpr int64_t kPanel = 32;  // output columns per panel: two vectors of 16 float32 lanes
constexpr int64_t kMaxRows = kPassRows;  // rows a panel's pass keeps in registers (2 sums each)
// Fewer rows than this take vdpbf16ps whichever sums were chosen: per weight read the FMAs cost
// three times the instructions, which only compute-bound row counts repay (docs/performance.md).
constexpr int64_t kFmaMinRows = 8;
// vdpbf16ps passes prefetch their panel 4 KB ahead, as the integer kernels do: the hardware's
// prefetchers alone leave decode-sized passes short of the memory's pace (docs/performance.md).
constexpr int64_t kAheadWords = 1024;

#if defined(__AVX512BF16__)
// Each row's sums for one panel, rounded to bfloat16 with the bias added, into out's columns
// [0, cols) (cols <= 32).
template <int R>
void store_rows(const __m512 (&sum)[R][2], const at::BFloat16* bias, at::BFloat16* out,
                int64_t out_stride, int64_t cols) {
  for (int half = 0; half < 2; ++half) {
    const int64_t n = cols - half * 16;
    if (n <= 0) break;
    const __mmask16 mask = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + half * 16);
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int r = 0; r < R; ++r) {
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum[r][half], b));
      _mm256_mask_storeu_epi16(out + r * out_stride + half * 16, mask, rounded);
    }
  }
}

// Rows [0, R) of x (K / 2 bfloat16 pairs each, x_stride pairs apart) times one panel, with
// vdpbf16ps.
template <int R>
void panel_pass(const uint32_t* w, const uint32_t* x, int64_t x_stride, int64_t pairs,
                const at::BFloat16* bias, at::BFloat16* out, int64_t out_stride, int64_t cols) {
  __m512 sum[R][2];
  for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k * kPanel + kAheadWords), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + k * kPanel + kAheadWords + 16), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_stride + k]));
      sum[r][0] = _mm512_dpbf16_ps(sum[r][0], w0, xr);
      sum[r][1] = _mm512_dpbf16_ps(sum[r][1], w1, xr);
    }
  }
  store_rows<R>(sum, bias, out, out_stride, cols);
}

// The same with float32 FMAs: each bfloat16 widened to the float32 whose top half it is (exact),
// x widened too, its eight rows interleaved (x[k * 8 + r]: a pair's broadcasts read one cache
// line, not eight rows). vdpbf16ps adds a pair's odd product, then its even one, each product
// exact in float32 and each add rounded once: so do these FMAs, and the sums equal vdpbf16ps's
// wherever no denormal occurs (vdpbf16ps flushes those to zero).
template <int R>
void panel_pass_fma(const uint32_t* w, const float* x, int64_t pairs, const at::BFloat16* bias,
                    at::BFloat16* out, int64_t out_stride, int64_t cols) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 sum[R][2];
  for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    const __m512i w0 = _mm512_loadu_si512(w + k * kPanel);
    const __m512i w1 = _mm512_loadu_si512(w + k * kPanel + 16);
    const __m512 odd0 = _mm512_castsi512_ps(_mm512_and_si512(w0, high));
    const __m512 even0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
    const __m512 odd1 = _mm512_castsi512_ps(_mm512_and_si512(w1, high));
    const __m512 even1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
    const float* xe = x + 2 * k * kMaxRows;
    const float* xo = xe + kMaxRows;
    for (int r = 0; r < R; ++r) {
      const __m512 o = _mm512_set1_ps(xo[r]), e = _mm512_set1_ps(xe[r]);
      sum[r][0] = _mm512_fmadd_ps(even0, e, _mm512_fmadd_ps(odd0, o, sum[r][0]));
      sum[r][1] = _mm512_fmadd_ps(even1, e, _mm512_fmadd_ps(odd1, o, sum[r][1]));
    }
  }
  store_rows<R>(sum, bias, out, out_stride, cols);
}

// x [rows, K] bfloat16 widened to float32 in groups of eight rows, each group [K][8] (the
// last one's missing rows left as they are: no pass reads them).
void widen_rows(const at::BFloat16* x, int64_t rows, int64_t k, std::vector<float>& out) {
  out.resize(((rows + kMaxRows - 1) / kMaxRows) * kMaxRows * k);
  const auto* bits = reinterpret_cast<const uint16_t*>(x);
  for (int64_t r = 0; r < rows; ++r) {
    float* group = out.data() + (r / kMaxRows) * kMaxRows * k + r % kMaxRows;
    for (int64_t i = 0; i < k; ++i) {
      const uint32_t f = static_cast<uint32_t>(bits[r * k + i]) << 16;
      std::memcpy(group + i * kMaxRows, &f, sizeof f);
    }
  }
}

// Rows [0, rows) through one panel, eight at a time; X is uint32_t (bfloat16 pairs, for
// vdpbf16ps) or float (for the FMAs).
template <typename X>
void panel_rows(int64_t rows, const uint32_t* w, const X* x, int64_t x_stride, int64_t pairs,
                const at::BFloat16* bias, at::BFloat16* out, int64_t out_stride, int64_t cols) {
  in_row_passes(rows, [&](int64_t r0, auto count) {
    constexpr int R = decltype(count)::value;
    // vdpbf16ps reads rows x_stride pairs apart; the FMAs their group of eight, [K][8].
    const X* xr = x + r0 * x_stride;
    at::BFloat16* o = out + r0 * out_stride;
    if constexpr (std::is_same_v<X, float>) {
      panel_pass_fma<R>(w, xr, pairs, bias, o, out_stride, cols);
    } else {
      panel_pass<R>(w, xr, x_stride, pairs, bias, o, out_stride, cols);
    }
  });
}
#endif

#if defined(LLMQ_PANEL_AMX)
// AMX (tdpbf16ps: a tile of up to 16 rows times 16 pairs of K into 16 x 16 float32 sums). The
// panels are already what tiles load: 16 pairs of K of a panel are 16 rows of 128 bytes, the
// first 16 columns' pairs in the first 64 bytes of each (one B tile), the next 16's in the
// second. Tiles 0-2 hold a group of 16 rows (two C tiles, one A tile), 5-7 the call's last,
// shorter group (tail rows), 3-4 the panel's two B tiles. The pairs past the last whole 16
// (K's tail) are added with vdpbf16ps to the sums the tiles stored: every row's sums are the
// same whatever the rows beside it.
constexpr int kTilePairs = 16;  // pairs of K a tile op takes: 64 bytes a row
constexpr int kTileRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether the OS lets this process use tile data (Linux asks for it once per process).
bool amx_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

// Calls on AMX so far: each thread loads its tile configuration once per call (another
// library's AMX kernels, oneDNN's, release the tiles on the same threads between two calls).
std::atomic<uint64_t> amx_calls{0};

// This thread's tiles configured for groups of 16 rows and a last group of `tail` rows (1 to
// 16), once in call `call`.
void configure_tiles(int tail, uint64_t call) {
  thread_local uint64_t configured = 0;
  if (configured == call) return;
  TileConfig cfg;
  for (int t : {0, 1, 2}) cfg.rows[t] = kTileRows;
  for (int t : {5, 6, 7}) cfg.rows[t] = static_cast<uint8_t>(tail);
  for (int t : {3, 4}) cfg.rows[t] = kTilePairs;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  configured = call;
}

// One group's sums over the panel's whole tiles of K, stored to c [rows][32] float32. The
// tile numbers are immediates (the intrinsics name them in the instruction): C0, C1 the
// group's sums, A its rows; a macro makes the full groups' and the tail group's.
#define LLMQ_AMX_GROUP(NAME, C0, C1, A)                                                      \
  void NAME(const char* w, const char* x, int64_t x_bytes, int64_t blocks, bool prefetch,   \
            float* c) {                                                                     \
    _tile_zero(C0);                                                                         \
    _tile_zero(C1);                                                                         \
    for (int64_t b = 0; b < blocks; ++b) {                                                  \
      const char* wb = w + b * kTilePairs * kPanel * 4;                                     \
      if (prefetch) {                                                                       \
        for (int line = 0; line < kTilePairs * 2; ++line) {                                 \
          _mm_prefetch(wb + 4 * kAheadWords + line * 64, _MM_HINT_T0);                     \
        }                                                                                   \
      }                                                                                     \
      _tile_loadd(A, x + b * kTilePairs * 4, x_bytes);                                      \
      _tile_loadd(3, wb, kPanel * 4);                                                       \
      _tile_loadd(4, wb + 64, kPanel * 4);                                                  \
      _tile_dpbf16ps(C0, A, 3);                                                             \
      _tile_dpbf16ps(C1, A, 4);                                                             \
    }                                                                                       \
    _tile_stored(C0, c, kPanel * 4);                                                        \
    _tile_stored(C1, c + 16, kPanel * 4);                                                   \
  }

LLMQ_AMX_GROUP(amx_group_full, 0, 1, 2)
LLMQ_AMX_GROUP(amx_group_tail, 5, 6, 7)
#undef LLMQ_AMX_GROUP

// Rows' float32 sums c [rows][32] plus K's tail pairs [from, pairs) with vdpbf16ps, plus the
// bias, rounded to bfloat16 into out's columns [0, cols), as store_rows does.
void finish_rows(float* c, int64_t rows, const uint32_t* w, const uint32_t* x, int64_t x_stride,
                 int64_t from, int64_t pairs, const at::BFloat16* bias, at::BFloat16* out,
                 int64_t out_stride, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 sum[1][2] = {{_mm512_loadu_ps(c + r * kPanel), _mm512_loadu_ps(c + r * kPanel + 16)}};
    for (int64_t k = from; k < pairs; ++k) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_stride + k]));
      sum[0][0] = _mm512_dpbf16_ps(sum[0][0], (__m512bh)_mm512_loadu_si512(w + k * kPanel), xr);
      sum[0][1] =
          _mm512_dpbf16_ps(sum[0][1], (__m512bh)_mm512_loadu_si512(w + k * kPanel + 16), xr);
    }
    store_rows<1>(sum, bias, out + r * out_stride, out_stride, cols);
  }
}

// Rows [0, rows) times one panel with the tiles, 16 rows at a time while the panel is in cache.
void panel_rows_amx(uint64_t call, int64_t rows, const uint32_t* w, const uint32_t* x,
                    int64_t x_stride, int64_t pairs, const at::BFloat16* bias, at::BFloat16* out,
                    int64_t out_stride, int64_t cols) {
  configure_tiles(static_cast<int>((rows - 1) % kTileRows) + 1, call);
  alignas(64) float c[kTileRows * kPanel];
  const int64_t blocks = pairs / kTilePairs;
  const auto* wb = reinterpret_cast<const char*>(w);
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t n = std::min<int64_t>(kTileRows, rows - r0);
    const auto* xb = reinterpret_cast<const char*>(x + r0 * x_stride);
    if (n == kTileRows) {
      amx_group_full(wb, xb, x_stride * 4, blocks, r0 == 0, c);
    } else {
      amx_group_tail(wb, xb, x_stride * 4, blocks, r0 == 0, c);
    }
    finish_rows(c, n, w, x + r0 * x_stride, x_stride, blocks * kTilePairs, pairs, bias,
                out + r0 * out_stride, out_stride, cols);
  }
}
#endif

}  // namespace

// Which sums the panels take: vdpbf16ps (0), float32 FMAs on widened halves (1, the same
// sums) or AMX tiles (2). The fastest depends on the CPU and a prompt's projections are
// compute-bound, so packed_linear.choose_panel_sums times them at load (docs/performance.md).
enum Sums : int64_t { kDot = 0, kFma = 1, kAmx = 2 };
std::atomic<int64_t> sums_mode{kDot};

bool panel_matmul_amx_available() {
#if defined(LLMQ_PANEL_AMX)
  return amx_granted();
#else
  return false;
#endif
}

void panel_matmul_set_sums(int64_t sums) {
  TORCH_CHECK(sums == kDot || sums == kFma || (sums == kAmx && panel_matmul_amx_available()),
              "panel_matmul: sums ", sums, " unavailable (0 vdpbf16ps, 1 FMAs, 2 AMX)");
  sums_mode.store(sums);
}

int64_t panel_matmul_sums() { return sums_mode.load(); }

bool panel_matmul_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] bfloat16 times W [N, K] in panels (packed_linear.panels: [P, K / 2, 32, 2]), plus bias
// [N]: [M, N] bfloat16.
at::Tensor panel_matmul(const at::Tensor& x_in, const at::Tensor& panels, int64_t out_features,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(panel_matmul_available(), "panel_matmul: this build has no AVX512-BF16");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16,
              "panel_matmul: x is [M, K] bf16");
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 &&
                  panels.size(2) == kPanel && panels.size(3) == 2 && panels.is_contiguous(),
              "panel_matmul: panels are [P, K / 2, 32, 2] bf16, contiguous");
  const int64_t rows = x_in.size(0), pairs = panels.size(1), count = panels.size(0);
  TORCH_CHECK(x_in.size(1) == 2 * pairs, "panel_matmul: x has ", x_in.size(1), " columns, W ",
              2 * pairs);
  TORCH_CHECK(out_features > (count - 1) * kPanel && out_features <= count * kPanel,
              "panel_matmul: ", out_features, " outputs do not fill ", count, " panels");
  TORCH_CHECK(!bias || (bias->numel() == out_features && bias->scalar_type() == at::kBFloat16 &&
                        bias->is_contiguous()),
              "panel_matmul: the bias is [N] bf16");
  at::Tensor out = at::empty({rows, out_features}, x_in.options());
#if defined(__AVX512BF16__)
  const at::Tensor x = x_in.contiguous();
  const auto* xp = reinterpret_cast<const uint32_t*>(x.const_data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint32_t*>(panels.const_data_ptr<at::BFloat16>());
  const at::BFloat16* bp = bias ? bias->const_data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t panel_words = pairs * kPanel;
  const int64_t mode = sums_mode.load(std::memory_order_relaxed);
#if defined(LLMQ_PANEL_AMX)
  // AMX serves every row count where chosen: a row's output never depends on its call's rows.
  if (mode == kAmx && rows > 0) {
    const uint64_t call = amx_calls.fetch_add(1, std::memory_order_relaxed) + 1;
    for_each_panel(count, [&](int64_t p) {
      const int64_t col = p * kPanel, cols = std::min(kPanel, out_features - col);
      panel_rows_amx(call, rows, wp + p * panel_words, xp, pairs, pairs, bp ? bp + col : nullptr,
                     op + col, out_features, cols);
    });
    return out;
  }
#endif
  const bool fma = rows >= kFmaMinRows && mode == kFma;
  // x widened once per call, into a buffer each calling thread keeps (a step's 121 projections
  // would otherwise allocate as many).
  thread_local std::vector<float> widened;
  if (fma) widen_rows(x.const_data_ptr<at::BFloat16>(), rows, 2 * pairs, widened);
  const float* xfp = widened.data();
  auto run = [&](int64_t p) {
    const int64_t col = p * kPanel, cols = std::min(kPanel, out_features - col);
    const at::BFloat16* b = bp ? bp + col : nullptr;
    if (fma) {
      panel_rows(rows, wp + p * panel_words, xfp, 2 * pairs, pairs, b, op + col, out_features,
                 cols);
    } else {
      panel_rows(rows, wp + p * panel_words, xp, pairs, pairs, b, op + col, out_features, cols);
    }
  };
  for_each_panel(count, run);
#endif
  return out;
}

}  // namespace llmq

TORCH_LIBRARY_FRAGMENT(llmq, m) {
  m.def("panel_matmul_available() -> bool", &llmq::panel_matmul_available);
  m.def("panel_matmul_amx_available() -> bool", &llmq::panel_matmul_amx_available);
  m.def("panel_matmul_set_sums(int sums) -> ()", &llmq::panel_matmul_set_sums);
  m.def("panel_matmul_sums() -> int", &llmq::panel_matmul_sums);
  m.def("panel_matmul(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor");
  m.impl("panel_matmul", c10::DispatchKey::CPU, &llmq::panel_matmul);
}
