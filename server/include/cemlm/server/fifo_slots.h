// A counting semaphore whose waiters are served first come, first served: a slot given back goes
// to the oldest waiter, never to a caller that arrives meanwhile (with a plain counter and a
// condition variable, a new call took the slot ahead of calls that had waited seconds, and under
// load which calls met their deadline was a lottery). The line is bounded: each caller in it is a
// thread (a sync gRPC call), and 1,000 calls waiting at once took a server to 2,752 threads.
#pragma once
#include <climits>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "cemlm/engine/engine.h"  // Clock

namespace cemlm::server {

class FifoSlots {
 public:
  // At least 1 slot, and 0 or more callers in line (fewer are taken as those).
  explicit FifoSlots(int slots, int max_waiting = INT_MAX);
  FifoSlots(const FifoSlots&) = delete;
  FifoSlots& operator=(const FifoSlots&) = delete;

  enum class Acquired {
    kGranted,   // the caller holds a slot, to give back with release()
    kTimedOut,  // the deadline came first (its place in line is gone)
    kLineFull,  // none free, and max_waiting counted callers were in line: it did not wait
  };
  // Waits for a slot until `deadline` (Clock::time_point::max(): no deadline). A caller not
  // `counted` (one of a bounded set of threads of the server's own) waits whatever the line.
  Acquired acquire(Clock::time_point deadline, bool counted = true);
  void release();

  int total() const { return total_; }
  int max_waiting() const { return max_waiting_; }
  int waiting() const;  // callers in line now

 private:
  struct Waiter {
    std::condition_variable wake;  // its own: a release wakes only the one it serves
    bool granted = false;
    bool counted = true;
  };
  const int total_, max_waiting_;
  mutable std::mutex mu_;
  int free_;                   // guarded by mu_, as are:
  std::deque<Waiter*> queue_;  // in arrival order
  int counted_waiting_ = 0;    // those of queue_ that are counted
};

}  // namespace cemlm::server
