// Shared by the trainer tests: a fresh directory per test, a small generated English-like
// corpus (with fortune-style '%' separators), a tiny CEM model config and fast options.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cemlm/engine/params.h"
#include "cemlm/trainer/train.h"
#include "temp_dir.h"

namespace cemlm::testing_trainer {

inline std::string fresh_dir() { return testing_temp::fresh_dir("trainer"); }

inline void write_file(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

// `n` short documents of simple, repetitive sentences: learnable by a tiny model in a few
// dozen steps. Deterministic for a seed.
inline std::string corpus_text(int n, uint64_t seed) {
  const std::vector<std::string> subjects = {"the cat",     "a dog",        "my friend",
                                             "the old man", "a small bird", "the teacher"};
  const std::vector<std::string> verbs = {"sees", "likes", "finds", "follows", "calls"};
  const std::vector<std::string> objects = {"the ball", "a red apple", "the quiet river",
                                            "a green hat", "the open door"};
  Rng rng(seed);
  std::string text;
  for (int d = 0; d < n; ++d) {
    const int sentences = 1 + int(rng.next_u64() % 3);
    for (int s = 0; s < sentences; ++s)
      text += subjects[rng.next_u64() % subjects.size()] + " " +
              verbs[rng.next_u64() % verbs.size()] + " " +
              objects[rng.next_u64() % objects.size()] + ".\n";
    text += "%\n";
  }
  return text;
}

inline std::string tiny_config_json(const std::string& extra = "") {
  return R"({"architecture": "cemlm", "format_version": 1, "vocab_size": 300, "d_model": 16,
    "n_layers": 1, "n_heads": 2, "head_dim": 4, "d_ff": 24, "max_seq_len": 64,
    "embedding": {"type": "table"}, "attention": {"type": "cem", "diag": "shared",
    "precond_rank": 2}, "mlp": {"type": "cem", "precond_rank": 2},
    "recursion": {"default": 2, "max": 4})" +
         extra + "}";
}

// A tiny model on a ~25 KB corpus under `dir`, evaluated rarely, on one thread.
inline TrainOptions tiny_options(const std::string& dir) {
  write_file(dir + "/text/a.txt", corpus_text(300, 1));
  write_file(dir + "/text/b.txt", corpus_text(300, 2));
  write_file(dir + "/config.json", tiny_config_json());
  TrainOptions o;
  o.config_path = dir + "/config.json";
  o.data = {dir + "/text"};
  o.out_dir = dir + "/run";
  o.steps = 12;
  o.batch_size = 4;
  o.seq_len = 24;
  o.lr = 1e-2;
  o.min_lr = 1e-3;
  o.warmup = 2;
  o.eval_every = 6;
  o.eval_windows = 8;
  o.eval_recursion = {1, 2};
  o.train_recursion = {1, 3};
  o.save_every = 100;
  o.threads = 1;
  return o;
}

}  // namespace cemlm::testing_trainer
