// The compute pool (kernels/include/cemlm/kernels/parallel.h): every index of a loop runs once,
// whatever the team and the schedule, in contiguous chunks; teams number their threads 0 … P−1
// and their barriers hold everyone back; loops inside a team run on the calling thread; a pool
// thread that fell asleep between jobs is woken for the next; one that never comes (kept off its
// core) holds no loop back and is counted resting, as is one that waits for its core while
// another thread runs there, but not one that is merely slow; callers on several threads each get
// their own team; a forked child starts a pool of its own.
#include "cemlm/kernels/parallel.h"

#include <gtest/gtest.h>
#include <omp.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace cemlm {
namespace {

// Sets OpenMP's thread count (the pool's) for the scope.
class Threads {
 public:
  explicit Threads(int n) : before_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~Threads() { omp_set_num_threads(before_); }

 private:
  int before_;
};

// body() in a forked child that exits with its result: 0 for success, 1 or more for a failure,
// and fails on an alarm (alarm_s) instead of stalling the suite if it hangs. Returns the exit
// status, or −1 where the child hung or crashed. The child has a pool of its own (and its own
// count of rests).
template <typename Body>
int in_child(Body body, unsigned alarm_s = 20) {
  const pid_t child = fork();
  if (child < 0) return -1;
  if (child == 0) {
    alarm(alarm_s);
    _exit(body());
  }
  int status = 0;
  if (waitpid(child, &status, 0) != child || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// The thread id of this thread's (two-thread) pool's other thread, once it has run a chunk.
pid_t pool_thread_id() {
  std::atomic<pid_t> helper{0};
  while (helper.load() == 0)  // until the pool's thread has run a chunk (it finds its own)
    parallel_for(2, true, [&](int64_t) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (team_thread() != 0) helper.store(pid_t(syscall(SYS_gettid)));
    });
  return helper.load();
}

// Keeps this thread busy for d.
void busy_for(std::chrono::microseconds d) {
  const auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) {
  }
}

// Runs `loop` over n items and checks each ran exactly once.
template <typename Loop>
void expect_each_once(int64_t n, Loop loop) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
  loop(n, [&](int64_t i) { hits[size_t(i)].fetch_add(1); });
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(hits[size_t(i)].load(), 1) << "item " << i << " of " << n;
}

TEST(ComputePool, EveryIndexRunsOnceWhateverTheTeamAndSchedule) {
  for (int threads : {1, 2, 3, 5}) {
    Threads scope(threads);
    EXPECT_EQ(compute_threads(), threads);
    for (int64_t n : {0, 1, 2, 3, 7, 64, 1001}) {
      SCOPED_TRACE(::testing::Message() << threads << " threads, n = " << n);
      expect_each_once(n, [](int64_t m, auto body) { parallel_for(m, true, body); });
      expect_each_once(n, [](int64_t m, auto body) { parallel_for(m, false, body); });
      expect_each_once(n, [](int64_t m, auto body) { parallel_for(m, true, body, 2); });
      expect_each_once(n, [](int64_t m, auto body) { parallel_for_dynamic(m, true, body); });
    }
  }
}

TEST(ComputePool, ALoopRunsInContiguousChunksOnSeveralThreads) {
  Threads scope(3);
  constexpr int kN = 300;
  std::vector<std::thread::id> who(kN);
  std::vector<int> index(kN, -1);
  // A pool thread may rest (left out after holding a loop back on a busy machine) for up to 64
  // ms: the loop runs again until more than one thread ran it.
  for (int attempt = 0; attempt < 200; ++attempt) {
    parallel_for(kN, true, [&](int64_t i) {
      who[size_t(i)] = std::this_thread::get_id();
      index[size_t(i)] = team_thread();
      std::this_thread::sleep_for(std::chrono::microseconds(20));  // no thread takes it all
    });
    if (std::set<std::thread::id>(who.begin(), who.end()).size() >= 2) break;
  }
  std::set<std::thread::id> distinct(who.begin(), who.end());
  ASSERT_GE(distinct.size(), 2u);
  // kChunksPerThread chunks per thread, each of consecutive items on one thread.
  const int64_t chunks = 3 * detail::kChunksPerThread;
  int changes = 0;
  for (int i = 1; i < kN; ++i) changes += who[size_t(i)] != who[size_t(i - 1)];
  EXPECT_LE(changes, chunks - 1);
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t i = kN * c / chunks + 1; i < kN * (c + 1) / chunks; ++i)
      ASSERT_EQ(who[size_t(i)], who[size_t(i - 1)]) << "chunk " << c << " split at item " << i;
  // Each thread's number is its own, one of the loop's three.
  for (int i = 0; i < kN; ++i) {
    ASSERT_GE(index[size_t(i)], 0);
    ASSERT_LT(index[size_t(i)], 3);
    for (int j = 0; j < i; ++j) {
      if (index[size_t(j)] != index[size_t(i)]) continue;
      ASSERT_EQ(who[size_t(j)], who[size_t(i)]) << "items " << j << " and " << i;
    }
  }
}

