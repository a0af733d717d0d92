// `cemlm inspect`: parameter counts and KV-cache size of a checkpoint next to the Llama-style
// baseline of the same shape. Reads only config.json, so it is instant even for large models.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "cemlm/cli/commands.h"
#include "cemlm/cli/flags.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/config.h"
#include "cemlm/engine/params.h"

namespace cemlm::cli {
namespace {

std::string with_commas(int64_t n) {
  std::string digits = absl::StrCat(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

std::string columns(const std::string& label, const std::string& model, const std::string& baseline,
                    const std::string& ratio) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-34s %16s %16s %8s\n", label.c_str(), model.c_str(),
                baseline.c_str(), ratio.c_str());
  return buf;
}

std::string row(const std::string& label, int64_t model, int64_t baseline) {
  char ratio[32] = "-";
  if (baseline != 0) std::snprintf(ratio, sizeof ratio, "%.3f", double(model) / double(baseline));
  return columns(label, with_commas(model), with_commas(baseline), ratio);
}

std::string report(const std::string& source, const ModelConfig& c) {
  const ModelConfig b = baseline_of(c);
  const ParamCounts pc = count_params(c), pb = count_params(b);
  std::string s =
      absl::StrCat("checkpoint   ", source, "\nvariant      ", c.variant_name(), "\nbaseline     ",
                   b.variant_name(), " (Llama-style, same shape)\n\n");
  s += columns("", "this model", "baseline", "ratio");
  s += row("parameters, total", pc.total, pb.total);
  s += row("  embedding", pc.embedding, pb.embedding);
  s += row(c.tie_output ? "  output head (tied to embedding)" : "  output head", pc.head, pb.head);
  s += row(absl::StrCat("  per layer (x", c.n_layers, ")"), pc.per_layer, pb.per_layer);
  s += row("  attention, all layers", pc.attention, pb.attention);
  s += row("  mlp, all layers", pc.mlp, pb.mlp);
  s += row("  norms", pc.norms, pb.norms);
  s += row("KV cache, bytes/token (fp32)", c.kv_bytes_per_token(), b.kv_bytes_per_token());
  s += row("KV cache, bytes/token (bf16, CPU)", c.kv_bytes_per_token(KvDtype::kBf16),
           b.kv_bytes_per_token(KvDtype::kBf16));
  s += row("KV cache, bytes/token (int8, CPU)", c.kv_bytes_per_token(KvDtype::kInt8),
           b.kv_bytes_per_token(KvDtype::kInt8));
  s += row(absl::StrCat("KV cache, bytes at ", c.max_seq_len, " tokens"),
           c.kv_bytes_per_token() * c.max_seq_len, b.kv_bytes_per_token() * b.max_seq_len);
  return s;
}

}  // namespace

int cmd_inspect(int argc, char** argv) {
  std::string path;
  Flags flags("cemlm inspect DIR",
              "Print parameter counts (total, embedding, head, per layer, attention, mlp, norms)\n"
              "and KV-cache bytes per token, next to the Llama-style baseline of the same shape\n"
              "(standard attention, SwiGLU, untied table). Reads only config.json.");
  flags.add_positional("DIR", &path, "checkpoint directory (or a config.json file)");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;

  std::error_code ec;
  const bool is_dir = std::filesystem::is_directory(path, ec);
  auto config = is_dir ? load_checkpoint_config(path) : load_config(path);
  if (!config.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(config.status().message()).c_str());
    return 1;
  }
  std::fputs(report(path, *config).c_str(), stdout);
  return 0;
}

}  // namespace cemlm::cli
