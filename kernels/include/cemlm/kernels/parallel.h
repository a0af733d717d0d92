// Loops split over the OpenMP team only where that pays, and otherwise run without entering an
// OpenMP region at all. libgomp ends every region, even one whose `if` clause is false (a team of
// one), with a barrier that wakes its waiters by a futex system call whether or not any sleeps:
// about 1.5 µs on a paravirtualized guest (docs/BENCHMARKS.md, session 30), where a small model's
// decode step entered some fifty such regions for its element-wise ops and small products.
#pragma once
#include <cstdint>

namespace cemlm {

// body(i) for i in [0, n): where `parallel` (and n > 1), split over the team in contiguous
// ranges (schedule static; `threads` > 0: a team of at most that many); else a plain loop on the
// calling thread. body must not depend on which thread runs it.
template <typename F>
void parallel_for(int64_t n, bool parallel, F&& body, int threads = 0) {
  if (!parallel || n < 2) {
    for (int64_t i = 0; i < n; ++i) body(i);
  } else if (threads > 0) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

// parallel_for with items handed out one at a time as threads come free (schedule dynamic, 1):
// for items of uneven cost.
template <typename F>
void parallel_for_dynamic(int64_t n, bool parallel, F&& body) {
  if (!parallel || n < 2) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) body(i);
}

}  // namespace cemlm