// A loop body that throws (std::bad_alloc from a chunk's buffers) reaches the caller once every
// thread is done with the loop, whichever thread threw, and the pool goes on serving loops; a
// team member's exception likewise. (Thrown on a pool thread it ended the process; on the caller
// it left the other threads running chunks of a frame already unwound.)
TEST(ComputePool, AnExceptionInALoopReachesTheCallerAndThePoolGoesOn) {
  Threads scope(3);
  bool pool_thread_threw = false;
  for (int attempt = 0; attempt < 50 && !pool_thread_threw; ++attempt) {
    std::atomic<int> ran{0};
    std::atomic<bool> threw_off_caller{false};
    bool caught = false;
    try {
      parallel_for(64, true, [&](int64_t i) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        ran.fetch_add(1);
        if (i % 8 == 3) {
          if (team_thread() != 0) threw_off_caller = true;
          throw std::runtime_error("item " + std::to_string(i));
        }
      });
    } catch (const std::runtime_error& e) {
      caught = std::string(e.what()).starts_with("item ");
    }
    ASSERT_TRUE(caught);
    EXPECT_FALSE(in_parallel());
    const int seen = ran.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_EQ(ran.load(), seen) << "a chunk ran on after the loop returned";
    pool_thread_threw = threw_off_caller;
    expect_each_once(300, [](int64_t m, auto body) { parallel_for(m, true, body); });
  }
  EXPECT_TRUE(pool_thread_threw) << "no pool thread ran a throwing item in 50 loops";
  bool caught = false;
  try {
    parallel_team(3, [] {
      if (team_thread() == team_size() - 1) throw std::runtime_error("member");
    });
  } catch (const std::runtime_error&) {
    caught = true;
  }
  EXPECT_TRUE(caught);
  EXPECT_FALSE(in_parallel());
  expect_each_once(300, [](int64_t m, auto body) { parallel_for_dynamic(m, true, body); });
}

