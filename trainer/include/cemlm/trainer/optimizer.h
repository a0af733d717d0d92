// The optimizer side of a training step: AdamW with decoupled weight decay (on the parameters
// whose ParamSpec asks for it: the matrices), the warmup + cosine learning-rate schedule, and
// global-norm gradient clipping. All of it works on the flat buffers laid out by param_layout.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cemlm/engine/params.h"

namespace cemlm {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;  // decoupled: θ ← θ − lr·wd·θ, only where spec.weight_decay
};

class AdamW {
 public:
  AdamW(std::vector<ParamSpec> specs, const AdamWOptions& opts);

  // One update of `params` by `grads` (both laid out by the specs) at learning rate `lr`.
  void step(std::span<float> params, std::span<const float> grads, double lr);
  int64_t steps() const { return steps_; }
  const std::vector<float>& first_moment() const { return m_; }
  const std::vector<float>& second_moment() const { return v_; }

  // The moments as safetensors ("adam_m.<param>", "adam_v.<param>", F32, exact) with the step
  // count in the metadata; loading checks every tensor against the layout.
  absl::Status save(const std::string& path) const;
  absl::Status load(const std::string& path);

 private:
  std::vector<ParamSpec> specs_;
  AdamWOptions opts_;
  std::vector<float> m_, v_;
  int64_t steps_ = 0;
};

// Linear warmup from peak/warmup to peak over `warmup` steps, then cosine decay to `floor` at
// step `total`. Steps are 0-based: at(0) is the first update's rate.
struct LrSchedule {
  double peak = 0, floor = 0;
  int64_t warmup = 0, total = 1;
  double at(int64_t step) const;
};

// The global L2 norm of `grads`; when it exceeds max_norm > 0, scales them to norm max_norm.
// Returns the norm before clipping.
double clip_grad_norm(std::span<float> grads, double max_norm);

}  // namespace cemlm
