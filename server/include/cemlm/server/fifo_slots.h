// A counting semaphore whose waiters are served first come, first served: a slot given back goes
// to the oldest waiter, never to a caller that arrives meanwhile (with a plain counter and a
// condition variable, a new call took the slot ahead of calls that had waited seconds, and under
// load which calls met their deadline was a lottery).
#pragma once
#include <condition_variable>
#include <deque>
#include <mutex>

#include "cemlm/engine/engine.h"  // Clock

namespace cemlm::server {

class FifoSlots {
 public:
  explicit FifoSlots(int slots);  // at least 1 (fewer is taken as 1)
  FifoSlots(const FifoSlots&) = delete;
  FifoSlots& operator=(const FifoSlots&) = delete;

  // Waits for a slot until `deadline` (Clock::time_point::max(): no deadline). True: the caller
  // holds one, to give back with release(); false at the deadline (its place in line is gone).
  bool acquire(Clock::time_point deadline);
  void release();

  int total() const { return total_; }
  int waiting() const;  // callers in line now

 private:
  struct Waiter {
    std::condition_variable wake;  // its own: a release wakes only the one it serves
    bool granted = false;
  };
  const int total_;
  mutable std::mutex mu_;
  int free_;                   // guarded by mu_, as is:
  std::deque<Waiter*> queue_;  // in arrival order
};

}  // namespace cemlm::server
