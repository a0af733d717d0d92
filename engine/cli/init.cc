// `cemlm init`: a randomly initialised checkpoint (MODEL.md's recommended init) for a config,
// so that every variant can be served and tested without training.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>

#include "cemlm/cli/commands.h"
#include "cemlm/cli/flags.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/config.h"
#include "cemlm/engine/params.h"
#include "cemlm/engine/tokenizer.h"

namespace cemlm::cli {
namespace {

// Ids the tokenizer can produce must have embeddings; a larger model vocabulary is fine (padding).
bool check_tokenizer(const std::string& path, const ModelConfig& c) {
  std::string error;
  auto tok = Tokenizer::load(path, &error, c.vocab_size);
  if (!tok) {
    std::fprintf(stderr, "error: --tokenizer: %s\n", error.c_str());
    return false;
  }
  if (!check_tokenizer_fits(*tok, c.vocab_size, &error)) {
    std::fprintf(stderr, "error: --tokenizer '%s': %s\n", path.c_str(), error.c_str());
    return false;
  }
  return true;
}

}  // namespace

int cmd_init(int argc, char** argv) {
  std::string config_path, out_dir, tokenizer_path;
  uint64_t seed = 0;
  bool force = false;
  Flags flags("cemlm init --config FILE --out DIR [--seed N] [--tokenizer FILE]",
              "Write a checkpoint directory (config.json, model.safetensors[, tokenizer.model])\n"
              "with random weights drawn from MODEL.md's recommended init (except LEV's out_proj:\n"
              "std 1/sqrt(heads * rank) instead of 0.02/sqrt(heads), see docs/TRAINING.md).");
  flags.add("config", &config_path, "model config.json to initialise", true);
  flags.add("out", &out_dir,
            "checkpoint directory to write (one holding weights already is\n"
            "refused without --force; one holding other files always is)",
            true);
  flags.add_bool("force", &force,
                 "replace the checkpoint in --out: its weights, training state and "
                 "tokenizer.model (--tokenizer gives the new one its own)");
  flags.add("seed", &seed, "random seed; the same seed gives the same weights");
  flags.add("tokenizer", &tokenizer_path, "SentencePiece model to copy in as tokenizer.model");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  if (flags.given("tokenizer") && tokenizer_path.empty())
    return usage_error("--tokenizer is empty; name a SentencePiece .model file, or leave it out");
  // Replacing a checkpoint deletes its weights and training state: a trained run's, as likely as
  // a random one's, so the user says so.
  std::error_code ec;
  if (!force && std::filesystem::exists(std::filesystem::path(out_dir) / kWeightsFile, ec)) {
    std::fprintf(
        stderr,
        "error: --out '%s' holds a checkpoint already (%s); pass --force to replace it "
        "(its weights, any training state and its tokenizer.model are deleted), or choose another "
        "directory\n",
        out_dir.c_str(), std::string(kWeightsFile).c_str());
    return 1;
  }

  // A training run saving into --out would replace these weights at its next save.
  if (absl::Status st = check_checkpoint_unlocked(out_dir, "--out"); !st.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(st.message()).c_str());
    return 1;
  }

  auto config = load_config(config_path);
  if (!config.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(config.status().message()).c_str());
    return 1;
  }
  if (!tokenizer_path.empty() && !check_tokenizer(tokenizer_path, *config)) return 1;
  ParamStore params(*config);
  params.init_random(seed);
  if (auto st = save_checkpoint(out_dir, *config, params, tokenizer_path); !st.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  std::printf("wrote %s: %s, %lld parameters, seed %llu%s\n", out_dir.c_str(),
              config->variant_name().c_str(), static_cast<long long>(params.size()),
              static_cast<unsigned long long>(seed),
              tokenizer_path.empty() ? ", no tokenizer" : "");
  return 0;
}

}  // namespace cemlm::cli
