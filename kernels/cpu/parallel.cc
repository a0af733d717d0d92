// The compute pool behind parallel.h. Each thread that starts a team keeps its own pool (as
// libgomp gives each such thread a team of its own): a thread calling from an engine's step loop
// never waits on another engine's. Every wait — a pool thread's for its next job (on a word of
// its own), the caller's for its team to finish, a team barrier's — spins kSpinNanos and then
// sleeps on a futex; whoever ends a wait makes the wake-up system call only when a waiter sleeps.
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

// How long a waiting thread spins before it sleeps: a trade between a step's latency and a
// process beside the engine. A decode step's loops come microseconds apart, and a served token's
// steps 20–50 µs apart. On the default model served at --engine-nice 10 (docs/BENCHMARKS.md,
// session 31): inter-token p50 0.18–0.22 ms at 50 µs, 0.29–0.38 at 35, 0.40–0.44 at 20 (libgomp
// bounded to 1,000 rounds: 0.33–0.40); 200 tokens beside one busy process 0.29–0.31 s at 50 µs,
// 0.20–0.22 s at 20 (libgomp: 0.21–0.28; unbounded, its 5 ms spin: past 30 s, session 23).
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
  for (int i = 0; i < 64; ++i) {  // most waits end here, before the clock is read
    if (done()) return true;
    cpu_relax();
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kSpinNanos);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= until) return false;
  }
}

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
              std::atomic<uint32_t>::is_always_lock_free);

// A 32-bit word that threads wait on. Whoever changes it so that a wait may end calls changed()
// after the change: that makes the wake-up system call only when a waiter sleeps or is about to
// (the change, a read-modify-write, and the count of sleepers are ordered so that one side
// always sees the other).
struct alignas(64) Signal {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> sleepers{0};

  // Returns once ready(value) holds.
  template <typename Ready>
  void wait(Ready ready) {
    if (spin_until([&] { return ready(value.load(std::memory_order_acquire)); })) return;
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    for (;;) {
      const uint32_t v = value.load(std::memory_order_seq_cst);
      if (ready(v)) break;
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&value), FUTEX_WAIT_PRIVATE, v, nullptr,
              nullptr, 0);
    }
    sleepers.fetch_sub(1, std::memory_order_relaxed);
  }
  void changed() {
    if (sleepers.load(std::memory_order_seq_cst) != 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&value), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
              nullptr, 0);
  }
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
    for (auto& box : boxes_) post(*box);
    for (std::thread& t : threads_) t.join();
  }

  void run(int threads, detail::TeamFn fn, void* arg) {
    while (int(threads_.size()) < threads - 1) add_thread();
    fn_ = fn, arg_ = arg, size_ = threads;
    pending_.value.store(uint32_t(threads - 1), std::memory_order_relaxed);
    for (int i = 0; i < threads - 1; ++i) post(*boxes_[i]);
    member(0);
    pending_.wait([](uint32_t left) { return left == 0; });
  }

  void barrier() {
    const uint32_t phase = phase_.value.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.value.fetch_add(1, std::memory_order_seq_cst);
      phase_.changed();
    } else {
      phase_.wait([phase](uint32_t now) { return now != phase; });
    }
  }

 private:
  void member(int index) {
    t_member = {this, index, size_};
    fn_(arg_);
    t_member = {};
  }

  // Gives the box's thread the job just set up (or the order to stop).
  static void post(Signal& box) {
    box.value.fetch_add(1, std::memory_order_seq_cst);
    box.changed();
  }

  void add_thread() {
    boxes_.push_back(std::make_unique<Signal>());
    Signal* box = boxes_.back().get();
    const int index = int(threads_.size()) + 1;
    threads_.emplace_back([this, box, index] { serve(*box, index); });
  }

  void serve(Signal& box, int index) {
    for (uint32_t seen = 0;; ++seen) {  // one job per post: the box holds seen + 1 when it comes
      box.wait([seen](uint32_t posted) { return posted != seen; });
      if (stop_.load(std::memory_order_relaxed)) return;
      member(index);
      if (pending_.value.fetch_sub(1, std::memory_order_seq_cst) == 1) pending_.changed();
    }
  }

  std::vector<std::unique_ptr<Signal>> boxes_;  // thread i + 1's jobs: how many were posted
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  // The job: set before its posts, read by its members after theirs.
  detail::TeamFn fn_ = nullptr;
  void* arg_ = nullptr;
  int size_ = 1;
  Signal pending_;                           // members still running, the caller left out
  alignas(64) std::atomic<int> arrived_{0};  // at the team barrier
  Signal phase_;                             // team barriers passed
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
