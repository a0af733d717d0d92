// Unit tests of the server's request/response conversions that need no running server.
#include "cemlm/server/convert.h"

#include <gtest/gtest.h>

namespace cemlm::server {
namespace {

using std::chrono::milliseconds;

TEST(QueueSeconds, ScheduledRequestsWaitedUntilScheduledTheOthersUntilTheyEnded) {
  RequestTimings t;
  t.submitted = Clock::now();
  t.finished = t.submitted + milliseconds(900);
  // Cancelled, past its deadline or drained while still queued: it waited its whole life.
  EXPECT_NEAR(queue_seconds(t), 0.9, 1e-9);
  t.scheduled = t.submitted + milliseconds(250);
  EXPECT_NEAR(queue_seconds(t), 0.25, 1e-9);
  EXPECT_EQ(queue_seconds(RequestTimings{}), 0.0);  // no times at all
}

}  // namespace
}  // namespace cemlm::server
