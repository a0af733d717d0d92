// `cemlm grads`: the mean next-token cross-entropy of one id sequence (MODEL.md §3) and its
// gradient with respect to every parameter, written as safetensors (one F32 tensor per parameter
// under its own name, plus `loss` [1]) — the trainer's backward, for checks against other
// implementations.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cemlm/cli/commands.h"
#include "cemlm/cli/flags.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/safetensors.h"
#include "cemlm/trainer/backprop.h"
#include "nlohmann/json.hpp"

namespace cemlm::cli {
namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "error: %s\n", msg.c_str());
  return 1;
}

// Empty when the ids can be scored by the model, else what is wrong, naming the flag.
std::string check_ids(const std::vector<int>& ids, const ModelConfig& c) {
  if (int(ids.size()) > c.max_seq_len)
    return "--ids has " + std::to_string(ids.size()) + " tokens; the model's max_seq_len is " +
           std::to_string(c.max_seq_len) + ": give fewer ids";
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= c.vocab_size)
      return "--ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
             " is not a token id in [0, " + std::to_string(c.vocab_size) + ")";
  return "";
}

// Empty when the loss (as the F32 written) and every gradient are finite, else which is not: a
// model whose forward or backward overflows fp32 is refused, as `cemlm score` refuses it, rather
// than written out as NaN/inf.
std::string check_finite(double loss, const ParamStore& grads) {
  const std::string advice =
      ": check the checkpoint (its weights overflow 32-bit floats); "
      "nothing was written to --out";
  if (!std::isfinite(float(loss)))
    return absl::StrCat("the loss is not finite (", loss, ")", advice);
  for (const ParamSpec& s : grads.specs()) {
    const float* g = grads.flat().data() + s.offset;
    if (!std::all_of(g, g + s.numel(), [](float x) { return std::isfinite(x); }))
      return absl::StrCat("the gradient of '", s.name, "' is not finite (the loss, ", loss, ", is)",
                          advice);
  }
  return "";
}

}  // namespace

int cmd_grads(int argc, char** argv) {
  std::string model, ids_text, out;
  int T = 0, threads = 0;
  Flags f(
      "cemlm grads --model DIR --ids 3,17,42 [--recursion T] --out FILE",
      "Writes the mean next-token cross-entropy of the ids and its gradient with respect to every\n"
      "parameter as safetensors: one F32 tensor per parameter under its own name, plus `loss` "
      "[1].\n"
      "Prints JSON {\"loss\", \"tokens\", \"recursion\", \"out\"}. A loss or gradient that is not\n"
      "finite (a model that overflows 32-bit floats) is an error, and nothing is written.");
  f.add("model", &model, "checkpoint directory", true);
  f.add("ids", &ids_text, "comma-separated token ids (at least 2)", true);
  f.add("recursion", &T, "recursion depth T (0: the model's recursion.default)");
  f.add("out", &out, "safetensors file to write", true);
  f.add("threads", &threads, kThreadsHelp);
  if (int rc = f.parse(argc, argv); rc >= 0) return rc;
  std::vector<int> ids;
  if (const std::string error = id_list_flag("--ids", ids_text, &ids); !error.empty())
    return usage_error(error);
  if (ids.size() < 2)  // the loss is over next tokens: one id has none
    return usage_error("--ids: need at least 2 tokens (got " + std::to_string(ids.size()) + ")");
  if (const std::string error = recursion_flag_error(T); !error.empty()) return usage_error(error);
  if (const std::string error = threads_flag_error(threads); !error.empty())
    return usage_error(error);
  // Checked before the forward and backward: a path they cannot take was refused only after. The
  // checkpoint's own files are not to be written (the weights were replaced by gradients).
  if (std::string err;
      !check_out_file("--out", out, "grads.safetensors", false, &err, checkpoint_file_paths(model)))
    return fail(err);
  if (const std::string err = checkpoint_file_error("--out", out); !err.empty()) return fail(err);

  auto ck = load_checkpoint(model);
  if (!ck.ok()) return fail(std::string(ck.status().message()));
  const ModelConfig& c = ck->config;
  if (const std::string err = check_ids(ids, c); !err.empty()) return fail(err);
  if (absl::Status st = check_recursion_depth(c, T, "--recursion"); !st.ok())
    return fail(std::string(st.message()));
  if (T == 0) T = c.recursion_default;

  use_cpu_threads(threads);  // by default the CPU limit, as the other commands: not every core
  const Weights w = bind_weights(c, ck->params);
  ParamStore grads(c);
  const double loss =
      forward_backward(c, w, bind_weights(c, grads), ids.data(), 1, int(ids.size()), T);
  if (const std::string err = check_finite(loss, grads); !err.empty()) return fail(err);
  const std::vector<float> loss_value{float(loss)};
  std::vector<NamedTensor> tensors;
  for (const ParamSpec& s : grads.specs())
    tensors.push_back(
        {s.name, s.shape, std::span<const float>(grads.flat().data() + s.offset, s.numel())});
  tensors.push_back({"loss", {1}, loss_value});
  if (auto st = write_safetensors(out, tensors); !st.ok())
    return fail("--out: " + std::string(st.message()));
  nlohmann::json j;
  j["loss"] = loss;
  j["tokens"] = ids.size();
  j["recursion"] = T;
  j["out"] = out;
  // A path need not be UTF-8; JSON text must be (the strict dump threw after the file was
  // written): bytes it cannot hold print as U+FFFD.
  std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  return 0;
}

}  // namespace cemlm::cli
