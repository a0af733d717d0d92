// Metrics records ⇄ JSONL, and the loss-curve chart built from them.
#include "cemlm/trainer/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cemlm/engine/strict_json.h"
#include "cemlm/trainer/plot.h"
#include "nlohmann/json.hpp"

namespace cemlm {
namespace {

using nlohmann::ordered_json;

constexpr size_t kMaxTrainPoints = 200;  // bucket averages keep the training curve readable

ordered_json step_json(const StepMetrics& m) {
  return {{"step", m.step},
          {"T", m.T},
          {"loss", m.loss},
          {"lr", m.lr},
          {"grad_norm", m.grad_norm},
          {"tokens", m.tokens},
          {"tokens_per_s", m.tokens_per_s},
          {"elapsed_s", m.elapsed_s}};
}

ordered_json eval_json(const EvalMetrics& m) {
  ordered_json loss = ordered_json::object(), ppl = ordered_json::object();
  for (const auto& [T, nll] : m.loss) {
    loss[std::to_string(T)] = nll;
    ppl[std::to_string(T)] = std::exp(nll);
  }
  return {{"step", m.step}, {"val_loss", loss}, {"val_ppl", ppl}};
}

// A loss as written: JSON has no infinity, so a validation loss that overflowed went out as
// null, which reads back as +inf.
double loss_value(const ordered_json& j) {
  return j.is_null() ? std::numeric_limits<double>::infinity() : j.get<double>();
}

// A count of a record (step, T, tokens): anything but an integer that fits is refused.
template <typename T>
T integer(const ordered_json& v) {
  if (!integer_fits<T>(v)) throw std::invalid_argument("not an integer of its type");
  return v.get<T>();
}

// Parses one line into `log`; false when it is not a record of either kind.
bool parse_line(const ordered_json& j, MetricsLog& log) {
  if (!j.is_object() || !j.contains("step")) return false;
  if (j.contains("val_loss")) {
    EvalMetrics m;
    m.step = integer<int64_t>(j.at("step"));
    for (const auto& [key, nll] : j.at("val_loss").items()) {
      // A depth as the log writes it: digits only ("1x" read as 1 with stoi, "-5" as -5).
      int T = 0;
      if (key.empty() || key.find_first_not_of("0123456789") != std::string::npos ||
          !absl::SimpleAtoi(key, &T) || T < 1)
        return false;
      m.loss.emplace_back(T, loss_value(nll));
    }
    log.add(m);
    return true;
  }
  StepMetrics m;
  m.step = integer<int64_t>(j.at("step"));
  m.T = integer<int>(j.at("T"));
  m.loss = j.at("loss").get<double>();
  m.lr = j.at("lr").get<double>();
  m.grad_norm = j.at("grad_norm").get<double>();
  m.tokens = integer<int64_t>(j.at("tokens"));
  m.tokens_per_s = j.at("tokens_per_s").get<double>();
  m.elapsed_s = j.at("elapsed_s").get<double>();
  log.add(m);
  return true;
}

}  // namespace

void MetricsLog::add(const StepMetrics& m) {
  steps_.push_back(m);
  lines_.push_back(step_json(m).dump());
}

void MetricsLog::add(const EvalMetrics& m) {
  evals_.push_back(m);
  lines_.push_back(eval_json(m).dump());
}

std::string MetricsLog::jsonl() const {
  std::string out;
  for (const std::string& line : lines_) absl::StrAppend(&out, line, "\n");
  return out;
}

absl::StatusOr<MetricsLog> MetricsLog::parse(const std::string& jsonl, const std::string& path) {
  MetricsLog log;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(jsonl, '\n', absl::SkipEmpty())) {
    ++line_no;
    // nlohmann's parser ends at a NUL byte: `{…}\0garbage` parsed as the record before it.
    const ordered_json j =
        line.find('\0') != absl::string_view::npos
            ? ordered_json()
            : ordered_json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
    bool ok = false;
    try {
      ok = parse_line(j, log);
    } catch (const std::exception&) {  // nlohmann reports wrong types by throwing
      ok = false;
    }
    if (!ok)
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_no, ": not a metrics record (the file is damaged)"));
  }
  return log;
}

std::string MetricsLog::svg(const std::string& title) const {
  std::vector<Series> series;
  Series train{"train"};
  const size_t bucket =
      std::max<size_t>(1, (steps_.size() + kMaxTrainPoints - 1) / kMaxTrainPoints);
  for (size_t b = 0; b < steps_.size(); b += bucket) {
    const size_t e = std::min(steps_.size(), b + bucket);
    double sum = 0;
    for (size_t i = b; i < e; ++i) sum += steps_[i].loss;
    train.x.push_back(double(steps_[e - 1].step));
    train.y.push_back(sum / double(e - b));
  }
  series.push_back(train);
  std::map<int, Series> val;  // by T, ascending
  for (const EvalMetrics& e : evals_)
    for (const auto& [T, nll] : e.loss) {
      Series& s = val[T];
      s.label = absl::StrCat("validation T=", T);
      s.x.push_back(double(e.step));
      s.y.push_back(nll);
    }
  for (auto& [T, s] : val) series.push_back(std::move(s));
  return line_chart_svg(series, title, "step", "loss (nats per token)");
}

}  // namespace cemlm
