// The compute pool behind parallel.h. Each thread that starts a team keeps its own pool (as
// libgomp gives each such thread a team of its own): a thread calling from an engine's step loop
// never waits on another engine's. Pool thread i waits for its jobs on its own cache line: it
// spins kSpinNanos, then sleeps on a futex, and says so, so that the thread that posts a job
// makes the wake-up system call only for a sleeper. The caller runs its share as thread 0 and
// then spins until the others are done; team_barrier() spins likewise. Spins that outlast
// kSpinNanos yield the core instead (another process, or a pool thread that a busy machine
// descheduled, may need it).
#include "cemlm/kernels/parallel.h"

#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace cemlm {
namespace {

// How long a waiting thread spins before it sleeps (a pool thread between jobs) or yields (a team
// waiting for its members). A decode step's loops come microseconds apart; a step's gap for
// sampling and scheduling is tens of microseconds. Spinning longer keeps a core from a process
// beside the engine (docs/BENCHMARKS.md, session 23: libgomp's 5 ms spin made a niced server
// 300× slower beside one busy process).
constexpr int64_t kSpinNanos = 50'000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until done() (true), or for kSpinNanos (false).
template <typename Done>
bool spin_until(Done done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kSpinNanos);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= until) return false;
  }
}

// Waits until done(): spinning, then yielding the core between checks.
template <typename Done>
void wait_until(Done done) {
  if (spin_until(done)) return;
  while (!done()) std::this_thread::yield();
}

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
              std::atomic<uint32_t>::is_always_lock_free);
uint32_t* futex_word(std::atomic<uint32_t>* a) { return reinterpret_cast<uint32_t*>(a); }

// One pool thread's mailbox: `posted` counts the jobs given to it; `sleeping` is set while it
// sleeps (or is about to) on `posted`.
struct alignas(64) Mailbox {
  std::atomic<uint32_t> posted{0};
  std::atomic<uint32_t> sleeping{0};
};

class Pool;

// The team this thread is in (nullptr: none) and its place in it.
struct Membership {
  Pool* pool = nullptr;
  int index = 0;
  int size = 1;
};
thread_local Membership t_member;

class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() {
    stop_.store(true, std::memory_order_relaxed);
    for (auto& m : boxes_) post(*m);
    for (std::thread& t : threads_) t.join();
  }

  void run(int threads, detail::TeamFn fn, void* arg) {
    while (int(threads_.size()) < threads - 1) add_thread();
    fn_ = fn, arg_ = arg, size_ = threads;
    pending_.store(threads - 1, std::memory_order_relaxed);
    for (int i = 0; i < threads - 1; ++i) post(*boxes_[i]);
    member(0, fn, arg);
    wait_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
  }

  void barrier() {
    const uint32_t phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
    } else {
      wait_until([&] { return phase_.load(std::memory_order_acquire) != phase; });
    }
  }

 private:
  void member(int index, detail::TeamFn fn, void* arg) {
    t_member = {this, index, size_};
    fn(arg);
    t_member = {};
  }

  // Wakes the mailbox's thread for the job just set up (or to stop). The increment is a full
  // barrier, so a thread that set `sleeping` and then saw no job is seen sleeping here.
  static void post(Mailbox& m) {
    m.posted.fetch_add(1, std::memory_order_seq_cst);
    if (m.sleeping.load(std::memory_order_seq_cst))
      syscall(SYS_futex, futex_word(&m.posted), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }

  void add_thread() {
    boxes_.push_back(std::make_unique<Mailbox>());
    Mailbox* box = boxes_.back().get();
    const int index = int(threads_.size()) + 1;
    threads_.emplace_back([this, box, index] { serve(*box, index); });
  }

  void serve(Mailbox& box, int index) {
    for (uint32_t seen = 0;; ++seen) {  // one job per post: `posted` is seen + 1 when it comes
      auto posted = [&] { return box.posted.load(std::memory_order_acquire) != seen; };
      if (!spin_until(posted)) {
        box.sleeping.store(1, std::memory_order_seq_cst);
        while (box.posted.load(std::memory_order_seq_cst) == seen)
          syscall(SYS_futex, futex_word(&box.posted), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr,
                  0);
        box.sleeping.store(0, std::memory_order_relaxed);
      }
      if (stop_.load(std::memory_order_relaxed)) return;
      member(index, fn_, arg_);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::unique_ptr<Mailbox>> boxes_;  // thread i + 1's
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  // The job: set before its posts, read by its members after theirs.
  detail::TeamFn fn_ = nullptr;
  void* arg_ = nullptr;
  int size_ = 1;
  alignas(64) std::atomic<int> pending_{0};  // members still running, the caller left out
  alignas(64) std::atomic<int> arrived_{0};  // at the team barrier
  std::atomic<uint32_t> phase_{0};
};

thread_local std::unique_ptr<Pool> t_pool;  // the pool of the teams this thread starts

// A child of fork() has only the forking thread: its pool's threads are gone, so it forgets the
// pool (the memory is left) and starts another when it needs one.
void forget_pool_in_child() { (void)t_pool.release(); }

}  // namespace

int compute_threads() { return omp_get_max_threads(); }

bool in_parallel() { return t_member.pool != nullptr || omp_get_level() > 0; }

int team_thread() { return t_member.index; }
int team_size() { return t_member.size; }

void team_barrier() {
  if (t_member.pool && t_member.size > 1) t_member.pool->barrier();
}

namespace detail {
void run_team(int threads, TeamFn fn, void* arg) {
  static std::once_flag at_fork;
  std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  if (!t_pool) t_pool = std::make_unique<Pool>();
  t_pool->run(threads, fn, arg);
}
}  // namespace detail

}  // namespace cemlm
