// FifoSlots: at most N holders, the rest served in arrival order, a deadline leaves the line.
#include "cemlm/server/fifo_slots.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

namespace cemlm::server {
namespace {

constexpr auto kGranted = FifoSlots::Acquired::kGranted;
constexpr auto kTimedOut = FifoSlots::Acquired::kTimedOut;

// Waits until `n` callers are in line (a thread started has reached acquire()).
void wait_in_line(const FifoSlots& slots, int n) {
  while (slots.waiting() < n) std::this_thread::yield();
}

// Five callers that queued one after another get the one slot in that order, and one arriving
// while they wait does not take a slot given back ahead of them.
TEST(FifoSlots, WaitersAreServedInArrivalOrder) {
  FifoSlots slots(1);
  ASSERT_EQ(slots.acquire(Clock::time_point::max()), kGranted);
  std::mutex mu;
  std::vector<int> served;
  std::atomic<bool> newcomer_tried{false};
  std::vector<std::thread> callers;
  for (int i = 0; i < 5; ++i) {
    callers.emplace_back([&, i] {
      ASSERT_EQ(slots.acquire(Clock::time_point::max()), kGranted);
      {
        std::lock_guard lock(mu);
        served.push_back(i);
      }
      // Held until the newcomer has tried (else all five may be through before it tries).
      while (!newcomer_tried.load()) std::this_thread::yield();
      slots.release();
    });
    wait_in_line(slots, i + 1);
  }
  slots.release();  // to caller 0, never free in between: a newcomer finds none
  EXPECT_EQ(slots.acquire(Clock::now()), kTimedOut) << "a newcomer went ahead of the line";
  newcomer_tried.store(true);
  for (auto& t : callers) t.join();
  EXPECT_EQ(served, (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(slots.waiting(), 0);
  EXPECT_EQ(slots.acquire(Clock::now()), kGranted);  // the slot is free again
}

// At most `total` hold slots at once; a caller whose deadline passes leaves the line without
// taking one (the slot it would have had goes to the next, or stays free).
TEST(FifoSlots, AtMostTotalHoldAndADeadlineLeavesTheLine) {
  FifoSlots slots(2);
  EXPECT_EQ(slots.total(), 2);
  ASSERT_EQ(slots.acquire(Clock::time_point::max()), kGranted);
  ASSERT_EQ(slots.acquire(Clock::now()), kGranted);
  EXPECT_EQ(slots.acquire(Clock::now()), kTimedOut);
  EXPECT_EQ(slots.acquire(Clock::now() + std::chrono::milliseconds(20)), kTimedOut);
  EXPECT_EQ(slots.waiting(), 0);
  bool second = false;
  std::thread waiter([&] { second = slots.acquire(Clock::time_point::max()) == kGranted; });
  wait_in_line(slots, 1);
  slots.release();
  waiter.join();
  EXPECT_TRUE(second);
  slots.release();
  slots.release();
  EXPECT_EQ(slots.acquire(Clock::now()), kGranted);
  EXPECT_EQ(slots.acquire(Clock::now()), kGranted);
  EXPECT_EQ(FifoSlots(0).total(), 1);  // no server without a slot: every call would wait
}

// At most max_waiting callers wait: one more is refused at once, without a place in line, and
// once one has left the line (served or timed out) another may wait again.
TEST(FifoSlots, TheLineIsBounded) {
  FifoSlots slots(1, 2);
  EXPECT_EQ(slots.max_waiting(), 2);
  ASSERT_EQ(slots.acquire(Clock::time_point::max()), kGranted);
  std::vector<std::thread> waiters;
  std::atomic<int> granted{0};
  for (int i = 0; i < 2; ++i) {
    waiters.emplace_back([&] {
      if (slots.acquire(Clock::time_point::max()) != kGranted) return;
      ++granted;
      slots.release();
    });
    wait_in_line(slots, i + 1);
  }
  EXPECT_EQ(slots.acquire(Clock::now() + std::chrono::seconds(30)), FifoSlots::Acquired::kLineFull);
  EXPECT_EQ(slots.waiting(), 2);
  slots.release();  // to the first in line, which gives it to the second
  for (auto& t : waiters) t.join();
  EXPECT_EQ(granted.load(), 2);
  EXPECT_EQ(slots.acquire(Clock::now()), kGranted);  // free again
  // With no line at all, a busy slot refuses at once.
  FifoSlots none(1, 0);
  ASSERT_EQ(none.acquire(Clock::now()), kGranted);
  EXPECT_EQ(none.acquire(Clock::now() + std::chrono::seconds(30)), FifoSlots::Acquired::kLineFull);
}

}  // namespace
}  // namespace cemlm::server
