// ServerMetrics on its own, rendered as /metrics renders it: the latency buckets resolve a small
// model's sub-millisecond steps.
#include "cemlm/server/metrics.h"

#include <gtest/gtest.h>
#include <prometheus/text_serializer.h>

#include "server_process.h"

namespace cemlm::server {
namespace {

using testing_server::metric;
using testing_server::parse_metrics;

// The default model decodes a token in about 0.2 ms on a CPU: its inter-token latencies get
// buckets of their own below 0.5 ms (all fell in the first, 0.5 ms, so that every quantile was a
// guess inside it) and so do its queue times and first tokens.
TEST(ServerMetricsBuckets, SubMillisecondLatenciesAreResolved) {
  ServerMetrics m("m", 1024);
  for (double s : {0.00004, 0.00018, 0.00021, 0.00022, 0.00045}) m.observe_inter_token(s);
  m.observe_first_token(0.00012, 0.00003, 3);
  const auto series = parse_metrics(prometheus::TextSerializer().Serialize(m.Collect()));
  auto itl = [&](const char* le) {
    return metric(series, "cemlm:inter_token_latency_seconds_bucket",
                  std::string("le=\"") + le + "\"");
  };
  EXPECT_EQ(itl("5e-05"), 1);
  EXPECT_EQ(itl("0.0001"), 1);
  EXPECT_EQ(itl("0.0002"), 2);
  EXPECT_EQ(itl("0.0003"), 4);
  EXPECT_EQ(itl("0.0005"), 5);
  EXPECT_EQ(metric(series, "cemlm:time_to_first_token_seconds_bucket", "le=\"0.00015\""), 1);
  EXPECT_EQ(metric(series, "cemlm:time_to_first_token_seconds_bucket", "le=\"0.0001\""), 0);
  EXPECT_EQ(metric(series, "cemlm:request_queue_time_seconds_bucket", "le=\"5e-05\""), 1);
}

}  // namespace
}  // namespace cemlm::server
