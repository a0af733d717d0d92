// cemlm's own compute threads: the loops and teams of the CPU kernels run on a pool of threads
// that each calling thread keeps (a team of compute_threads(), the caller its thread 0). Between
// jobs a pool thread spins a short while on its own flag, then sleeps; a job wakes it with a
// system call only if it sleeps. libgomp ends every region with a futex system call whether or
// not a thread sleeps (and starts each with another): about 1.5 µs each on a paravirtualized
// guest, where a small model's decode step spent a third of its time in them
// (docs/BENCHMARKS.md, sessions 30 and 31). OpenMP still runs OpenBLAS and the training-only
// ops that call it inside a team; its thread count, set by OMP_NUM_THREADS or
// omp_set_num_threads() (engine/src/cpu_threads.cc), is the pool's too.
#pragma once
#include <atomic>
#include <cstdint>

namespace cemlm {

// The threads this thread's loops split over: OpenMP's setting for it (omp_get_max_threads()).
int compute_threads();

// Whether this thread is running a parallel loop's body or a team's share (the pool's, or inside
// an OpenMP region, active or not): loops started here then run on this thread alone.
bool in_parallel();

// Within parallel_team's body: this thread's number in the team, 0 to team_size() - 1 (0 and 1
// outside a team).
int team_thread();
int team_size();

// Within parallel_team's body: waits until every thread of the team has called it.
void team_barrier();

namespace detail {
using TeamFn = void (*)(void* arg);
// Runs fn(arg) on `threads` threads of this thread's pool (threads >= 2), the caller one of them,
// and returns when all are done.
void run_team(int threads, TeamFn fn, void* arg);
}  // namespace detail

// body() on a team of `threads` threads (0: compute_threads()), each telling itself apart by
// team_thread(); on this thread alone (team_thread() 0, team_size() 1) where the team would be
// of one or this thread is in_parallel().
template <typename F>
void parallel_team(int threads, F&& body) {
  if (threads <= 0 || threads > compute_threads()) threads = compute_threads();
  if (threads < 2 || in_parallel()) {
    body();
    return;
  }
  detail::run_team(
      threads, [](void* f) { (*static_cast<F*>(f))(); }, &body);
}

// body(i) for i in [0, n): where `parallel` (and n > 1), split over a team (at most `threads`
// threads when > 0) in contiguous ranges of nearly equal length; else a plain loop on the calling
// thread. body must not depend on which thread runs it.
template <typename F>
void parallel_for(int64_t n, bool parallel, F&& body, int threads = 0) {
  if (!parallel || n < 2 || in_parallel()) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  if (threads <= 0 || threads > compute_threads()) threads = compute_threads();
  if (threads > n) threads = int(n);
  parallel_team(threads, [&] {
    const int t = team_thread(), P = team_size();
    for (int64_t i = n * t / P, end = n * (t + 1) / P; i < end; ++i) body(i);
  });
}

// parallel_for with items handed out one at a time as threads come free: for items of uneven
// cost.
template <typename F>
void parallel_for_dynamic(int64_t n, bool parallel, F&& body) {
  if (!parallel || n < 2 || in_parallel()) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::atomic<int64_t> next{0};
  parallel_team(int(n < compute_threads() ? n : compute_threads()), [&] {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) body(i);
  });
}

}  // namespace cemlm
