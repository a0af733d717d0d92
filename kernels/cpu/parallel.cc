// The compute pool behind parallel.h. Each thread that starts a team keeps its own pool (as
// libgomp gives each such thread a team of its own): a thread calling from an engine's step loop
// never waits on another engine's. Every wait — a pool thread's for its next job (on a word of
// its own), the caller's for its job to finish, a team barrier's — spins kSpinNanos and then
// sleeps on a futex; whoever ends a wait makes the wake-up system call only when a waiter sleeps.
//
// Two kinds of job. A team job (parallel_team) runs its body once on every member, which may meet
// at barriers, so the caller waits for each. A chunk job (parallel_for, parallel_for_dynamic) has
// its chunks claimed one at a time (each thread's own range of them first) by the caller and by
// whichever pool threads come: a pool thread that the scheduler keeps off a core (a busy process
// beside the engine, or the server's own threads) holds back no more than the chunk it claimed. A
// pool thread that kept its caller waiting on its chunk for longer than half the time the caller
// ran its own, or came to none of the chunk jobs posted to it for kQuietNanos, is left out of jobs
// (team jobs shrink) for a rest that doubles each time, so that it stops taking its core's time
// from the caller.
#include "cemlm/kernels/parallel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace cemlm {
namespace {

// How long a waiting thread spins before it sleeps: a trade between a step's latency and a
// process beside the engine. A decode step's loops come microseconds apart, and a served token's
// steps 20–50 µs apart. On the default model served at --engine-nice 10 (docs/BENCHMARKS.md,
// session 31): inter-token p50 0.18–0.22 ms at 50 µs, 0.29–0.38 at 35, 0.40–0.44 at 20 (libgomp
// bounded to 1,000 rounds: 0.33–0.40).
constexpr int64_t kSpinNanos = 50'000;

// A pool thread that held its caller back (above), or came to none of the chunk jobs posted to
// it for kQuietNanos, rests (is not posted jobs) for kMinRestNanos, twice as long after each
// rest it comes back from as slow, at most kMaxRestNanos, and kMinRestNanos again once it has
// helped for kMaxRestNanos. A pool thread woken from its sleep joins
// its caller's loops within tens of microseconds, and a chunk is at most a quarter of its share;
// one that the scheduler keeps off its core (a busy process there, or its caller on the same
// core) is gone for milliseconds (docs/BENCHMARKS.md, session 32). Waits shorter than the spin
// are not held against it, nor are those of a thread that has not lately waited for a core in
// this kernel's run queue for kShortOfCpu of its time there (its schedstat): it was slow, or the
// hypervisor took its virtual CPU for a while, as it does any other's, and resting it only
// halved the threads (a base-shape batch-32 decode on a busy host: 100 rests in 10 s, the pool
// thread ran a quarter of the time, 2.8% of it waiting for a core; session 33).
constexpr int64_t kQuietNanos = 1'000'000;
constexpr int64_t kMinRestNanos = 2'000'000;
constexpr int64_t kMaxRestNanos = 64'000'000;
constexpr double kShortOfCpu = 0.25;

std::atomic<uint64_t> g_rests{0};  // compute_thread_rests()

int64_t now_nanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

  // Returns once ready(value) holds, with the value that it held for.
  template <typename Ready>
  uint32_t wait(Ready ready) {
    uint32_t v = 0;
    if (spin_until([&] { return ready(v = value.load(std::memory_order_acquire)); })) return v;
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    for (;;) {
      v = value.load(std::memory_order_seq_cst);
      if (ready(v)) break;
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&value), FUTEX_WAIT_PRIVATE, v, nullptr,
              nullptr, 0);
    }
    sleepers.fetch_sub(1, std::memory_order_relaxed);
    return v;
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

// A chunk job's chunks are cut into one range per thread, its home: a thread claims its home's
// chunks first (the same thread takes the same part of a loop from one step to the next, and
// finds it in its caches), then the others'. A range's claim word: the job's number (high 32
// bits), the next chunk to claim and the end of the range (16 bits each). A claim is a
// compare-and-swap of the whole word, so a thread that read a finished job's word claims nothing
// of the next.
constexpr uint64_t claim_word(uint32_t job, uint32_t next, uint32_t end) {
  return uint64_t(job) << 32 | uint64_t(next) << 16 | end;
}
static_assert(detail::kMaxChunks <= 0xffff);
struct alignas(64) Range {
  std::atomic<uint64_t> word{0};
};

