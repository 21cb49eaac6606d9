// The loops the panel kernels share (panel_matmul.cpp, int_matmul.cpp): every panel of a
// projection through the team of threads, and the rows through a panel in passes whose row
// count is a compile-time constant (each pass keeps its rows' sums in registers).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace llmq {

constexpr int64_t kPassRows = 8;  // rows a pass keeps in registers at the most

// run(p) for every panel p in [0, count), handed out as threads ask for them (dynamic), `chunk`
// consecutive panels at a time: a thread that another process preempts holds up only the
// panels it holds, not the whole team at a static share's end. Panels lie one after another in
// memory, so a chunk is one stream the hardware prefetcher follows; panels handed out one by one
// broke that stream and read the weights slower (docs/performance.md).
template <typename F>
void for_each_panel(int64_t count, const F& run, int64_t chunk = 1) {
  const int threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t p = 0; p < count; ++p) run(p);
  } else {
#pragma omp parallel for schedule(dynamic, chunk) num_threads(threads)
    for (int64_t p = 0; p < count; ++p) run(p);
  }
}

// pass(r0, std::integral_constant<int, R>{}) over rows [0, rows), R up to kPassRows a pass.
template <typename F>
void in_row_passes(int64_t rows, const F& pass) {
  for (int64_t r0 = 0; r0 < rows; r0 += kPassRows) {
    switch (std::min(rows - r0, kPassRows)) {
      case 1:
        pass(r0, std::integral_constant<int, 1>{});
        break;
      case 2:
        pass(r0, std::integral_constant<int, 2>{});
        break;
      case 3:
        pass(r0, std::integral_constant<int, 3>{});
        break;
      case 4:
        pass(r0, std::integral_constant<int, 4>{});
        break;
      case 5:
        pass(r0, std::integral_constant<int, 5>{});
        break;
      case 6:
        pass(r0, std::integral_constant<int, 6>{});
        break;
      case 7:
        pass(r0, std::integral_constant<int, 7>{});
        break;
      default:
        pass(r0, std::integral_constant<int, 8>{});
        break;
    }
  }
}

}  // namespace llmq
