// LoRA adapters' deltas added to one fused projection's output, every adapter of a step in one
// call: y[r] += scale_s * (x[r] A_s^T) B_s^T for the rows r of each adapter slot s.
//
// A decode step reads each adapter's A and B once for its few rows (32 streams over 8 adapters:
// 4 rows each), so the deltas cost what reading the adapters' weights costs, and torch's ops add
// more: a batched matmul reads B whole, zeros of the parts it does not hold included (two thirds
// of a fused qkv's), and each call costs far more than its microseconds of arithmetic. Here A's
// rows past an adapter's rank are skipped, B is held per part (each output column reads only
// its part's rank), both are read in the weights' dtype (bfloat16 for a bfloat16 model), and a
// thread takes whole adapters (one parallel region a call: each cost tens of microseconds).
// This is several times faster than torch's batched matmuls (docs/performance.md).
// A group of many rows (a prompt chunk) multiplies x by A through torch's matmul, which reuses
// A across rows better than these blocks of four, then B here, added to y without a copy.

#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "ops.h"

namespace {

using llmq::kWidth;
using llmq::Vec;

constexpr int64_t kRowBlock = 4;     // rows that share one load of A's rows
constexpr int64_t kColumnVecs = 4;   // output columns per block of the expand: 4 vectors
constexpr int64_t kExpandRows = 2;   // rows that share one load of B's columns
constexpr int64_t kTaskColumns = 8;  // column blocks a task of the expand
constexpr int64_t kKernelRows = 32;  // above: a group's x times A through torch's matmul

// One adapter's group: rows [lo, hi) of `rows`, its slot, its rank.
struct Group {
  int64_t slot, lo, hi, rank;
};

// xa[i, j] = xf[i] . a[j] for M rows of xf (float32, k wide) and J rows of A, sharing each
// load of either (J x M accumulators: 8 of AVX2's 16 registers).
template <int M, int J, typename W>
void dot_rows(const float* xf, int64_t k, const W* a, float* xa, int64_t xa_stride) {
  Vec acc[J][M];
  for (int j = 0; j < J; ++j)
    for (int i = 0; i < M; ++i) acc[j][i] = Vec(0.0f);
  int64_t c = 0;
  for (; c + kWidth <= k; c += kWidth) {
    Vec av[J];
    for (int j = 0; j < J; ++j) av[j] = llmq::load_float(a + j * k + c);
    for (int i = 0; i < M; ++i) {
      const Vec xv = Vec::loadu(xf + i * k + c);
      for (int j = 0; j < J; ++j) acc[j][i] = at::vec::fmadd(xv, av[j], acc[j][i]);
    }
  }
  for (int j = 0; j < J; ++j) {
    for (int i = 0; i < M; ++i) {
      float sum = llmq::sum_lanes(acc[j][i]);
      for (int64_t cc = c; cc < k; ++cc) sum += xf[i * k + cc] * static_cast<float>(a[j * k + cc]);
      xa[i * xa_stride + j] = sum;
    }
  }
}

// The group's rows of xf times A rows [j, j + J).
template <int J, typename W>
void dot_all_rows(const float* xf, int64_t n, int64_t k, const W* aj, float* xa, int64_t stride) {
  int64_t i = 0;
  for (; i + kRowBlock <= n; i += kRowBlock)
    dot_rows<kRowBlock, J>(xf + i * k, k, aj, xa + i * stride, stride);
  for (; i < n; ++i) dot_rows<1, J>(xf + i * k, k, aj, xa + i * stride, stride);
}

// xa[i, j] = xf[i] . a[j], for the group's rows xf (float32 [n, k]) and every A row j of the
// rank's rows in each part (room rows a part, rank of them used).
template <typename W>
void shrink_rows(const float* xf, int64_t n, const W* a, int64_t parts, int64_t room, int64_t rank,
                 int64_t k, float* xa) {
  const int64_t stride = parts * room;
  for (int64_t p = 0; p < parts; ++p) {  // rows past the adapter's rank are zero: never read
    int64_t j = p * room;
    for (; j + 2 <= p * room + rank; j += 2) dot_all_rows<2>(xf, n, k, a + j * k, xa + j, stride);
    if (j < p * room + rank) dot_all_rows<1>(xf, n, k, a + j * k, xa + j, stride);
  }
}

// y[:n] += d * scale, rounded to y's dtype once.
template <typename T>
void add_scaled(T* y, const float* d, float scale, int64_t n) {
  const Vec s(scale);
  int64_t o = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; o + kWidth <= n; o += kWidth) (Vec::loadu(y + o) + Vec::loadu(d + o) * s).store(y + o);
  } else {  // a 16-bit dtype: two float vectors a vector of y
    for (; o + 2 * kWidth <= n; o += 2 * kWidth) {
      auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(y + o));
      lo = lo + Vec::loadu(d + o) * s;
      hi = hi + Vec::loadu(d + o + kWidth) * s;
      at::vec::convert_from_float<T>(lo, hi).store(y + o);
    }
  }
  for (; o < n; ++o) y[o] = static_cast<T>(static_cast<float>(y[o]) + d[o] * scale);
}