// A pool thread of a caller's.
struct Helper {
  Signal box;  // jobs posted to it: how many
  // The post (box value) that is a team job, and the thread's number in that team.
  std::atomic<uint32_t> team_post{0};
  int team_index = 0;
  // The last chunk job posted to it: the only one whose chunks it claims (a thread posted an
  // earlier job, late to it, would find a later one's chunks, perhaps of fewer threads than its
  // number).
  std::atomic<uint32_t> chunk_job{0};
  std::atomic<uint32_t> looked{0};              // the last chunk job it came to claim from
  alignas(64) std::atomic<uint32_t> helped{0};  // chunks it ran since the caller last looked
  std::atomic<uint32_t> running{0};             // 1 while it runs a chunk
  // The caller's alone: whether it held the current job back, `looked` when last read, since
  // when it has not come to any chunk job posted to it (-1: it came to the last), until when it
  // rests (0: it does not), its next rest, and since when it has not held a job back.
  bool held_back = false;
  uint32_t last_looked = 0;
  int64_t quiet_since = -1, rest_until = 0, rest = kMinRestNanos, good_since = -1;
  // Its thread's id, once it has read its schedstat (below) for the first time: set by the thread,
  // then its caller's. The times it had run and waited in the run queue at the last reading (-1:
  // unreadable).
  std::atomic<pid_t> tid{0};
  int64_t ran = -1, queued = -1;
};

