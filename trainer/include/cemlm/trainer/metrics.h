// A training run's metrics: one record per step and per evaluation, kept in order and written
// into each checkpoint as JSONL (train.jsonl) and as a loss-curve picture (loss.svg), so that a
// resumed run continues the same log.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace cemlm {

struct StepMetrics {
  int64_t step = 0;  // 1-based: the number of updates done
  int T = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  int64_t tokens = 0;  // trained on so far (whole run)
  double tokens_per_s = 0, elapsed_s = 0, eta_s = 0;
};

struct EvalMetrics {
  int64_t step = 0;
  std::vector<std::pair<int, double>> loss;  // (T, mean next-token NLL on validation)
};

class MetricsLog {
 public:
  void add(const StepMetrics& m);
  void add(const EvalMetrics& m);
  const std::vector<StepMetrics>& steps() const { return steps_; }
  const std::vector<EvalMetrics>& evals() const { return evals_; }

  // One JSON object per line: {"step","T","loss","lr","grad_norm","tokens","tokens_per_s",
  // "elapsed_s"} or {"step","val_loss":{"T":nll,…},"val_ppl":{"T":ppl,…}}.
  std::string jsonl() const;
  // The inverse of jsonl(); errors name the file and line.
  static absl::StatusOr<MetricsLog> parse(const std::string& jsonl, const std::string& path);
  // Training loss (averaged over buckets of steps) and validation loss per T against steps.
  std::string svg(const std::string& title) const;

 private:
  std::vector<std::string> lines_;
  std::vector<StepMetrics> steps_;
  std::vector<EvalMetrics> evals_;
};

}  // namespace cemlm