// d[i, :kColumnVecs vectors] = xa[i, :rank] . bt[:rank, those columns] for M rows, sharing each
// load of B.
template <int M, typename W>
void expand_block(const float* xa, int64_t xa_stride, const W* bt, int64_t width, int64_t rank,
                  float* d) {
  Vec acc[M][kColumnVecs];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < kColumnVecs; ++v) acc[i][v] = Vec(0.0f);
  for (int64_t r = 0; r < rank; ++r) {
    Vec b[kColumnVecs];
    for (int v = 0; v < kColumnVecs; ++v) b[v] = llmq::load_float(bt + r * width + v * kWidth);
    for (int i = 0; i < M; ++i) {
      const Vec x(xa[i * xa_stride + r]);
      for (int v = 0; v < kColumnVecs; ++v) acc[i][v] = at::vec::fmadd(x, b[v], acc[i][v]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < kColumnVecs; ++v)
      acc[i][v].store(d + i * kColumnVecs * kWidth + v * kWidth);
}

// y[row, o0:o1) += scale * xa[i, part's rank] . bt[:rank, o0:o1) for each row of the group.
template <typename T, typename W>
void expand_columns(T* y, int64_t y_stride, const int64_t* rows, int64_t n, const float* xa,
                    int64_t xa_stride, const W* bt, int64_t width, int64_t rank, int64_t o0,
                    int64_t o1, float scale) {
  constexpr int64_t block = kColumnVecs * kWidth;
  float d[kExpandRows * block];
  int64_t o = o0;
  for (; o + block <= o1; o += block) {
    int64_t i = 0;
    for (; i + kExpandRows <= n; i += kExpandRows) {
      expand_block<kExpandRows>(xa + i * xa_stride, xa_stride, bt + o, width, rank, d);
      for (int64_t m = 0; m < kExpandRows; ++m)
        add_scaled(y + rows[i + m] * y_stride + o, d + m * block, scale, block);
    }
    for (; i < n; ++i) {
      expand_block<1>(xa + i * xa_stride, xa_stride, bt + o, width, rank, d);
      add_scaled(y + rows[i] * y_stride + o, d, scale, block);
    }
  }
  for (; o < o1; ++o) {  // a part narrower than a block, or its last columns: one by one
    for (int64_t i = 0; i < n; ++i) {
      float sum = 0.0f;
      for (int64_t r = 0; r < rank; ++r)
        sum += xa[i * xa_stride + r] * static_cast<float>(bt[r * width + o]);
      add_scaled(y + rows[i] * y_stride + o, &sum, scale, 1);
    }
  }
}

// x's rows of a group of many rows (a prompt chunk) times A, by torch's matmul in float32, into
// that group's rows of xa: consecutive rows read as a view, others gathered.
void shrink_by_matmul(const at::Tensor& x, const at::Tensor& a, const int64_t* rows,
                      const at::Tensor& rows_t, const Group& g, at::Tensor xa) {
  const int64_t n = g.hi - g.lo;
  const bool consecutive = rows[g.hi - 1] - rows[g.lo] == n - 1;  // rows increase in a group
  const at::Tensor xs =
      consecutive ? x.narrow(0, rows[g.lo], n) : x.index_select(0, rows_t.narrow(0, g.lo, n));
  at::mm_out(xa, xs.to(at::kFloat), a[g.slot].to(at::kFloat).t());
}

// The groups' rows of x times A, float32 [rows, parts * room], each group's from `first[g]`:
// a small group's rows gathered in float32 (into xf, from `gathered[g]`) for the blocks above,
// a large one's through torch's matmul now.
template <typename T>
struct Shrunk {
  at::Tensor xa;
  std::vector<float> xf;
  std::vector<int64_t> first, gathered;

  Shrunk(const at::Tensor& x, const at::Tensor& a, const at::Tensor& rows_t,
         const std::vector<Group>& groups, int64_t ranks) {
    const int64_t k = x.size(1);
    const int64_t* rows = rows_t.const_data_ptr<int64_t>();
    int64_t total = 0, small = 0;
    for (const Group& g : groups) {
      first.push_back(total), total += g.hi - g.lo;
      gathered.push_back(small);
      if (g.hi - g.lo <= kKernelRows) small += g.hi - g.lo;
    }
    xa = at::zeros({total, ranks}, x.options().dtype(at::kFloat));
    xf.resize(small * k);
    const T* xp = x.const_data_ptr<T>();
    for (size_t g = 0; g < groups.size(); ++g) {
      const int64_t n = groups[g].hi - groups[g].lo;
      if (n > kKernelRows) {
        shrink_by_matmul(x, a, rows, rows_t, groups[g], xa.narrow(0, first[g], n));
        continue;
      }
      float* out = xf.data() + gathered[g] * k;
      for (int64_t j = groups[g].lo; j < groups[g].hi; ++j, out += k) {
        const T* in = xp + rows[j] * x.stride(0);
        for (int64_t c = 0; c < k; ++c) out[c] = static_cast<float>(in[c]);
      }
    }
  }
};

// Every group's deltas: x's rows times A (by the blocks above, or torch's matmul for a group of
// many rows), then times B, added to y, in parallel over groups and column blocks.
template <typename T, typename W>
void deltas_kernel(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                   at::IntArrayRef columns, const std::vector<float>& scales,
                   const at::Tensor& rows_t, const std::vector<Group>& groups) {
  const int64_t k = x.size(1), parts = static_cast<int64_t>(columns.size()) - 1;
  const int64_t room = bt.size(1), width = bt.size(2), ranks = parts * room;
  const int64_t* rows = rows_t.const_data_ptr<int64_t>();
  Shrunk<T> shrunk(x, a, rows_t, groups, ranks);
  float* xa = shrunk.xa.template data_ptr<float>();
  const W* ap = a.const_data_ptr<W>();
  const W* bp = bt.const_data_ptr<W>();
  auto shrink = [&](int64_t g) {
    const Group& grp = groups[g];
    if (grp.hi - grp.lo > kKernelRows) return;  // done by the matmul
    shrink_rows(shrunk.xf.data() + shrunk.gathered[g] * k, grp.hi - grp.lo,
                ap + grp.slot * ranks * k, parts, room, grp.rank, k, xa + shrunk.first[g] * ranks);
  };
  T* yp = y.data_ptr<T>();
  auto expand = [&](int64_t g, int64_t p, int64_t o0, int64_t o1) {
    const Group& grp = groups[g];
    expand_columns(yp, y.stride(0), rows + grp.lo, grp.hi - grp.lo,
                   xa + shrunk.first[g] * ranks + p * room, ranks, bp + grp.slot * room * width,
                   width, grp.rank, o0, o1, scales[grp.slot]);
  };
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  if (num_groups >= at::get_num_threads() && shrunk.xa.size(0) <= num_groups * kKernelRows) {
    // Decodes over several adapters: a thread takes whole groups, one parallel region (each
    // costs tens of microseconds, as much as a small group's arithmetic).
    at::parallel_for(0, num_groups, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t g = lo; g < hi; ++g) {
        shrink(g);
        for (int64_t p = 0; p < parts; ++p) expand(g, p, columns[p], columns[p + 1]);
      }
    });
    return;
  }
  at::parallel_for(0, num_groups, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g) shrink(g);
  });
  // Tasks of the expand: (group, part, first column), kTaskColumns blocks of columns each.
  std::vector<std::array<int64_t, 3>> tasks;
  const int64_t step = kTaskColumns * kColumnVecs * kWidth;
  for (int64_t g = 0; g < num_groups; ++g)
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t o = columns[p]; o < columns[p + 1]; o += step) tasks.push_back({g, p, o});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const auto [g, p, o] = tasks[t];
      expand(g, p, o, std::min(o + step, columns[p + 1]));
    }
  });
}

}  // namespace

