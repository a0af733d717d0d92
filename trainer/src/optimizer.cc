// AdamW (PyTorch's update order: decay, moments, bias-corrected step), the learning-rate
// schedule and gradient clipping. Moments are fp32 like the parameters so that a saved and
// reloaded optimizer continues bit-exactly.
#include "cemlm/trainer/optimizer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cemlm/engine/float32.h"
#include "cemlm/engine/safetensors.h"
#include "cemlm/engine/status.h"
#include "cemlm/kernels/parallel.h"

namespace cemlm {
namespace {

constexpr char kFirst[] = "adam_m.";
constexpr char kSecond[] = "adam_v.";

int64_t total_size(const std::vector<ParamSpec>& specs) {
  return specs.empty() ? 0 : specs.back().offset + specs.back().numel();
}

}  // namespace

AdamW::AdamW(std::vector<ParamSpec> specs, const AdamWOptions& opts)
    : specs_(std::move(specs)), opts_(opts) {
  m_.assign(total_size(specs_), 0.0f);
  v_.assign(m_.size(), 0.0f);
}

void AdamW::step(std::span<float> params, std::span<const float> grads, double lr) {
  CEMLM_CHECK(params.size() == m_.size() && grads.size() == m_.size());
  ++steps_;
  // validate_options refuses the values these would round to 0 or 1.
  const float b1 = float(opts_.beta1), b2 = float(opts_.beta2), eps = float(opts_.eps);
  const float c1 = float(1.0 - std::pow(opts_.beta1, double(steps_)));
  const float c2 = float(1.0 - std::pow(opts_.beta2, double(steps_)));
  const float step_size = float(lr) / c1, root_c2 = std::sqrt(c2);
  for (const ParamSpec& s : specs_) {
    const float keep = s.weight_decay ? float(1.0 - lr * opts_.weight_decay) : 1.0f;
    float *p = params.data() + s.offset, *m = m_.data() + s.offset, *v = v_.data() + s.offset;
    const float* g = grads.data() + s.offset;
    parallel_for(s.numel(), true, [&](int64_t i) {
      m[i] = b1 * m[i] + (1.0f - b1) * g[i];
      v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
      p[i] = p[i] * keep - step_size * m[i] / (std::sqrt(v[i]) / root_c2 + eps);
    });
  }
}

absl::Status AdamW::save(const std::string& path) const {
  std::vector<NamedTensor> tensors;
  for (const auto* moments : {&m_, &v_})
    for (const ParamSpec& s : specs_)
      tensors.push_back(NamedTensor{absl::StrCat(moments == &m_ ? kFirst : kSecond, s.name),
                                    s.shape,
                                    {moments->data() + s.offset, size_t(s.numel())}});
  return write_safetensors(path, tensors, {{"step", std::to_string(steps_)}});
}

absl::Status AdamW::load(const std::string& path) {
  CEMLM_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path, 2 * specs_.size()));
  if (file.tensors().size() != 2 * specs_.size())
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": holds ", file.tensors().size(), " tensors, the model's optimizer state has ",
        2 * specs_.size(), " (was it written for another config?)"));
  for (auto* moments : {&m_, &v_})
    for (const ParamSpec& s : specs_) {
      const std::string name = absl::StrCat(moments == &m_ ? kFirst : kSecond, s.name);
      const TensorInfo* t = file.find(name);
      if (!t || t->shape != s.shape)
        return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "' is ",
                                                       t ? "mis-shaped" : "missing", " (expected ",
                                                       shape_string(s.shape), ")"));
      const std::span<float> values{moments->data() + s.offset, size_t(s.numel())};
      CEMLM_RETURN_IF_ERROR(file.read_f32(*t, values));
      // A second moment is a running mean of squares: a negative one (a damaged file, or the two
      // moments' names swapped) made the first step's update NaN, blamed on the learning rate.
      if (moments == &v_)
        if (auto neg = std::find_if(values.begin(), values.end(), [](float x) { return x < 0; });
            neg != values.end())
          return absl::InvalidArgumentError(absl::StrCat(
              path, ": tensor '", name, "' element ", neg - values.begin(), " is ",
              exact_number(*neg),
              ", a second moment cannot be negative (a mean of squares): the file is damaged; "
              "resume from a good copy, or start the run again"));
    }
  auto it = file.metadata().find("step");
  int64_t steps = -1;
  if (it == file.metadata().end() || !absl::SimpleAtoi(it->second, &steps) || steps < 0)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": metadata 'step' is missing or not a step count"));
  steps_ = steps;
  return absl::OkStatus();
}

double LrSchedule::at(int64_t step) const {
  if (step < warmup) return peak * double(step + 1) / double(warmup);
  const int64_t decay_steps = std::max<int64_t>(1, total - warmup);
  const double progress = std::min(1.0, double(step - warmup) / double(decay_steps));
  return floor + 0.5 * (peak - floor) * (1.0 + std::cos(M_PI * progress));
}

double clip_grad_norm(std::span<float> grads, double max_norm) {
  double sum = 0;
  for (float g : grads) sum += double(g) * double(g);
  const double norm = std::sqrt(sum);
  if (max_norm > 0 && norm > max_norm) {
    const float scale = float(max_norm / norm);
    for (float& g : grads) g *= scale;
  }
  return norm;
}

}  // namespace cemlm