TEST(ComputePool, TeamThreadsAreNumberedAndTheBarrierHoldsEveryoneBack) {
  for (int threads : {2, 3, 4}) {
    Threads scope(threads);
    constexpr int kRounds = 200;
    std::vector<int> slot(size_t(threads), -1);
    std::atomic<int> wrong{0}, ran{0};
    std::vector<std::atomic<int>> seen(static_cast<size_t>(threads));
    // A resting pool thread (see ALoopRunsInContiguousChunksOnSeveralThreads) is left out of a
    // team: wait until the pool gives the whole team.
    for (int attempt = 0; attempt < 200; ++attempt) {
      std::atomic<int> size{0};
      parallel_team(0, [&] { size.fetch_add(1); });
      if (size.load() == threads) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    parallel_team(0, [&] {
      const int t = team_thread(), P = team_size();
      ran.fetch_add(1);
      if (P != threads || t < 0 || t >= P) {
        wrong.fetch_add(1);
        return;  // a barrier would wait forever on a wrong size
      }
      seen[size_t(t)].fetch_add(1);
      for (int r = 0; r < kRounds; ++r) {
        slot[size_t(t)] = r;  // every thread writes its own slot …
        team_barrier();
        for (int u = 0; u < P; ++u)  // … and, past the barrier, sees everyone's
          if (slot[size_t(u)] != r) wrong.fetch_add(1);
        team_barrier();  // no one writes round r + 1 before everyone has read round r
      }
    });
    EXPECT_EQ(ran.load(), threads);
    EXPECT_EQ(wrong.load(), 0);
    for (int t = 0; t < threads; ++t) EXPECT_EQ(seen[size_t(t)].load(), 1) << "thread " << t;
    EXPECT_EQ(team_thread(), 0);  // outside a team again
    EXPECT_EQ(team_size(), 1);
  }
}

TEST(ComputePool, LoopsInsideATeamRunOnTheCallingThread) {
  Threads scope(2);
  EXPECT_FALSE(in_parallel());
  std::atomic<int> inner_elsewhere{0}, outer_not_inside{0};
  parallel_for(8, true, [&](int64_t) {
    if (!in_parallel()) outer_not_inside.fetch_add(1);
    const auto me = std::this_thread::get_id();
    parallel_for(16, true, [&](int64_t) { inner_elsewhere += std::this_thread::get_id() != me; });
    parallel_for_dynamic(16, true,
                         [&](int64_t) { inner_elsewhere += std::this_thread::get_id() != me; });
  });
  EXPECT_EQ(outer_not_inside.load(), 0);
  EXPECT_EQ(inner_elsewhere.load(), 0);
  EXPECT_FALSE(in_parallel());
  // Inside an OpenMP region too (OpenBLAS's, or a training op's).
#pragma omp parallel num_threads(2)
  { EXPECT_TRUE(in_parallel()); }
}

TEST(ComputePool, APoolThreadAsleepBetweenJobsIsWokenForTheNext) {
  Threads scope(2);
  for (int job = 0; job < 20; ++job) {
    // Longer than the pool's spin: its thread has gone to sleep (and at 0 it has not).
    std::this_thread::sleep_for(std::chrono::microseconds(job % 2 ? 300 : 0));
    std::atomic<int> sum{0};
    parallel_for(2, true, [&](int64_t i) { sum += int(i) + 1; });
    ASSERT_EQ(sum.load(), 3) << "job " << job;
  }
}

// A pool thread held in a signal handler stands for one the scheduler keeps off its core: the
// loops posted to it still finish, on the caller (the old pool waited for every thread of a
// team). In a child, so that a hang fails on an alarm instead of stalling the suite.
std::atomic<int> g_held{0}, g_release{0};
void hold_here(int) {
  g_held.store(1);
  while (g_release.load() == 0) sched_yield();
}

TEST(ComputePool, AThreadThatNeverComesHoldsNoLoopBack) {
  Threads scope(2);
  const int status = in_child([] {
    const pid_t helper = pool_thread_id();
    struct sigaction sa = {};
    sa.sa_handler = hold_here;
    sigaction(SIGUSR1, &sa, nullptr);
    syscall(SYS_tgkill, getpid(), helper, SIGUSR1);
    while (g_held.load() == 0) sched_yield();
    int bad = 0;
    for (int job = 0; job < 300; ++job) {
      std::vector<int> hits(64, 0);
      auto once = [&](int64_t i) { ++hits[size_t(i)]; };  // one thread: no race on hits
      if (job % 2)
        parallel_for(64, true, once);
      else
        parallel_for_dynamic(64, true, once);
      bad += int(std::count(hits.begin(), hits.end(), 1)) != 64;
    }
    // Posted jobs it does not come to for a millisecond make it rest (counted for the metrics).
    const uint64_t rests = compute_thread_rests();
    bool rested = false;
    for (int job = 0; job < 1'000'000 && !rested; ++job) {
      parallel_for(2, true, [](int64_t) {});
      rested = compute_thread_rests() > rests;
    }
    g_release.store(1);
    std::atomic<int> sum{0};  // and back to work
    parallel_for(1000, true, [&](int64_t i) { sum += int(i); });
    return bad == 0 && sum.load() == 999 * 1000 / 2 ? (rested ? 0 : 3) : 1;
  });
  EXPECT_EQ(status, 0) << "-1: the child hung (a loop waited for the held thread) or crashed; 1: "
                          "a loop missed or repeated items; 3: no rest counted";
}

// Nanoseconds thread tid of this process has waited in the run queue for a core (schedstat's
// second figure), or −1 where unreadable.
int64_t queued_nanos(pid_t tid) {
  const std::string path = "/proc/self/task/" + std::to_string(tid) + "/schedstat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return -1;
  long long ran = 0, queued = -1;
  if (std::fscanf(f, "%lld %lld", &ran, &queued) != 2) queued = -1;
  std::fclose(f);
  return queued;
}

// A pool thread that keeps its caller waiting on a long chunk, with its core to itself (as when
// the hypervisor takes a virtual CPU for a while, which it does to any thread), is not sent to
// rest: that would only halve the threads. Where the kernel gives no schedstat to tell, it is.
TEST(ComputePool, AThreadSlowWithItsCoreToItselfDoesNotRest) {
  Threads scope(2);
  const int status = in_child([] {
    const pid_t helper = pool_thread_id();
    const bool schedstat = queued_nanos(helper) >= 0;
    // The caller's item takes 0.2 ms; the pool thread's, 2 ms: the caller waits 1.8 ms for it.
    std::atomic<int> slow{0};
    auto job = [&] {
      parallel_for(2, true, [&](int64_t) {
        if (team_thread() == 0) return busy_for(std::chrono::microseconds(200));
        busy_for(std::chrono::milliseconds(2));
        slow.fetch_add(1);
      });
    };
    // Attempts in which another process took the pool thread's core (it waited in the run queue)
    // tell nothing: a rest is right then. The pool judges from the thread's run-queue time since
    // its last look at a long item: each attempt starts with one, and counts if quiet from before
    // it (quiet only after it, an attempt counted a wait the pool saw during it: CI under load).
    for (int attempt = 0; attempt < 20; ++attempt) {
      const int64_t queued = queued_nanos(helper);
      job();
      const uint64_t rests = compute_thread_rests();
      slow.store(0);
      for (int n = 0; n < 300 && slow.load() < 5; ++n) job();
      const bool rested = compute_thread_rests() > rests;
      if (!schedstat) return rested ? 0 : 4;
      if (slow.load() >= 1 && queued_nanos(helper) - queued < 50'000) return rested ? 3 : 0;
    }
    return 6;
  });
  if (status == 6) GTEST_SKIP() << "the pool thread waited for its core in every attempt";
  EXPECT_EQ(status, 0) << "-1: the child hung or crashed; 3: it rested; 4: no rest without "
                          "schedstat";
}

// One that came for its chunk, then waited for its core while another thread ran there, rests.
TEST(ComputePool, AThreadThatWaitsForItsCoreRests) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (cpus.size() < 2) GTEST_SKIP() << "needs two CPUs";
  Threads scope(2);
  const int status = in_child([&cpus] {
    auto pin = [](pid_t tid, int cpu) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      return sched_setaffinity(tid, sizeof one, &one) == 0;
    };
    const pid_t helper = pool_thread_id();
    // The pool thread at nice 19 on the second CPU; there, a thread at nice 0 that it wakes as
    // it starts its chunk takes the CPU from it for 3 ms.
    // It sleeps between its turns, so the pool thread always comes for its chunk (a thread that
    // does not come rests anyway, and the test would not tell).
    std::atomic<int> go{0}, pinned{0};
    std::thread rival([&] {
      pinned.store(pin(0, cpus[1]) ? 1 : -1);
      for (;;) {
        go.wait(0);
        if (go.exchange(0) < 0) return;
        busy_for(std::chrono::milliseconds(3));
      }
    });
    while (pinned.load() == 0) std::this_thread::yield();
    int result = 5;
    if (pinned.load() == 1 && pin(0, cpus[0]) && pin(helper, cpus[1]) &&
        setpriority(PRIO_PROCESS, id_t(helper), 19) == 0) {
      const uint64_t rests = compute_thread_rests();
      bool rested = false;
      for (int job = 0; job < 200 && !rested; ++job) {
        parallel_for(2, true, [&](int64_t) {
          if (team_thread() != 0) go.store(1), go.notify_one();
          busy_for(std::chrono::microseconds(500));
        });
        rested = compute_thread_rests() > rests;
      }
      result = rested ? 0 : 3;
    }
    go.store(-1);
    go.notify_one();
    rival.join();
    return result;
  });
  EXPECT_EQ(status, 0) << "-1: the child hung or crashed; 3: no rest counted; 5: could not pin "
                          "the threads or lower the pool thread's priority";
}

TEST(ComputePool, CallersOnSeveralThreadsEachGetTheirOwnTeam) {
  Threads scope(2);
  constexpr int kCallers = 4, kJobs = 300;
  std::atomic<int> bad{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c)
    callers.emplace_back([&] {
      omp_set_num_threads(2);  // the setting is per thread
      for (int j = 0; j < kJobs; ++j) {
        std::vector<int> hits(97, 0);
        parallel_for(97, true, [&](int64_t i) { ++hits[size_t(i)]; });
        bad += int(std::count(hits.begin(), hits.end(), 1)) != 97;
      }
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(ComputePool, AForkedChildStartsAPoolOfItsOwn) {
  Threads scope(2);
  std::atomic<int> warm{0};
  parallel_for(2, true, [&](int64_t) { warm.fetch_add(1); });  // this thread's pool exists
  ASSERT_EQ(warm.load(), 2);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the parent's pool threads are not here: a new pool must serve
    alarm(20);       // a child waiting on them forever fails instead of hanging
    std::atomic<int> sum{0};
    parallel_for(1000, true, [&](int64_t i) { sum += int(i); });
    _exit(sum.load() == 999 * 1000 / 2 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child hung or crashed";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace cemlm
