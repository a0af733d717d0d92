// cemlm's own compute threads: the loops and teams of the CPU kernels run on a pool of threads
// that each calling thread keeps (a team of compute_threads(), the caller its thread 0). Between
// jobs a pool thread spins a short while on its own flag, then sleeps; a job wakes it with a
// system call only if it sleeps. A loop's chunks go to whichever of its threads comes for them,
// so that one kept off its core by the scheduler holds the loop back by no more than a chunk, and
// a pool thread that held a loop back while it waited for its core in the run queue, or long
// came to none, is left out of jobs for a while (kernels/cpu/parallel.cc). libgomp ends every
// region with a futex system call whether or not a thread sleeps (and starts each with another):
// about 1.5 µs each on a paravirtualized guest, where a small model's decode step spent a third of
// its time in them (docs/BENCHMARKS.md, sessions 30 and 31). OpenMP still runs OpenBLAS and the
// training-only ops that call it inside a team; its thread count, set by OMP_NUM_THREADS or
// omp_set_num_threads() (engine/src/cpu_threads.cc), is the pool's too.
#pragma once
#include <algorithm>
#include <cstdint>

namespace cemlm {

// The threads this thread's loops split over: OpenMP's setting for it (omp_get_max_threads()).
int compute_threads();

// Whether this thread is running a parallel loop's body or a team's share (the pool's, or inside
// an OpenMP region, active or not): loops started here then run on this thread alone.
bool in_parallel();

// Within parallel_team's body: this thread's number in the team, 0 to team_size() - 1; within a
// parallel loop's body: the number of the thread running it, 0 (the caller) to compute_threads()
// - 1, no two at once the same, and the loop's thread count (0 and 1 outside both).
int team_thread();
int team_size();

// Within parallel_team's body: waits until every thread of the team has called it.
void team_barrier();

// How many times, since the process started, one of its pool threads was left out of jobs for a
// while (a rest began) because it held a loop back while it waited for its core, or came to none:
// other threads of the machine had its core. The server exports it as
// cemlm:compute_thread_rests_total.
uint64_t compute_thread_rests();

namespace detail {
using TeamFn = void (*)(void* arg);
using ChunkFn = void (*)(void* arg, int64_t chunk);
// Runs fn(arg) on the caller and on up to threads − 1 (threads >= 2) threads of this thread's
// pool (those it has not left out for being long quiet), and returns when all are done.
void run_team(int threads, TeamFn fn, void* arg);
// Runs fn(arg, c) once for every c in [0, chunks) (chunks <= kMaxChunks), each on the caller or
// on one of up to threads − 1 (at most kMaxChunkThreads in all) threads of its pool, whichever
// claims it first (each thread those of its own share of [0, chunks) first), and returns when all
// are done.
void run_chunks(int threads, int64_t chunks, ChunkFn fn, void* arg);
inline constexpr int64_t kMaxChunks = 0xffff;
inline constexpr int kMaxChunkThreads = 256;
// A loop over a team of P threads is cut into this many chunks per thread: fewer would leave a
// thread the scheduler took off its core more of the loop to hold back, more would cost a
// claim each.
inline constexpr int64_t kChunksPerThread = 4;

// body(i) for i in [0, n), cut into `chunks` contiguous ranges run by run_chunks.
template <typename F>
void run_ranges(int threads, int64_t n, int64_t chunks, F& body) {
  auto range = [&](int64_t c) {
    for (int64_t i = n * c / chunks, end = n * (c + 1) / chunks; i < end; ++i) body(i);
  };
  run_chunks(
      threads, chunks, [](void* f, int64_t c) { (*static_cast<decltype(range)*>(f))(c); }, &range);
}
}  // namespace detail

// body() on a team of `threads` threads (0: compute_threads()) — fewer where the pool leaves a
// long-quiet thread out — each telling itself apart by team_thread(); on this thread alone
// (team_thread() 0, team_size() 1) where the team would be of one or this thread is in_parallel().
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

// body(i) for i in [0, n): where `parallel` (and n > 1), over up to `threads` threads (0:
// compute_threads()) in contiguous ranges of nearly equal length, kChunksPerThread per thread,
// each run by whichever thread claims it first; else a plain loop on the calling thread. body
// must not depend on which thread runs it.
template <typename F>
void parallel_for(int64_t n, bool parallel, F&& body, int threads = 0) {
  if (threads <= 0 || threads > compute_threads()) threads = compute_threads();
  if (threads > n) threads = int(n);
  if (!parallel || threads < 2 || in_parallel()) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  const int64_t chunks = std::min<int64_t>(n, threads * detail::kChunksPerThread);
  detail::run_ranges(threads, n, chunks, body);
}

// parallel_for with the items claimed one at a time (runs of them past kMaxChunks items): for
// items of uneven cost.
template <typename F>
void parallel_for_dynamic(int64_t n, bool parallel, F&& body) {
  const int threads = int(std::min<int64_t>(n, compute_threads()));
  if (!parallel || threads < 2 || in_parallel()) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  detail::run_ranges(threads, n, std::min(n, detail::kMaxChunks), body);
}

}  // namespace cemlm