namespace llmq {

// y [T, N] += each group's deltas, in place. x [T, K]; a [slots, parts * room, K] and
// bt [slots, room, N] (B transposed, each part's columns in rows [0, rank) of its own), in one
// dtype; columns: the parts' first columns in y, then N; scales [slots] float32; rows: int64
// step rows, grouped; groups: (slot, first, past the last) triples over `rows`; ranks: each
// slot's rank.
void lora_deltas(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                 at::IntArrayRef columns, const at::Tensor& scales, const at::Tensor& rows,
                 at::IntArrayRef groups, at::IntArrayRef ranks) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0) && y.stride(1) == 1 &&
                  x.stride(1) == 1 && y.scalar_type() == x.scalar_type(),
              "lora_deltas: x [T, K] and y [T, N] of one dtype, rows contiguous");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous() &&
                  a.scalar_type() == bt.scalar_type() && a.size(2) == x.size(1) &&
                  bt.size(2) == y.size(1) && a.size(0) == bt.size(0),
              "lora_deltas: a [slots, parts * room, K], bt [slots, room, N]");
  const int64_t parts = static_cast<int64_t>(columns.size()) - 1, room = bt.size(1);
  TORCH_CHECK(parts >= 1 && a.size(1) == parts * room && columns.front() == 0 &&
                  columns.back() == y.size(1),
              "lora_deltas: a part's columns for each block of A's rows");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == a.size(0) &&
                  rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                  groups.size() % 3 == 0 && static_cast<int64_t>(ranks.size()) == a.size(0),
              "lora_deltas: a float32 scale and a rank a slot, int64 rows, groups in triples");
  const int64_t* row = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < y.size(0), "lora_deltas: row out of the step");
  const float* scale = scales.const_data_ptr<float>();
  std::vector<float> slot_scales(scale, scale + scales.numel());
  std::vector<Group> kept;
  for (size_t i = 0; i < groups.size(); i += 3) {
    const int64_t slot = groups[i], lo = groups[i + 1], hi = groups[i + 2];
    TORCH_CHECK(slot >= 0 && slot < a.size(0) && lo >= 0 && lo <= hi && hi <= rows.numel() &&
                    ranks[slot] >= 0,
                "lora_deltas: a group's slot, rows or rank");
    // An adapter of a larger rank than this projection's room does not target it: zeros.
    const Group g{slot, lo, hi, std::min(ranks[slot], room)};
    if (g.rank > 0 && lo < hi) kept.push_back(g);
  }
  if (kept.empty()) return;
  const at::ScalarType weights = a.scalar_type();
  TORCH_CHECK(weights == at::kFloat || weights == y.scalar_type(),
              "lora_deltas: weights in float32 or in the activations' dtype");
  switch (y.scalar_type()) {
    case at::kFloat:
      deltas_kernel<float, float>(y, x, a, bt, columns, slot_scales, rows, kept);
      break;
    case at::kBFloat16:
      if (weights == at::kFloat) {
        deltas_kernel<c10::BFloat16, float>(y, x, a, bt, columns, slot_scales, rows, kept);
      } else {
        deltas_kernel<c10::BFloat16, c10::BFloat16>(y, x, a, bt, columns, slot_scales, rows, kept);
      }
      break;
    case at::kHalf:
      if (weights == at::kFloat) {
        deltas_kernel<c10::Half, float>(y, x, a, bt, columns, slot_scales, rows, kept);
      } else {
        deltas_kernel<c10::Half, c10::Half>(y, x, a, bt, columns, slot_scales, rows, kept);
      }
      break;
    default:
      TORCH_CHECK(false, "lora_deltas: float32, bfloat16 or float16 activations");
  }
}

}  // namespace llmq

TORCH_LIBRARY_FRAGMENT(llmq, m) {
  m.def(
      "lora_deltas(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, int[] columns, Tensor scales, "
      "Tensor rows, int[] groups, int[] ranks) -> ()");
  m.impl("lora_deltas", c10::DispatchKey::CPU, &llmq::lora_deltas);
}
