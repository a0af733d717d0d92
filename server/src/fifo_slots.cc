// FifoSlots (see fifo_slots.h).
#include "cemlm/server/fifo_slots.h"

#include <algorithm>

namespace cemlm::server {

FifoSlots::FifoSlots(int slots, int max_waiting)
    : total_(std::max(1, slots)), max_waiting_(std::max(0, max_waiting)), free_(total_) {}

FifoSlots::Acquired FifoSlots::acquire(Clock::time_point deadline, bool counted) {
  std::unique_lock lock(mu_);
  if (free_ > 0 && queue_.empty()) {
    --free_;
    return Acquired::kGranted;
  }
  if (counted && counted_waiting_ >= max_waiting_) return Acquired::kLineFull;
  Waiter me;
  me.counted = counted;
  counted_waiting_ += counted;
  queue_.push_back(&me);
  const auto granted = [&] { return me.granted; };
  if (deadline == Clock::time_point::max())
    me.wake.wait(lock, granted);
  else if (!me.wake.wait_until(lock, deadline, granted))
    queue_.erase(std::find(queue_.begin(), queue_.end(), &me));  // not served: leaves the line
  if (!me.granted) counted_waiting_ -= counted;
  return me.granted ? Acquired::kGranted : Acquired::kTimedOut;
}

void FifoSlots::release() {
  std::lock_guard lock(mu_);
  if (queue_.empty()) {
    ++free_;
    return;
  }
  Waiter* next = queue_.front();  // the slot passes to it without ever being free
  queue_.pop_front();
  counted_waiting_ -= next->counted;
  next->granted = true;
  next->wake.notify_one();  // under the lock: `next` lives until it has seen `granted`
}

int FifoSlots::waiting() const {
  std::lock_guard lock(mu_);
  return int(queue_.size());
}

}  // namespace cemlm::server