// Thread tid's schedstat (Linux, CONFIG_SCHED_INFO): nanoseconds run and nanoseconds waited in
// the run queue for a core. False where unreadable.
bool read_schedstat(pid_t tid, int64_t* ran, int64_t* queued) {
  char path[64], text[128];
  std::snprintf(path, sizeof path, "/proc/self/task/%d/schedstat", int(tid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const ssize_t n = read(fd, text, sizeof text - 1);
  close(fd);
  if (n <= 0) return false;
  text[n] = '\0';
  long long r = 0, q = 0;
  if (std::sscanf(text, "%lld %lld", &r, &q) != 2) return false;
  *ran = r, *queued = q;
  return true;
}

// Whether h's thread waited in the run queue for kShortOfCpu or more of its time since the last
// reading, and longer than the spin (true where its schedstat cannot be read). The kernel brings
// a running thread's figures up to date at its ticks and switches: two readings within one may
// show nothing.
bool short_of_cpu(Helper& h) {
  const pid_t tid = h.tid.load(std::memory_order_acquire);
  int64_t ran = 0, queued = 0;
  if (tid == 0 || h.ran < 0 || !read_schedstat(tid, &ran, &queued)) return true;
  const double d_ran = double(ran - h.ran), d_queued = double(queued - h.queued);
  h.ran = ran, h.queued = queued;
  return d_queued >= std::max(double(kSpinNanos), kShortOfCpu * (d_ran + d_queued));
}

class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() {
    stop_.store(true, std::memory_order_relaxed);
    for (auto& h : helpers_) post(h->box);
    for (std::thread& t : threads_) t.join();
  }

  // fn(arg) on the caller and on up to threads − 1 pool threads, those not resting.
  void run_team(int threads, detail::TeamFn fn, void* arg) {
    grow(threads - 1);
    int members = 0;
    for (int i = 0; i < threads - 1; ++i) {
      Helper& h = *helpers_[size_t(i)];
      if (resting(h)) continue;
      h.team_index = ++members;
      h.team_post.store(h.box.value.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      posted_[size_t(i)] = 1;
    }
    fn_ = fn, arg_ = arg, size_ = members + 1;
    pending_.value.store(uint32_t(members), std::memory_order_relaxed);
    for (int i = 0; i < threads - 1; ++i)
      if (std::exchange(posted_[size_t(i)], char(0))) post(helpers_[size_t(i)]->box);
    member(0);
    pending_.wait([](uint32_t left) { return left == 0; });
    rethrow_failure();
  }

  // fn(arg, c) for c in [0, chunks), each claimed by the caller or by a pool thread of the
  // threads − 1 posted the job.
  void run_chunks(int threads, int64_t chunks, detail::ChunkFn fn, void* arg) {
    grow(threads - 1);
    chunk_fn_ = fn, chunk_arg_ = arg, chunks_ = uint32_t(chunks);
    chunk_threads_.store(threads, std::memory_order_relaxed);
    done_.value.store(0, std::memory_order_relaxed);
    ++job_;
    for (int t = 0; t < threads; ++t)
      ranges_[size_t(t)].word.store(
          claim_word(job_, uint32_t(chunks * t / threads), uint32_t(chunks * (t + 1) / threads)),
          std::memory_order_release);
    for (int i = 0; i < threads - 1; ++i) {
      Helper& h = *helpers_[size_t(i)];
      if ((posted_[size_t(i)] = !resting(h))) {
        h.chunk_job.store(job_, std::memory_order_relaxed);
        post(h.box);
      }
    }
    const int64_t start = now_nanos();
    claim(0, nullptr, job_);
    if (done_.value.load(std::memory_order_acquire) != uint32_t(chunks)) {
      // The chunks are all claimed: those not done yet are pool threads' that are running.
      const int64_t ran_out = now_nanos();
      for (int i = 0; i < threads - 1; ++i) {
        Helper& h = *helpers_[size_t(i)];
        h.held_back = posted_[size_t(i)] && h.running.load(std::memory_order_relaxed) != 0;
      }
      done_.wait([chunks](uint32_t done) { return done == uint32_t(chunks); });
      const int64_t waited = now_nanos() - ran_out;
      if (waited <= std::max(kSpinNanos, (ran_out - start) / 2))
        for (auto& h : helpers_) h->held_back = false;
    }
    for (int i = 0; i < threads - 1; ++i)
      if (std::exchange(posted_[size_t(i)], char(0))) heard_from(*helpers_[size_t(i)]);
    rethrow_failure();
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
    // (A team body that meets barriers must not throw between them: the others would wait.)
    run_guarded([&] { fn_(arg_); });
    t_member = {};
  }

  // f(), with what it throws (std::bad_alloc from a chunk's buffers, chiefly) kept for the
  // caller: thrown on a pool thread it would end the process, and thrown out of the caller's
  // own share it would leave the job's other threads running on a frame already unwound.
  template <typename F>
  void run_guarded(F&& f) {
    try {
      f();
    } catch (...) {
      std::lock_guard lock(failure_mu_);
      if (!failure_) failure_ = std::current_exception();
    }
  }

  // After a job, every thread done with it: the first exception one of them threw, on the caller.
  void rethrow_failure() {
    std::exception_ptr e;
    {
      std::lock_guard lock(failure_mu_);
      e = std::exchange(failure_, nullptr);
    }
    if (e) std::rethrow_exception(e);
  }

  // Claims chunk job `job`'s chunks and runs them until none is left, as thread `index` (0: the
  // caller, h nullptr; a pool thread h says when it runs one, and counts them): its home range's
  // first, then the others' in turn.
  void claim(int index, Helper* h, uint32_t job) {
    const int P = chunk_threads_.load(std::memory_order_relaxed);  // this job's or an earlier's
    for (int k = 0; k < P; ++k) {
      Range& r = ranges_[size_t((index + k) % P)];
      uint64_t w = r.word.load(std::memory_order_acquire);
      for (;;) {
        const uint32_t next = uint32_t(w >> 16) & 0xffff, end = uint32_t(w) & 0xffff;
        if (uint32_t(w >> 32) != job || next >= end) break;
        if (!r.word.compare_exchange_weak(w, w + (uint64_t(1) << 16), std::memory_order_acq_rel,
                                          std::memory_order_acquire))
          continue;
        // The job's fields, set before its words were stored, stay until its chunks are done.
        const detail::ChunkFn fn = chunk_fn_;
        void* const arg = chunk_arg_;
        const uint32_t chunks = chunks_;
        t_member = {this, index, chunk_threads_.load(std::memory_order_relaxed)};
        if (h) h->running.store(1, std::memory_order_relaxed);
        run_guarded([&] { fn(arg, next); });
        if (h) {
          h->running.store(0, std::memory_order_relaxed);
          h->helped.fetch_add(1, std::memory_order_relaxed);
        }
        t_member = {};
        if (done_.value.fetch_add(1, std::memory_order_seq_cst) + 1 == chunks) done_.changed();
        w = r.word.load(std::memory_order_acquire);
      }
    }
  }

  // Whether h is resting now (it is not posted jobs); a rest that has ended is over.
  static bool resting(Helper& h) {
    if (h.rest_until == 0) return false;
    if (now_nanos() < h.rest_until) return true;
    h.rest_until = 0;
    return false;
  }

  // After a chunk job posted to h: whether h held it back or came to it (or to one before it
  // since the last), and what follows for its rests.
  static void heard_from(Helper& h) {
    if (h.held_back && !short_of_cpu(h)) h.held_back = false;
    const uint32_t looked = h.looked.load(std::memory_order_relaxed);
    const bool came =
        h.helped.exchange(0, std::memory_order_relaxed) != 0 || looked != h.last_looked;
    h.last_looked = looked;
    if (came && !h.held_back) {
      h.quiet_since = -1;
      if (h.rest == kMinRestNanos) return;
      // Its next rest is back to the shortest once it has helped for as long as the longest.
      const int64_t now = now_nanos();
      if (h.good_since < 0) h.good_since = now;
      if (now - h.good_since >= kMaxRestNanos) h.rest = kMinRestNanos, h.good_since = -1;
      return;
    }
    const int64_t now = now_nanos();
    h.good_since = -1;
    if (!h.held_back && h.quiet_since < 0) {
      h.quiet_since = now;
    } else if (h.held_back || now - h.quiet_since >= kQuietNanos) {
      h.rest_until = now + h.rest;
      g_rests.fetch_add(1, std::memory_order_relaxed);
      h.rest = std::min(2 * h.rest, kMaxRestNanos);
      h.quiet_since = -1;
      h.held_back = false;
    }
  }

  // Gives the box's thread a job (or the order to stop).
  static void post(Signal& box) {
    box.value.fetch_add(1, std::memory_order_seq_cst);
    box.changed();
  }

  void grow(int helpers) {
    while (int(helpers_.size()) < helpers) {
      helpers_.push_back(std::make_unique<Helper>());
      posted_.push_back(0);
      Helper* h = helpers_.back().get();
      const int index = int(helpers_.size());
      threads_.emplace_back([this, h, index] { serve(*h, index); });
    }
  }

  void serve(Helper& h, int index) {
    const pid_t tid = pid_t(syscall(SYS_gettid));
    if (!read_schedstat(tid, &h.ran, &h.queued)) h.ran = -1;
    h.tid.store(tid, std::memory_order_release);
    for (uint32_t seen = 0;;) {
      seen = h.box.wait([seen](uint32_t posted) { return posted != seen; });
      if (stop_.load(std::memory_order_relaxed)) return;
      if (h.team_post.load(std::memory_order_relaxed) == seen) {  // a team job: its share
        member(h.team_index);
        if (pending_.value.fetch_sub(1, std::memory_order_seq_cst) == 1) pending_.changed();
      } else {  // a chunk job (or one already done: then nothing is left to claim)
        const uint32_t job = h.chunk_job.load(std::memory_order_relaxed);
        h.looked.store(job, std::memory_order_relaxed);
        claim(index, &h, job);
      }
    }
  }

  std::vector<std::unique_ptr<Helper>> helpers_;  // pool thread i + 1's
  std::vector<char> posted_;                      // the caller's: posted the current job
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  // The team job: set before its posts, read by its members after theirs.
  detail::TeamFn fn_ = nullptr;
  void* arg_ = nullptr;
  int size_ = 1;
  Signal pending_;                           // members still running, the caller left out
  alignas(64) std::atomic<int> arrived_{0};  // at the team barrier
  Signal phase_;                             // team barriers passed
  // The chunk job: set before its claim word, read by a thread after it claimed a chunk.
  detail::ChunkFn chunk_fn_ = nullptr;
  void* chunk_arg_ = nullptr;
  uint32_t chunks_ = 0;
  std::atomic<int> chunk_threads_{1};  // its threads, and so its ranges
  uint32_t job_ = 0;                   // chunk jobs started
  std::array<Range, detail::kMaxChunkThreads> ranges_;
  Signal done_;  // chunks run
  std::mutex failure_mu_;
  std::exception_ptr failure_;  // the current job's first exception
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

uint64_t compute_thread_rests() { return g_rests.load(std::memory_order_relaxed); }

void team_barrier() {
  if (t_member.pool && t_member.size > 1) t_member.pool->barrier();
}

namespace detail {
namespace {
Pool& this_threads_pool() {
  static std::once_flag at_fork;
  std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  if (!t_pool) t_pool = std::make_unique<Pool>();
  return *t_pool;
}
}  // namespace

void run_team(int threads, TeamFn fn, void* arg) { this_threads_pool().run_team(threads, fn, arg); }

void run_chunks(int threads, int64_t chunks, ChunkFn fn, void* arg) {
  this_threads_pool().run_chunks(std::min(threads, kMaxChunkThreads), chunks, fn, arg);
}
}  // namespace detail

}  // namespace cemlm
