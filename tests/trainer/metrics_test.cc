// The metrics log's JSONL round trip (what --resume reads back) and the loss-curve SVG.
#include "cemlm/trainer/metrics.h"

#include <gtest/gtest.h>

#include <limits>
#include <numeric>

#include "cemlm/trainer/plot.h"

namespace cemlm {
namespace {

MetricsLog sample_log() {
  MetricsLog log;
  for (int s = 1; s <= 4; ++s)
    log.add(StepMetrics{s, 2, 5.0 - 0.1 * s, 1e-3, 0.5, 100 * s, 123.5, 0.25 * s, 0});
  log.add(EvalMetrics{4, {{1, 4.75}, {2, 4.5}}});
  return log;
}

TEST(MetricsLog, JsonlRoundTripsExactly) {
  const MetricsLog log = sample_log();
  const std::string text = log.jsonl();
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 5);
  EXPECT_NE(text.find("\"val_ppl\""), std::string::npos);
  auto back = MetricsLog::parse(text, "train.jsonl");
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->steps().size(), 4u);
  EXPECT_EQ(back->steps()[2].loss, log.steps()[2].loss);  // doubles survive bit-exactly
  EXPECT_EQ(back->steps()[3].tokens, 400);
  ASSERT_EQ(back->evals().size(), 1u);
  EXPECT_EQ(back->evals()[0].loss, log.evals()[0].loss);
  EXPECT_EQ(back->jsonl(), text);
}

// A validation loss that overflowed is written as null (JSON has no infinity) and must read
// back, or --resume of such a run fails on its own file.
TEST(MetricsLog, InfiniteValidationLossRoundTrips) {
  MetricsLog log = sample_log();
  log.add(EvalMetrics{8, {{1, std::numeric_limits<double>::infinity()}}});
  const std::string text = log.jsonl();
  EXPECT_NE(text.find("null"), std::string::npos);
  auto back = MetricsLog::parse(text, "train.jsonl");
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->evals().size(), 2u);
  EXPECT_EQ(back->evals()[1].loss[0].second, std::numeric_limits<double>::infinity());
  EXPECT_EQ(back->jsonl(), text);
}

TEST(MetricsLog, DamagedLineIsNamed) {
  auto bad = MetricsLog::parse(sample_log().jsonl() + "{\"step\": \"x\"}\n", "run/train.jsonl");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("run/train.jsonl:6"), std::string::npos) << bad.status();
  EXPECT_FALSE(MetricsLog::parse("not json\n", "f").ok());
}

// A count that is no integer of its type was converted as it came: 2.5 as step 2, true as T 1,
// and 1e300 as whatever the hardware made of it (undefined behaviour). Such a line is damaged.
TEST(MetricsLog, CountsThatAreNoIntegersOfTheirTypeAreRefused) {
  const std::string text = sample_log().jsonl();
  const std::string first = text.substr(0, text.find('\n'));
  ASSERT_NE(first.find("\"step\":1,"), std::string::npos) << first;
  ASSERT_NE(first.find("\"T\":2,"), std::string::npos) << first;
  auto edited = [&](const std::string& from, const std::string& to) {
    std::string s = text;
    s.replace(s.find(from), from.size(), to);
    return s;
  };
  for (const std::string& bad :
       {edited("\"step\":1,", "\"step\":1e300,"), edited("\"step\":1,", "\"step\":2.5,"),
        edited("\"T\":2,", "\"T\":true,"), edited("\"T\":2,", "\"T\":4294967298,")}) {
    auto back = MetricsLog::parse(bad, "run/train.jsonl");
    ASSERT_FALSE(back.ok()) << bad.substr(0, bad.find('\n'));
    EXPECT_NE(back.status().message().find("run/train.jsonl:1"), std::string::npos)
        << back.status();
  }
}

// A validation depth is a key of digits ("1x" read as 1, "-5" as -5), and a NUL byte ends no
// record early (`{…}\0garbage` parsed as the record before it).
TEST(MetricsLog, DepthKeysAndNulBytesAreChecked) {
  const std::string text = sample_log().jsonl();
  auto edited = [&](const std::string& from, const std::string& to) {
    std::string s = text;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) s.replace(at, from.size(), to);
    return s;
  };
  const std::string first_line_end = text.substr(0, text.find('\n'));
  for (const std::string& bad :
       {edited("\"1\":", "\"1x\":"), edited("\"1\":", "\"-5\":"), edited("\"1\":", "\"\":"),
        edited("\"1\":", "\"0\":"),
        edited(first_line_end, first_line_end + std::string("\0garbage", 8))}) {
    auto back = MetricsLog::parse(bad, "run/train.jsonl");
    EXPECT_FALSE(back.ok()) << bad;
  }
  EXPECT_TRUE(MetricsLog::parse(text, "run/train.jsonl").ok());
}

TEST(LossCurve, SvgHasEveryCurveAxesAndLabels) {
  const std::string svg = sample_log().svg("my run");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("my run"), std::string::npos);
  EXPECT_NE(svg.find(">train<"), std::string::npos);
  EXPECT_NE(svg.find("validation T=1"), std::string::npos);
  EXPECT_NE(svg.find("validation T=2"), std::string::npos);
  EXPECT_NE(svg.find(">step<"), std::string::npos);
  EXPECT_NE(svg.find("loss (nats per token)"), std::string::npos);
  EXPECT_EQ(std::count(svg.begin(), svg.end(), '\n') > 10, true);
}

TEST(LineChart, EscapesTextAndSurvivesEmptyAndFlatSeries) {
  const std::string svg =
      line_chart_svg({{"a<b", {}, {}}, {"flat", {1, 2}, {3, 3}}}, "x & y", "s", "v");
  EXPECT_NE(svg.find("a&lt;b"), std::string::npos);
  EXPECT_NE(svg.find("x &amp; y"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);
}

// Values far from 0 against their spread (a damaged train.jsonl, an exploding loss): the ticks
// are counted, so that a step under half an ulp of the values cannot loop for good, and a range
// too wide for doubles gets one tick. Each chart is drawn, with its ticks' text labels.
TEST(LineChart, ValuesFarFromZeroOrTooWideForDoublesEndWithAFewTicks) {
  const double big = 1e17, huge = std::numeric_limits<double>::max();
  for (const std::vector<double>& y :
       {std::vector<double>{big, big + 16}, {-huge, huge}, {big, big + 64, big + 128}}) {
    std::vector<double> x(y.size());  // as long as y, as Series asks (3 read past a 2-long y)
    std::iota(x.begin(), x.end(), 1.0);
    const std::string svg = line_chart_svg({{"s", x, y}}, "t", "x", "y");
    const size_t labels = size_t(std::count(svg.begin(), svg.end(), '<'));
    EXPECT_LT(labels, 400u) << y[0];
    EXPECT_NE(svg.find("</svg>"), std::string::npos);
  }
}

}  // namespace
}  // namespace cemlm
